"""Peer copies in the Checkpointer (trainpod.train.checkpoint.peers, with the agents' real copy servers over HTTP):
a commit lands in the next node's memory; a rank whose directory has nothing as new restores from it; the directory
decides where a copy is older, does not arrive whole, or there is none; a copy runs no code."""

import hashlib
import json

import pytest

torch = pytest.importorskip("torch")

from fixtures.states import assert_same  # noqa: E402
from trainpod.agent import peercopy  # noqa: E402
from trainpod.contract import PROGRESS_DIR_VAR  # noqa: E402
from trainpod.train.checkpoint import Checkpointer, CheckpointError  # noqa: E402
from trainpod.train.checkpoint.peers import Peers  # noqa: E402

JOB = "alice~job"


@pytest.fixture
def nodes():
    """Two nodes' agents: the copy servers node 0 and node 1 run."""
    servers = [peercopy.CopyServer("127.0.0.1", JOB) for _ in range(2)]
    yield servers
    for server in servers:
        server.close()


def checkpointer(directory, servers, node: int, lines: list) -> Checkpointer:
    return Checkpointer(directory, keep=2, log=lines.append, peers=Peers([s.address for s in servers], node, JOB))


def test_a_commit_lands_in_the_next_nodes_memory_and_a_node_without_it_on_disk_resumes_from_there(nodes, tmp_path):
    writer_lines, reader_lines = [], []
    writer = checkpointer(tmp_path / "node0", nodes, 0, writer_lines)
    state = {"weights": torch.randn(64, 32), "rng": torch.get_rng_state(), "loss_curve": [(4, 0.5), (8, 0.25)]}
    writer.save(4, {"step": 4})
    writer.save(8, state)
    writer.close()  # the copies are sent before the commit
    assert nodes[0].held()["step"] == 8 and nodes[1].held()["step"] == 8  # node 0's own agent's memory, and node 1's
    manifest = json.loads((tmp_path / "node0" / "ckpt-00000008.json").read_text())
    assert nodes[1].held()["sha256"] == manifest["sha256"]

    reader = checkpointer(tmp_path / "node1", nodes, 1, reader_lines)  # its own directory: empty
    step, loaded = reader.load_latest()
    assert step == 8
    assert_same(loaded, state)
    (line,) = reader_lines
    assert line.startswith(f"resuming from step 8, the copy in the memory of node 1 ({nodes[1].address}): ")
    assert line.endswith(f"; {tmp_path / 'node1'} has no checkpoint"), line
    assert not (tmp_path / "node1").exists()  # a copy is not written to the directory: the next save is


def test_the_directory_decides_where_it_is_as_new_and_where_the_copy_does_not_arrive_whole(nodes, tmp_path):
    lines = []
    writer = checkpointer(tmp_path / "shared", nodes, 0, lines)
    writer.save(8, {"step": 8})
    writer.close()
    reader_lines = []
    reader = checkpointer(tmp_path / "shared", nodes, 1, reader_lines)  # a shared directory: it has step 8
    assert reader.load_latest()[0] == 8
    assert reader_lines == [f"resuming from step 8 ({tmp_path / 'shared' / 'ckpt-00000008.pt'})"]

    nodes[1]._server.data = b"\0" * len(nodes[1]._server.data)  # memory gone bad: same size, other bytes
    reader_lines.clear()
    lost = checkpointer(tmp_path / "empty", nodes, 1, reader_lines)
    assert lost.load_latest() is None
    assert reader_lines == [
        f"the copy of step 8 in node 1's memory did not arrive whole ({nodes[1].address} sent step 8 with another sha256 "
        f"than its manifest's): loading from {tmp_path / 'empty'}",
        f"no checkpoint in {tmp_path / 'empty'}: starting fresh"]


