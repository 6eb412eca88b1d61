"""Issue 15 on the host (real torchrun, warm ranks under real keepers, no Docker): with --recovery in-process a
SIGKILLed rank is replaced while the other rank keeps its process, and the weights end bit-identical to an
uninterrupted run; a replacement that cannot start falls back to a restart of the whole worker group."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fixtures import stuck_stacks
from fixtures.ports import free_port

pytest.importorskip("torch")

# One worker runs the module (make test: pytest-xdist, --dist loadgroup): the uninterrupted runs the tests compare
# with are the module fixture `reference`, made once.
pytestmark = [pytest.mark.xdist_group("inprocess_recovery")]

ENTRYPOINT = str(Path(__file__).resolve().parents[2] / "entrypoint")
EVERY = 5
# 2 epochs of 1024 samples per rank in batches of 32: 64 steps, a checkpoint every 5.
JOB = ["--epochs", "2", "--synthetic-samples", "2048", "--batch-size", "32", "--checkpoint-every", str(EVERY), "--log-every", "1"]
KILL_AT = 20  # a checkpoint's step: the kill follows its log line, maybe before the checkpoint is committed
STEP = re.compile(r"\] epoch \d+/\d+ step (\d+)/")
GROUP_RESTART = "restarting the worker group"


def start(out: Path, *flags: str, nproc: int = 2, **env: str) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "PET_", "PAI_", "TORCHELASTIC_"))}
    # gloo also on a GPU host (in-process recovery is refused with NCCL, whose collectives do not fail when a peer dies)
    command = [sys.executable, "-m", "trainpod", "run", "--no-supervise", "--nproc-per-node", str(nproc), "--master-port",
               str(free_port()), "--backend", "gloo", *flags, "--example", "cifar10-ddp", "--", *JOB, "--checkpoint-dir",
               str(out / "ckpt"),
               "--output-dir", str(out / "out")]
    return subprocess.Popen(command, env={**clean, "PYTHONPATH": ENTRYPOINT, "OMP_NUM_THREADS": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def ranks(job: subprocess.Popen) -> dict[str, int]:
    """rank<R> and keeper<R> -> pid, among the job's processes."""
    found = {}
    for process in psutil.Process(job.pid).children(recursive=True):
        try:
            name = process.name()
        except psutil.NoSuchProcess:
            continue
        if re.fullmatch(r"(rank|keeper)\d+", name):
            found[name] = process.pid
    return found


def finish(job: subprocess.Popen, lines: list[str], timeout: float = 300) -> tuple[int, str]:
    deadline = time.monotonic() + timeout
    for line in job.stdout:
        lines.append(line)
        if time.monotonic() > deadline:
            os.killpg(job.pid, signal.SIGKILL)
    return job.wait(), "".join(lines)


def said(log: str) -> str:
    """The job's own lines (the keepers', the agent's, the resumes), not its step lines."""
    return "".join(line + "\n" for line in log.splitlines() if not STEP.search(line))[-6000:]


def stuck(out: Path) -> str:
    """The native stacks of every rank that trainpod.train.inprocess ended as stuck (fixtures.stuck_stacks)."""
    return stuck_stacks.report({dump.name: dump.read_text() for dump in (out / "out" / "hangs").glob(stuck_stacks.PATTERN)})


