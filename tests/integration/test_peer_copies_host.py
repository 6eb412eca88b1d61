"""--peer-copies on this host, with a real etcd and real torchrun (tests/fixtures/elastic_host.py): a lost node's
disk goes with it, and the job goes on from the copy in a survivor's memory, not from the beginning; a node that
joins takes its first step from a peer's memory, not from the shared disk.

Each node has a checkpoint directory of its own (a node-local disk), so only the node of rank 0, which writes the
checkpoints, has them on disk. Nodes a and b train cifar10-ddp at --nnodes 1:2 over etcd-v3 with --peer-copies, a
third node c waits as a spare (--spares 1). Rank 0's node is killed, its directory deleted: the survivor's and the
spare's directories hold no checkpoint, and both must resume from the checkpoint rank 0 committed last, fetched
from the memory of the survivor's agent (the ring sent it there). Their world is 2 again, so the job must end with
the weights of the same job run without the kill, bit for bit.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from fixtures.elastic_host import STEPS, Node, clean_env, scale_down, scale_up, trainpod_argv

pytestmark = pytest.mark.slow
pytest.importorskip("torch")

TIMEOUT_S = 240
EPOCHS = 20  # 80 steps at world 2, each at least PACE_MS long: time for the spare to start and wait (from steps of a
PACE_MS = 200  # known length, not from more training: the suite's time is the CPU its jobs take, tests/README.md)
STEPS_AT_ONE = STEPS // 2 * EPOCHS  # the whole run's steps at world 1 (fixtures.elastic_host: 2 epochs there)
RESUMED = re.compile(r"resuming from step (\d+), the copy in the memory of node \d \(([\d.]+:\d+)\): [\d.]+ MB in [\d.]+ s; "
                     r"(\S+) has no checkpoint")


def node_argv(endpoint, workdir, name: str, *extra: str) -> list[str]:
    # The id said: the job's digest takes in the command, which differs per node here (each node's own directory).
    argv = trainpod_argv("etcd-v3", endpoint, workdir, "--rdzv-conf", "last_call_timeout=30", "--peer-copies",
                         "--rdzv-id", f"peer-copies-{workdir.name}", *extra) + ["--epochs", str(EPOCHS)]
    argv[argv.index("--checkpoint-dir") + 1] = str(workdir / f"ckpt-{name}")  # this node's own disk
    return argv


def job_env() -> dict[str, str]:
    return clean_env(TRAINPOD_FAILPOINTS=f"pace@{PACE_MS}")


def uninterrupted_checksum(endpoint, workdir) -> str:
    """The same job's final weights, its two nodes never interrupted (unpaced: a pace changes when a step runs, not
    what it computes)."""
    nodes = [Node(name, node_argv(endpoint, workdir, name), clean_env(), workdir / "logs") for name in "ab"]
    try:
        codes = [node.wait(TIMEOUT_S) for node in nodes]
        assert codes == [0, 0], "\n---\n".join(node.text()[-3000:] for node in nodes)
    finally:
        for node in nodes:
            node.stop()
    return json.loads((workdir / "out" / "metrics.json").read_text())["checksum"]


def test_a_lost_nodes_checkpoints_come_back_from_a_survivors_memory_and_the_job_ends_as_if_never_interrupted(etcd, tmp_path):
    names = iter("abc")
    result = scale_down(lambda: node_argv(etcd.endpoint, tmp_path, next(names), "--spares", "1"), job_env(), tmp_path,
                        TIMEOUT_S, spare=True, steps=STEPS_AT_ONE)
    lost = result["lost"].name
    logs = {name: (tmp_path / "logs" / f"{name}.log").read_text() for name in "abc"}
    assert result["codes"] == [0, 0], "\n---\n".join(f"{name}:\n{text[-4000:]}" for name, text in logs.items())
    shutil.rmtree(tmp_path / f"ckpt-{lost}", ignore_errors=True)  # gone with its node (nobody read it since)
    resumed = {}
    for name in sorted(set("abc") - {lost}):  # the survivor and the spare: neither directory held a checkpoint
        found = RESUMED.findall(logs[name])
        assert found, logs[name][-4000:]
        step, _, directory = found[-1]
        assert directory == str(tmp_path / f"ckpt-{name}"), found
        resumed[name] = int(step)
    assert len(set(resumed.values())) == 1 and min(resumed.values()) > 0, resumed
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == STEPS_AT_ONE // 2, metrics
    assert metrics["checksum"] == uninterrupted_checksum(etcd.endpoint, tmp_path / "reference"), metrics
    print(f"\nresumed from step {min(resumed.values())} in a survivor's memory, {result['recovery_s']:.1f} s from the kill to "
          "the first step at world 2; the final weights are the uninterrupted run's")


def test_a_node_that_joins_takes_its_first_step_from_a_peers_memory_not_from_the_shared_disk(etcd, tmp_path):
    """One directory for both nodes (shared): a trains at world 1; b starts and joins. At world 2 a's rank resumes from
    the directory, b's from the copy in a's agent's memory, of the same step: its node is new to the job."""
    def argv():
        return trainpod_argv("etcd-v3", etcd.endpoint, tmp_path, "--peer-copies") + ["--epochs", str(EPOCHS)]

    result = scale_up(argv, job_env(), tmp_path, TIMEOUT_S)
    first, joiner = result["nodes"]
    assert result["joined_s"] is not None, "\n---\n".join(node.text()[-3000:] for node in result["nodes"])
    joined = joiner.find(r"the copy in the memory of node")
    assert joined, joiner.text()[-3000:]
    step = re.search(r"resuming from step (\d+), the copy in the memory of node \d \([\d.:]+\): [\d.]+ MB in [\d.]+ s; "
                     r"(\S+) has step (\d+) too \(a node new to the job reads memory\)$", joined[1])
    assert step and step[2] == str(tmp_path / "ckpt") and step[1] == step[3], joined[1]
    assert first.find(rf"resuming from step {step[1]} \({tmp_path / 'ckpt'}/ckpt-0*{step[1]}\.pt\)$", after=joined[0] - 30), \
        first.text()[-3000:]
    print(f"\nthe joiner's first step at world 2 {result['joined_s']:.1f} s after its start, from step {step[1]} in memory")