def test_a_node_new_to_the_job_takes_the_copy_in_memory_where_its_directory_is_as_new(nodes, tmp_path):
    writer = checkpointer(tmp_path / "shared", nodes, 0, [])
    writer.save(8, {"step": 8})
    writer.close()
    lines = []
    joiner = Checkpointer(tmp_path / "shared", log=lines.append, peers=Peers([n.address for n in nodes], 1, JOB, new_node=True))
    assert joiner.load_latest()[0] == 8
    assert lines[0].endswith(f"{tmp_path / 'shared'} has step 8 too (a node new to the job reads memory)"), lines
    writer = checkpointer(tmp_path / "shared", nodes, 0, [])
    writer.save(12, {"step": 12})
    writer.close()
    nodes[0]._server.manifest = nodes[1]._server.manifest = None  # no copy held (the nodes restarted): the disk decides
    lines.clear()
    assert joiner.load_latest()[0] == 12 and lines == [f"resuming from step 12 ({tmp_path / 'shared' / 'ckpt-00000012.pt'})"]


@pytest.mark.slow
def test_a_node_alone_keeps_its_own_copy_and_a_send_that_fails_is_said_once_until_one_arrives(nodes, tmp_path):
    lines = []
    alone = Checkpointer(tmp_path / "alone", keep=2, log=lines.append, peers=Peers([nodes[0].address], 0, JOB))
    alone.save(2, {"step": 2})
    alone.close()
    assert nodes[0].held()["step"] == 2 and lines == []

    gone = peercopy.CopyServer("127.0.0.1", JOB)
    address = gone.address
    gone.close()
    ring = Peers([nodes[0].address, address], 0, JOB)
    writer = Checkpointer(tmp_path / "ring", keep=2, log=lines.append, peers=ring)
    for step in (2, 4):
        writer.save(step, {"step": step})
        writer.wait()
    writer.newest_step()  # idle: the copies were tried
    assert len(lines) == 1 and lines[0].startswith(f"could not copy the checkpoint of step 2 to the nodes' memory ({address}: "), lines
    assert lines[0].endswith("; the disk holds it") and nodes[0].held()["step"] == 4  # its own agent took both
    ring.addresses[1] = nodes[1].address  # the next node is back
    writer.save(6, {"step": 6})
    writer.close()
    assert lines[1:] == [f"the checkpoint of step 6 is in the nodes' memory again ({nodes[0].address}, {nodes[1].address})"]
    assert nodes[1].held()["step"] == 6


class Payload:
    """Not a type the weights-only unpickler builds: a pickle that names it would run code to make it."""

    def __reduce__(self):
        return (print, ("a checkpoint ran code",))


def test_a_copy_runs_no_code_it_is_refused_as_a_file_would_be(nodes, tmp_path, capsys):
    data_path = tmp_path / "evil.pt"
    torch.save({"step": Payload()}, data_path)
    data = data_path.read_bytes()
    manifest = {"format": "trainpod-checkpoint", "version": 1, "step": 12, "file": "ckpt-00000012.pt", "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest()}
    Peers([nodes[0].address, nodes[1].address], 0, JOB).send(manifest, data_path)
    reader = checkpointer(tmp_path / "node1", nodes, 1, [])
    with pytest.raises(CheckpointError, match=r"the copy of ckpt-00000012\.pt in the memory of node 1 .*not loaded") as refused:
        reader.load_latest()
    assert refused.value.exit_code == 78
    assert "a checkpoint ran code" not in capsys.readouterr().out


def test_peer_copies_come_from_the_agent_and_a_checkpointer_may_decline_them(nodes, tmp_path, monkeypatch):
    writer = checkpointer(tmp_path / "node0", nodes, 0, [])
    writer.save(4, {"step": 4})
    writer.close()
    peercopy.share(str(tmp_path), [n.address for n in nodes])
    monkeypatch.setenv(PROGRESS_DIR_VAR, str(tmp_path))
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", JOB)
    assert Checkpointer(tmp_path / "node1", log=lambda _: None).load_latest()[0] == 4
    assert Checkpointer(tmp_path / "node1", log=lambda _: None, peers=False).load_latest() is None
