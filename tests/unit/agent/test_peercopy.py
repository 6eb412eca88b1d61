"""trainpod.agent.peercopy: the copy server an agent runs under --peer-copies, driven over real HTTP by the ranks'
client (trainpod.train.checkpoint.peers), and the addresses' exchange over a real TCPStore."""

import hashlib
import threading
from datetime import timedelta

import pytest

from trainpod.agent import peercopy
from trainpod.train.checkpoint.peers import PeerError, Peers


def manifest_of(step: int, data: bytes) -> dict:
    return {"format": "trainpod-checkpoint", "version": 1, "step": step, "file": f"ckpt-{step:08d}.pt", "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}


@pytest.fixture
def server():
    server = peercopy.CopyServer("127.0.0.1", "job-1")
    yield server
    server.close()


def sender_to(server, job="job-1") -> Peers:
    return Peers([server.address], me=0, job=job)  # a node alone: its checkpoints go to its own agent


def put(server, tmp_path, step: int, data: bytes, manifest: dict | None = None, job="job-1") -> str:
    path = tmp_path / f"ckpt-{step:08d}.pt"
    path.write_bytes(data)
    return sender_to(server, job).send(manifest or manifest_of(step, data), path)


def test_a_copy_sent_is_held_and_fetched_whole(server, tmp_path):
    data = bytes(range(256)) * 4096
    assert put(server, tmp_path, 8, data) == [server.address]
    assert server.held()["step"] == 8
    held = Peers([server.address], me=0, job="job-1").newest()
    assert (held.node, held.address, held.step) == (0, server.address, 8)
    assert Peers([server.address], me=0, job="job-1").fetch(held) == data


def test_only_this_jobs_whole_and_newest_copy_is_kept(server, tmp_path):
    # Whole by its size: its bytes are checked against the manifest's sha256 by the rank that fetches it
    # (test_a_copy_that_does_not_match_its_manifest_is_refused_where_it_is_fetched), not by the agent.
    put(server, tmp_path, 8, b"eight")
    with pytest.raises(PeerError, match="409: this node holds copies for the job 'job-1' only"):
        put(server, tmp_path, 12, b"another job's", job="job-2")
    with pytest.raises(PeerError, match="400: the manifest says 6 bytes, the request 7"):
        put(server, tmp_path, 12, b"twelve!", manifest=manifest_of(12, b"TWELVE"))
    with pytest.raises(PeerError, match="409: this node holds the newer step 8"):
        put(server, tmp_path, 4, b"four")
    assert server.held()["step"] == 8
    put(server, tmp_path, 8, b"eight again")  # the same step again: replaced (a save of a step replaces it)
    assert Peers([server.address], me=0, job="job-1").fetch(Peers([server.address], 0, "job-1").newest()) == b"eight again"
    assert Peers([server.address], me=0, job="job-2").newest() is None  # another job asks: nothing for it


def test_a_copy_replaced_between_the_question_and_the_fetch_is_refused_not_mixed(server, tmp_path):
    put(server, tmp_path, 8, b"eight")
    peers = Peers([server.address], me=0, job="job-1")
    held = peers.newest()
    put(server, tmp_path, 12, b"twelve")
    with pytest.raises(PeerError, match="409: this node now holds step 12"):
        peers.fetch(held)


@pytest.mark.slow
def test_the_newest_copy_of_any_node_wins_and_a_node_gone_is_passed_over(tmp_path):
    servers = [peercopy.CopyServer("127.0.0.1", "job-1") for _ in range(3)]
    try:
        put(servers[0], tmp_path, 4, b"four")
        put(servers[2], tmp_path, 16, b"sixteen")
        gone = servers[1].address
        servers[1].close()
        held = Peers([s.address for s in servers], me=1, job="job-1").newest()
        assert (held.node, held.step) == (2, 16) and gone != held.address
    finally:
        for server in (servers[0], servers[2]):
            server.close()


def test_a_node_sends_to_its_own_agent_and_the_next_nodes_in_the_ring():
    assert Peers(["a:1", "b:2", "c:3"], me=2, job="j").targets() == ["c:3", "a:1"]
    assert Peers(["a:1", "b:2", "c:3"], me=0, job="j").targets() == ["a:1", "b:2"]
    assert Peers(["a:1"], me=0, job="j").targets() == ["a:1"]
    assert Peers([], me=0, job="j").targets() == []  # the round's servers were not found: no copies


def test_a_copy_one_node_did_not_take_is_named_and_the_others_keep_theirs(server, tmp_path):
    path = tmp_path / "ckpt-00000004.pt"
    path.write_bytes(b"four")
    with pytest.raises(PeerError, match=r"^127\.0\.0\.1:1: "):  # nobody listens there
        Peers([server.address, "127.0.0.1:1"], me=0, job="job-1").send(manifest_of(4, b"four"), path)
    assert server.held()["step"] == 4


def test_the_ranks_read_the_servers_their_agent_wrote_for_the_round_and_their_node_from_torch(tmp_path):
    peercopy.share(str(tmp_path), ["10.0.0.1:4000", "[fd00::2]:4001"])
    env = {"TRAINPOD_PROGRESS_DIR": str(tmp_path), "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "alice~job"}
    peers = Peers.from_env(env)
    assert (peers.addresses, peers.me, peers.job, peers.successor()) == (["10.0.0.1:4000", "[fd00::2]:4001"], 1,
                                                                         "alice~job", "10.0.0.1:4000")
    assert not peers.new_node
    peercopy.share(str(tmp_path), ["10.0.0.1:4000"], new=True)  # a joiner's, a spare's round
    assert Peers.from_env(env).new_node
    assert Peers.from_env({}) is None  # outside trainpod run
    assert Peers.from_env({"TRAINPOD_PROGRESS_DIR": str(tmp_path / "none")}) is None  # no --peer-copies
    (tmp_path / "peer-copies.json").write_text("{not json")
    assert Peers.from_env(env) is None


def test_every_node_learns_every_nodes_server_from_the_rounds_store():
    from torch.distributed import TCPStore

    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    found = {}

    def node(rank: int) -> None:
        store = TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=10))
        found[rank] = peercopy.exchange(store, rank, 3, f"10.0.0.{rank}:{4000 + rank}")

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (2, 0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert found == dict.fromkeys(range(3), ["10.0.0.0:4000", "10.0.0.1:4001", "10.0.0.2:4002"])


def test_a_copy_that_does_not_match_its_manifest_is_refused_where_it_is_fetched(server, tmp_path):
    put(server, tmp_path, 12, b"twelve", manifest=manifest_of(12, b"TWELVE"))
    peers = Peers([server.address], me=0, job="job-1")
    with pytest.raises(PeerError, match="sent step 12 with another sha256 than its manifest's"):
        peers.fetch(peers.newest())


def test_a_peer_that_takes_the_connection_and_never_answers_costs_its_timeout_not_a_hang(tmp_path, monkeypatch):
    import socket

    from trainpod.train.checkpoint import peers as peers_module

    monkeypatch.setattr(peers_module, "ASK_TIMEOUT_S", 0.3)
    monkeypatch.setattr(peers_module, "TRANSFER_TIMEOUT_S", 0.3)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts; nobody reads or answers
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        peers = Peers([address], me=0, job="job-1")
        assert peers.newest() is None
        path = tmp_path / "ckpt-00000004.pt"
        path.write_bytes(b"four")
        with pytest.raises(PeerError, match=rf"^{address}: "):
            peers.send(manifest_of(4, b"four"), path)
