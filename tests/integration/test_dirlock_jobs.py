"""trainpod.supervisor.dirlock with real `trainpod run` jobs on the host (supervisord, torchrun, gloo; no Docker):
one job per checkpoint directory. Each test runs past --lock-timeout (set low) several times.

- a second job on a directory in use is refused (78, one line naming the holder) while the first
  trains on and ends with 0; a job started after that one ended takes the directory at once;
- a job killed outright (every process) is taken over once its heartbeat has stopped for the timeout;
- a node of a 2-node job killed and started again joins its own job's directory, and the job ends 0.
"""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.ports import free_port
from fixtures.processes import host_env, kill_tree

pytest.importorskip("torch")

pytestmark = pytest.mark.slow

LOCK = 2  # --lock-timeout

SCRIPT = """
import sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
for step in range(int(sys.argv[1])):
    dist.all_reduce(t)
    time.sleep(0.1)
    if step % 10 == 0:
        print(f"step {step}", flush=True)
print("done", flush=True)
"""


def start(tmp: Path, name: str, checkpoints: Path, port: int, steps: int, nnodes: int = 1, node_rank: int = 0) -> subprocess.Popen:
    env = host_env(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TRAINPOD_CHECKPOINT_DIR=str(checkpoints))
    if nnodes > 1:
        env.update(NNODES=str(nnodes), NODE_RANK=str(node_rank))
    script = tmp / "loop.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "trainpod", "run", "--nproc-per-node", "1", "--lock-timeout", str(LOCK),
               "--rejoin-timeout", "30", "--", sys.executable, str(script), str(steps)]
    log = (tmp / f"{name}.log").open("w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def text(tmp: Path, name: str) -> str:
    return (tmp / f"{name}.log").read_text()


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def stop(*jobs: subprocess.Popen) -> None:
    for job in jobs:
        if job.poll() is None:
            kill_tree(job.pid)
            job.wait()


def test_a_second_job_on_a_directory_in_use_is_refused_and_the_next_one_takes_it_when_the_first_ended(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    first = start(tmp_path, "first", checkpoints, free_port(), steps=150)  # 15 s and more: past the timeout 7 times
    second = third = None
    try:
        wait_for(lambda: "step 20" in text(tmp_path, "first"), 120, "the first job never trained:\n" + text(tmp_path, "first"))
        time.sleep(2 * LOCK)  # its heartbeat, not its start, keeps the directory
        began = time.monotonic()
        second = start(tmp_path, "second", checkpoints, free_port(), steps=10)
        assert second.wait(timeout=60) == 78, text(tmp_path, "second")
        assert time.monotonic() - began < 30
        errors = [line for line in text(tmp_path, "second").splitlines() if "error" in line]
        assert len(errors) == 1, text(tmp_path, "second")
        assert re.fullmatch(rf"\[node0\] trainpod: error: the checkpoint directory {checkpoints} "
                            r"\(TRAINPOD_CHECKPOINT_DIR\) is in use by job 'c10d@127\.0\.0\.1:\d+@.+' \(node 0 on .+, pid \d+\), "
                            r"which is running .*", errors[0]), errors[0]
        assert "step" not in text(tmp_path, "second")  # refused before any rank ran
        assert first.wait(timeout=120) == 0, text(tmp_path, "first")
        assert "done" in text(tmp_path, "first")

        began = time.monotonic()
        third = start(tmp_path, "third", checkpoints, free_port(), steps=10)
        assert third.wait(timeout=120) == 0, text(tmp_path, "third")
        assert "which ended: this job holds it now" in text(tmp_path, "third"), text(tmp_path, "third")
    finally:
        stop(first, *(job for job in (second, third) if job))


def test_a_job_killed_outright_is_taken_over_after_its_heartbeat_stopped(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    first = start(tmp_path, "first", checkpoints, free_port(), steps=10000)
    second = None
    try:
        wait_for(lambda: "step 10" in text(tmp_path, "first"), 120, "the first job never trained:\n" + text(tmp_path, "first"))
        kill_tree(first.pid)  # every process of it: no heartbeat, no "ended" mark
        first.wait()
        second = start(tmp_path, "second", checkpoints, free_port(), steps=10)
        assert second.wait(timeout=120) == 0, text(tmp_path, "second")
        line = next(line for line in text(tmp_path, "second").splitlines() if "takes it over" in line)
        assert re.search(r"was held by job 'c10d@127\.0\.0\.1:\d+@.+' \(node 0 on .+\), whose heartbeat stopped \d+s ago "
                         rf"\(--lock-timeout {LOCK}\): this job takes it over", line), line
    finally:
        stop(first, *(job for job in (second,) if job))


def test_a_node_killed_and_started_again_joins_its_own_jobs_directory(tmp_path):
    checkpoints = tmp_path / "checkpoints"  # one volume, both nodes: the job's own, shared
    port = free_port()
    nodes = [start(tmp_path, f"node{rank}", checkpoints, port, steps=200, nnodes=2, node_rank=rank) for rank in (0, 1)]
    try:
        wait_for(lambda: "step 20" in text(tmp_path, "node1"), 120, "node 1 never trained:\n" + text(tmp_path, "node1"))
        time.sleep(2 * LOCK)
        kill_tree(nodes[1].pid)  # the whole node: its trainpod, supervisord, agent, rank
        nodes[1].wait()
        (tmp_path / "node1.log").rename(tmp_path / "node1-killed.log")
        nodes[1] = start(tmp_path, "node1", checkpoints, port, steps=200, nnodes=2, node_rank=1)
        codes = [node.wait(timeout=240) for node in nodes]
        logs = text(tmp_path, "node0") + text(tmp_path, "node1")
        assert codes == [0, 0], logs
        assert "in use by" not in logs and "takes it over" not in logs, logs
        assert text(tmp_path, "node1").count("done") == 1, logs
    finally:
        stop(*nodes)
