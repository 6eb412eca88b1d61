"""No hang without a message, on this host (real torchrun, supervisord and py-spy, no Docker): a rank
asleep before init_process_group, a skipped collective and a SIGSTOPped rank are each named in one
line within --hang-timeout + 15 s with every rank's stack written; the first two end with 124, the
SIGSTOP one recovers from its checkpoint with the weights of an uninterrupted run. A long compute
and data phase is not a hang. A job whose ranks report their steps is judged by its pace: a rank
stopped in a job of 0.2 s steps is named within the adaptive bound (8 s), with --hang-timeout 120."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from test_resume import COMMON, ENTRYPOINT, JOBS, ranks_of

from fixtures.ports import free_port

pytestmark = [pytest.mark.slow]

ARGS = [*JOBS["cifar10-ddp"][0], *COMMON]
HANG_JOB = Path(__file__).resolve().parent / "hangs" / "hang_job.py"
TIMEOUT = 10
MARK = re.compile(r"hang-job: rank (\d+) hang starts.* at ([0-9.]+)")
HANG_LINE = re.compile(r"^\[node0\] trainpod: hang: .*$", re.M)
# A stopped example rank's innermost frame outside torch. Where a SIGSTOP lands is chance: the training
# loop, its checkpoint's gather (TrainState.save), the pre-emption vote, a paced job's sleep between two steps
# (the failpoint pace, trainpod/failpoints.py: a CI run stopped rank 2 there)... Any frame of the example or of
# the library it imports is right; a torch frame, or none, is not.
STOPPED_AT = r"(?:examples/\w+\.py|train/[\w/]+\.py|trainpod/failpoints\.py):\d+ in [\w.]+"


class Job:
    """`trainpod run` on this host, its output timestamped line by line as it arrives."""

    def __init__(self, out: Path, *args: str, timeout: float = TIMEOUT):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "PET_", "PAI_"))}
        env.update(PYTHONPATH=ENTRYPOINT, TRAINPOD_OUTPUT_DIR=str(out / "output"))
        command = [sys.executable, "-m", "trainpod", "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                   "--hang-timeout", str(timeout), "--restart-backoff", "0.1", *args]
        self.process = subprocess.Popen(command, env=env, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.out = out

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.time(), line))

    def finish(self, timeout: float = 240) -> tuple[int, str]:
        try:
            code = self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        self.reader.join(timeout=5)
        return code, "".join(line for _, line in self.lines)

    def arrival(self, pattern: re.Pattern) -> tuple[float, str]:
        return next((at, line) for at, line in self.lines if pattern.search(line))

    def stacks(self) -> dict[str, str]:
        [directory] = (self.out / "output" / "hangs").glob("*-node0")
        return {path.name: path.read_text() for path in directory.glob("rank*.txt")}


def hang_job(out: Path, *args: str, timeout: float = TIMEOUT) -> Job:
    out.mkdir()
    return Job(out, "--max-restarts", "0", "--", sys.executable, str(HANG_JOB), *args, timeout=timeout)


def reported_within_the_bound(job: Job, log: str) -> str:
    starts = [float(m.group(2)) for m in MARK.finditer(log)]
    assert starts, log[-3000:]
    reported_at, line = job.arrival(HANG_LINE)
    assert reported_at - min(starts) <= TIMEOUT + 15, (reported_at - min(starts), log[-3000:])
    assert len(HANG_LINE.findall(log)) == 1, log[-3000:]
    return line


def test_a_rank_asleep_before_init_process_group_is_named_and_the_job_ends_124(tmp_path):
    job = hang_job(tmp_path / "job", "sleep-before-init", "--rank", "1")
    code, log = job.finish()
    assert code == 124, log[-3000:]
    line = reported_within_the_bound(job, log)
    assert "behind: rank 1 idle (no CPU, same stack) at hangs/hang_job.py:" in line, line
    assert "no step reported; rank 0 waits for it in init_process_group" in line
    assert "rank 1 hung (124: stopped by the hang watch) after 1 attempt(s), 0 restart(s) without progress" in log, log[-3000:]
    stacks = job.stacks()
    assert "init_process_group" in stacks["rank0.txt"] and "hang_job.py" in stacks["rank1.txt"]
    assert "Traceback" not in log


def test_a_skipped_collective_is_named_with_each_ranks_collective_and_the_job_ends_124(tmp_path):
    job = hang_job(tmp_path / "job", "skip", "--rank", "1", "--at", "3")
    code, log = job.finish()
    assert code == 124, log[-3000:]
    line = reported_within_the_bound(job, log)
    assert "the ranks wait in different collectives (rank 0 in all_reduce at hangs/hang_job.py:" in line, line
    assert "rank 1 in barrier at hangs/hang_job.py:" in line
    assert "out of step: rank 0 (step 5), rank 1 (step 6)" in line
    stacks = job.stacks()
    assert "all_reduce" in stacks["rank0.txt"] and "barrier" in stacks["rank1.txt"]


def test_long_compute_and_data_phases_are_no_hang(tmp_path):
    # 2 x 12 s phases with a 10 s timeout: all ranks busy or reading, then rank 1 waits on rank 0's compute.
    job = hang_job(tmp_path / "job", "slow", "--seconds", "12")
    code, log = job.finish()
    assert code == 0, log[-3000:]
    assert "hang:" not in log and log.count("done") == 2
    assert not (tmp_path / "job" / "output" / "hangs").exists()


def test_a_stopped_rank_of_a_paced_job_is_named_by_its_pace_long_before_the_hang_timeout(tmp_path):
    from trainpod.agent.hang import ADAPTIVE_FLOOR_S

    job = hang_job(tmp_path / "job", "run", "--steps", "3000", timeout=120)  # steps of 0.2 s, each reported
    try:
        deadline = time.monotonic() + 120
        while not any("runs its steps" in line for _, line in job.lines):
            assert job.process.poll() is None and time.monotonic() < deadline, "".join(line for _, line in job.lines)
            time.sleep(0.1)
        time.sleep(8)  # the watch sees every rank advance at several looks: their pace is known
        victim = next(p for p in psutil.Process(job.process.pid).children(recursive=True)
                      if str(HANG_JOB) in " ".join(p.cmdline()) and not p.children() and p.environ().get("RANK") == "1")
        victim.send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        code, log = job.finish(timeout=120)  # --hang-timeout's 120 s would end it only after this
    finally:
        if job.process.poll() is None:
            job.process.kill()
    assert code == 124, log[-3000:]
    reported_at, line = job.arrival(HANG_LINE)
    # the bound, and at most two looks of the watch (one a second) and a stack read on either side of it
    assert reported_at - stopped_at <= ADAPTIVE_FLOOR_S + 4, (reported_at - stopped_at, line)
    assert re.search(r"hang: no progress for \d+s \(the job's pace: steps of 0\.2\d*s; bound 8s\); behind: rank 1 stopped at "
                     r"hangs/hang_job\.py:\d+ in main, step \d+; rank 0 waits for it", line), line
    print(f"\na rank stopped in a job of 0.2 s steps: named after {reported_at - stopped_at:.1f} s (--hang-timeout 120)")


def example(out: Path) -> Job:
    out.mkdir()
    return Job(out, "--max-restarts", "2", "--example", "cifar10-ddp", "--", *ARGS, "--epochs", "4",
               "--output-dir", str(out / "output"), "--checkpoint-dir", str(out / "ckpt"))


def metrics(job: Job) -> dict:
    code, log = job.finish()
    assert code == 0, log[-4000:]
    return json.loads((job.out / "output" / "metrics.json").read_text())


def test_a_sigstopped_rank_is_named_killed_and_the_job_resumes_bit_identical(tmp_path):
    reference = metrics(example(tmp_path / "a"))
    job = example(tmp_path / "b")
    deadline = time.monotonic() + 120
    while not (job.out / "ckpt" / "ckpt-00000012.json").exists():
        assert job.process.poll() is None and time.monotonic() < deadline, "".join(line for _, line in job.lines)
        time.sleep(0.05)
    victim = ranks_of("cifar10-ddp", job.out / "ckpt")[1]
    victim.send_signal(signal.SIGSTOP)
    stopped_at = time.time()
    resumed = metrics(job)
    log = "".join(line for _, line in job.lines)

    reported_at, line = job.arrival(HANG_LINE)
    assert reported_at - stopped_at <= TIMEOUT + 15, (reported_at - stopped_at, line)
    # Where the SIGSTOP caught it: in the step (the harness's train) or in the stop vote after it.
    assert re.search(rf"behind: rank \d stopped at {STOPPED_AT}, step \d+; rank \d waits for it", line), line
    assert re.search(r"restarting the worker group: rank \d hung \(124: stopped by the hang watch\): restart 1 of 2", log), log[-3000:]
    assert not psutil.pid_exists(victim.pid) or victim.status() == psutil.STATUS_ZOMBIE
    assert "resumed from the checkpoint of step" in log
    assert resumed["checksum"] == reference["checksum"] and len(set(resumed["rank_checksums"])) == 1
    stacks = job.stacks()
    assert sorted(stacks) == ["rank0.txt", "rank1.txt"] and any(" stopped at " in text for text in stacks.values())
