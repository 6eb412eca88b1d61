"""Issue 29 on the host (two real `trainpod run` nodes, real torchrun, no Docker): a job that recovered
from a killed rank keeps training past every timer the recovery started, and finishes with 0.

The bug: torch stops the ranks before each worker-group restart through the agent's _shutdown(), which
also closed trainpod's JobControl, so the master's last answer froze: exactly --rejoin-timeout after a
restart, the node that does not host the store declared the master lost while it was still training
(69), and the master's node died of the same failure twice. Every test here trains at least
3 x --rejoin-timeout after the restart, so a timer that a restart leaves running ends the job.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.ports import free_port
from fixtures.processes import host_env, script_rank_pid

pytest.importorskip("torch")

pytestmark = pytest.mark.slow

REJOIN = 4  # --rejoin-timeout: low, so that training runs well past it after each restart
AFTER = 3 * REJOIN  # seconds of training after the restart that every test asks for, at least

# A plain torch.distributed script with no checkpoint: each attempt starts at step 0 and trains STEPS steps.
SCRIPT = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
for step in range(int(sys.argv[1])):
    dist.all_reduce(t)
    time.sleep(0.1)
    if step % 10 == 0:
        print(f"step {step} restart {os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
print("done", flush=True)
"""


def node(tmp: Path, node_rank: int, port: int, *flags: str, steps: int) -> subprocess.Popen:
    env = host_env(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NNODES="2", NODE_RANK=str(node_rank))
    script = tmp / "long.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "trainpod", "run", "--nproc-per-node", "1", "--rejoin-timeout", str(REJOIN),
               "--max-restarts", "3", *flags, "--", sys.executable, str(script), str(steps)]
    log = (tmp / f"node{node_rank}.log").open("w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return found


def run_and_kill(tmp: Path, victim_node: int, *flags: str, steps: int) -> tuple[list[int], list[str], float]:
    """Start two nodes, SIGKILL `victim_node`'s rank once both train; (exit codes, logs, seconds from the kill to the end)."""
    port = free_port()
    jobs = [node(tmp, rank, port, *flags, steps=steps) for rank in (0, 1)]
    try:
        log = tmp / f"node{victim_node}.log"
        wait_for(lambda: "step 10 restart 0" in log.read_text(), 120, f"no step 10 on node {victim_node}")
        os.kill(wait_for(lambda: script_rank_pid(jobs[victim_node].pid, "long.py"), 10, "no rank found"), signal.SIGKILL)
        killed = time.monotonic()
        codes = [job.wait(timeout=AFTER + steps * 0.3 + 120) for job in jobs]
        ended = time.monotonic()
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
    return codes, [(tmp / f"node{rank}.log").read_text() for rank in (0, 1)], ended - killed


@pytest.mark.parametrize("warm", ["off", "on"])
@pytest.mark.parametrize("victim", [1, 0], ids=["node 1's rank", "node 0's rank"])
def test_a_job_restarted_after_a_killed_rank_trains_past_the_rejoin_timeout_and_ends_with_0(tmp_path, victim, warm):
    steps = 10 * AFTER  # 0.1 s a step: the restarted attempt alone trains at least AFTER seconds
    codes, logs, after_kill = run_and_kill(tmp_path, victim, "--warm-start", warm, steps=steps)
    both = logs[0][-4000:] + logs[1][-4000:]
    assert codes == [0, 0], both
    assert after_kill >= AFTER, both  # the test ran past the timer it set low
    assert "stopped answering" not in both and "went away" not in both, both
    assert "restarting the worker group" in logs[victim], both
    for node_rank, log in enumerate(logs):
        # Ranks where the platform put them: node N hosts rank N (1 process a node) in both worker groups,
        # whichever agent joined the rendezvous first (on one host, torch numbers them by their pids).
        assert set(re.findall(r"^\[node\d rank\d\]", log, re.M)) == {f"[node{node_rank} rank{node_rank}]"}, both
        assert len(re.findall(r"\] step 0 restart", log)) == 2, both  # each node trained in a second group
        assert "] done" in log, both
