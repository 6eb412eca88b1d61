"""Issue 24: deaths named for what they are. A rank that exits 0 while the others train, a fork server that dies
while it starts the ranks (real torchrun and supervisord on the host), and the kernel's OOM killer in a container
with a memory limit (the real engine): one line each, saying what happened, never a traceback."""

import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest

from fixtures.docker_env import IMAGE, run
from fixtures.processes import host_env as environment
from fixtures.processes import trainpod_run as trainpod
from trainpod.agent import zygote

pytest.importorskip("torch")



def trainpod_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("[node0] trainpod: ")]


# Rank 1 leaves after step 3 (os._exit: at once, without gloo's teardown, which may abort a process whose peers are
# still in a collective); rank 0 trains on and fails in its next all_reduce.
LEAVES_AT_STEP_3 = textwrap.dedent("""
    import os, time
    import torch, torch.distributed as dist
    import trainpod.train.progress

    dist.init_process_group("gloo")
    rank, value = dist.get_rank(), torch.zeros(1)
    for step in range(1, 1000):
        dist.all_reduce(value)
        trainpod.train.progress.step(step)
        if rank == 1 and step == 3:
            os._exit(0)
        time.sleep(0.05)
""")


@pytest.mark.slow
def test_a_rank_that_exits_0_while_the_others_train_is_named_as_that(tmp_path):
    # Before: "rank 0 exited with 1" and gloo's "Connection closed by peer", not the rank that left.
    (tmp_path / "leaves.py").write_text(LEAVES_AT_STEP_3)
    result = subprocess.run(trainpod("--nproc-per-node", "2", "--max-restarts", "1", "--", sys.executable,
                                     str(tmp_path / "leaves.py")),
                            env=environment(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-4000:]
    lines = trainpod_lines(result.stderr)
    left = "rank 1 exited 0 at step 3 while the other ranks were still training"
    assert lines[1].startswith(f"[node0] trainpod: restarting the worker group: {left} "), lines  # the first failure
    assert "rank 0 then exited with 1" in lines[1]
    assert lines[2].startswith("[node0] trainpod: the same failure twice at step 3 without progress: not restarting "
                               f"(exit code 1: {left}"), lines
    assert len(lines) == 3, lines


STEPS = textwrap.dedent("""
    import time
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for step in range(3):
        dist.barrier()
        time.sleep(0.1)
    print("trained", flush=True)
""")


@pytest.mark.slow
def test_a_fork_server_that_dies_while_it_starts_the_ranks_is_a_failed_worker_group_not_a_traceback(tmp_path):
    # Before: the agent crashed with multiprocessing's EOFError (a 40-line traceback), and supervisord restarted it.
    # The server is stopped before it serves, so that the agent's request for the first rank waits on it, then
    # killed, as the OOM killer kills it in a small container (tested with the engine below). The restarted group's
    # server is multiprocessing's own, a new interpreter.
    (tmp_path / "steps.py").write_text(STEPS)
    # torch's log directory in a temporary directory of the test's own (short: multiprocessing's socket is made there)
    temp = tempfile.mkdtemp(prefix="tp-")
    process = subprocess.Popen(trainpod("--warm-start", "on", "--nproc-per-node", "2", "--max-restarts", "1", "--",
                                        sys.executable, str(tmp_path / "steps.py")),
                               env=environment(TMPDIR=temp), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True, cwd=tmp_path)
    try:
        server = None
        deadline = time.monotonic() + 120
        while server is None:  # the job's copy of itself, which becomes the server (trainpod.agent.zygote)
            assert time.monotonic() < deadline and process.poll() is None, "no fork server"
            with contextlib.suppress(psutil.Error):
                server = next((each.pid for each in psutil.Process(process.pid).children(recursive=True)
                               if each.name() == zygote.NAME), None)
            time.sleep(0.01)
        os.kill(server, signal.SIGSTOP)
        # torch makes the attempt's log directories, then asks the server for the ranks
        while not glob.glob(os.path.join(temp, "torchelastic_*", "*", "attempt_0")):
            assert time.monotonic() < deadline and process.poll() is None, "the ranks were never started"
            time.sleep(0.05)
        time.sleep(1)
        os.kill(server, signal.SIGKILL)
        stdout, stderr = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        shutil.rmtree(temp, ignore_errors=True)
    assert process.returncode == 0, stderr[-4000:]  # the restarted group, with a new server, trained
    assert "Traceback" not in stderr and "EOFError" not in stderr, stderr[-4000:]
    assert re.search(rf"^\[node0\] trainpod: restarting the worker group: the fork server of --warm-start \(pid {server}\) was "
                     r"killed by SIGKILL, and every rank of this node with it: restart 1 of 1 without progress$", stderr, re.M), stderr
    assert stdout.count("trained") == 2


@pytest.mark.docker
def test_the_oom_killer_is_named_with_the_containers_memory_limit(docker_ready):
    # The case: cifar10-ddp in a 400 MiB container. The OOM killer takes the fork server (torch preloaded: the
    # largest process), or a rank, or the agent: whichever it takes, one line names it with the limit and the count.
    # Before: a 160-line EOFError traceback, a restart, exit 1, memory never mentioned.
    result = run("docker", "run", "--rm", "--memory", "400m", "--memory-swap", "400m", "--shm-size", "512m",
                 "-e", "TRAINPOD_SYNTHETIC_SAMPLES=512", IMAGE, "trainpod", "run", "--nproc-per-node", "2",
                 "--restart-backoff", "0.1", "--example", "cifar10-ddp", check=False, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 137, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    killed = re.compile(r"was killed by the kernel's OOM killer.*\(its cgroup's memory limit is 400 MiB, oom_kill \d+ in "
                        r"/sys/fs/cgroup/\S*memory\.(events|oom_control): give the job more memory or make it use less\)")
    lines = trainpod_lines(result.stderr)
    assert killed.search(lines[-1]) and "the same failure twice without progress" in lines[-1], lines
    assert all(killed.search(line) for line in lines if "restart" in line), lines  # each attempt's end says it