def metrics(out: Path) -> dict:
    return json.loads((out / "out" / "metrics.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """nproc -> the checksum of an uninterrupted run's weights."""
    checksums = {}

    def of(nproc: int) -> str:
        if nproc not in checksums:
            out = tmp_path_factory.mktemp(f"reference{nproc}")
            code, log = finish(start(out, nproc=nproc), [])
            assert code == 0, log[-3000:]
            checksums[nproc] = metrics(out)["checksum"]
        return checksums[nproc]

    return of


def run_and_kill(out: Path, victim: int | tuple[int, ...], nproc: int = 2, **env: str) -> tuple[int, str, dict, dict]:
    """Start an in-process job, SIGKILL rank `victim` (or each of several at once) after step KILL_AT; (exit code,
    log, processes before the kill, processes once the group re-formed or restarted)."""
    job = start(out, "--recovery", "in-process", nproc=nproc, **env)
    lines, before, after = [], {}, {}
    try:
        for line in job.stdout:
            lines.append(line)
            step = STEP.search(line)
            if not before and step and int(step.group(1)) >= KILL_AT:
                before = ranks(job)
                for each in victim if isinstance(victim, tuple) else (victim,):
                    os.kill(before[f"rank{each}"], signal.SIGKILL)
            if before and not after and (STEP.search(line) and "resumed from" in "".join(lines[-20:])):
                after = ranks(job)
        code, log = finish(job, lines)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return code, log, before, after


@pytest.mark.parametrize(("nproc", "victim"), [(2, 1), (2, 0), (4, 2)],
                         ids=["rank 1 of 2", "rank 0 of 2, whose keeper hosts the store", "rank 2 of 4"])
def test_a_killed_rank_is_replaced_in_process_and_the_others_keep_their_processes(tmp_path, reference, nproc, victim):
    """With 4 ranks, some survivors wait on a live rank rather than the dead one: they learn of the failure
    only when the ranks that saw it free their group (trainpod.train.inprocess._release)."""
    code, log, before, after = run_and_kill(tmp_path, victim, nproc)
    assert code == 0, log[-4000:]
    # A survivor whose receive from the victim (or, as the connections were shut down, from a live rank) had begun to
    # arrive, or whose send to it had begun to be written, is ended and replaced as well: gloo leaves either waiting for
    # the group's timeout.
    orphaned = stuck_stacks.orphaned(log)
    if orphaned:
        print(f"\nrank {victim} of {nproc} killed: survivor(s) {sorted(set(orphaned))} replaced too, "
              "for a receive, send or collective cut mid-message")
    survivors = [r for r in range(nproc) if r != victim and r not in orphaned]
    assert set(before) == {f"{kind}{r}" for kind in ("rank", "keeper") for r in range(nproc)}, before
    # their own processes (a failure says what the keepers and agent said: which rank was replaced, and why, and the
    # native stacks of a survivor that the stuck-rank watch ended: where its collective waited)
    assert all(after[f"rank{r}"] == before[f"rank{r}"] for r in survivors), f"{before}\n{after}\n{said(log)}\n{stuck(tmp_path)}"
    assert after[f"rank{victim}"] != before[f"rank{victim}"]  # a replacement,
    assert all(after[f"keeper{r}"] == before[f"keeper{r}"] for r in range(nproc))  # forked by the same keeper
    assert f"trainpod: rank {victim} (pid {before[f'rank{victim}']}) was killed by SIGKILL: its replacement joins" in log
    generation = 1 + len(orphaned)  # each rank that died counts one
    for survivor in survivors:
        assert re.search(rf"rank {survivor}: .*: a rank was replaced, the group re-formed in-process \(generation "
                         rf"{generation}\)", log), log[-4000:]
    assert GROUP_RESTART not in log  # the agent never restarted the worker group
    resumed = re.findall(r"resumed from the checkpoint of step (\d+).*", log)
    # The checkpoint of step KILL_AT is written beside training: a kill just after its step may precede its commit.
    # (Rank 0 says it once per start of training: a rank ended for its receive or send leaves generation 1 unformed, and the
    # group forms once, at the next.)
    assert len(resumed) == 1 and int(resumed[0]) >= KILL_AT - EVERY, resumed
    if 0 in survivors:  # rank 0 kept its process: it restored the checkpoint it kept in memory
        assert "(from this process's memory)" in log
    result = metrics(tmp_path)
    assert result["checksum"] == reference(nproc) and result["in_process_generation"] == generation
    assert len(set(result["rank_checksums"])) == 1


def test_two_ranks_killed_together_are_both_replaced_in_one_new_group(tmp_path, reference):
    """Their keepers count two generations, 1 and 2; the survivors and both replacements meet at the newest
    (trainpod.train.inprocess._meet) rather than waiting out the re-form timeout in two halves of a group."""
    code, log, before, after = run_and_kill(tmp_path, (1, 2), 4)
    assert code == 0, log[-4000:]
    assert all(after[f"rank{r}"] == before[f"rank{r}"] for r in (0, 3)), (before, after)
    assert all(after[f"rank{r}"] != before[f"rank{r}"] for r in (1, 2)), (before, after)
    assert GROUP_RESTART not in log, log[-4000:]
    for survivor in (0, 3):
        assert re.search(rf"rank {survivor}: .*: a rank was replaced, the group re-formed in-process \(generation 2\)",
                         log), log[-4000:]
    result = metrics(tmp_path)
    assert result["checksum"] == reference(4) and result["in_process_generation"] == 2


def test_a_replacement_that_cannot_start_falls_back_to_restarting_the_worker_group(tmp_path, reference):
    code, log, before, _ = run_and_kill(tmp_path, 1, TRAINPOD_FAILPOINTS="replacement@1")
    assert code == 0, log[-4000:]
    assert "failpoint replacement@1: the replacement exits 1" in log
    assert f"{GROUP_RESTART}: rank 1 exited with 1" in log, log[-4000:]
    result = metrics(tmp_path)
    assert result["checksum"] == reference(2)
    assert result["in_process_generation"] == 0  # the restarted group's keepers start counting again
