"""Issue 29 on the host (real torchrun, real supervisord, no Docker): every rank's line reaches the output
whole and prefixed however the rank writes it and whatever the load (trainpod.agent.ranklog), and a script that
fails the same way on every rank prints its traceback or usage error once, with one line for the others.
Issue 24: a rank's line reaches trainpod's output when it is written, and a bundled example's usage error is
the rank's line and one of trainpod's."""

import glob
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from fixtures.ports import free_port
from trainpod.agent import ranklog

pytest.importorskip("torch")

ENTRYPOINT = str(Path(__file__).resolve().parents[2] / "entrypoint")
PREFIX = re.compile(r"^\[node0 rank(\d+)\] (.*)$")


def environment():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "PET_", "PAI_", "TORCHELASTIC_"))}
    return {**env, "PYTHONPATH": ENTRYPOINT}


def trainpod(tmp_path: Path, script: str, *flags: str) -> subprocess.CompletedProcess:
    (tmp_path / "script.py").write_text(script)
    command = [sys.executable, "-m", "trainpod", "run", "--master-port", str(free_port()), "--restart-backoff", "0.1",
               "--nproc-per-node", "4", *flags, "--", sys.executable, str(tmp_path / "script.py")]
    return subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=300, cwd=tmp_path)


# --- every line whole ---

LINES = 2500


def lines_of(rank):
    """What rank `rank` writes: (stream, line, where the rank cuts it, whether it pauses at the cut)."""
    import random

    rnd = random.Random(rank)
    for n in range(LINES):
        line = f"rank {rank} line {n} " + "é" * rnd.randint(0, 3) + "x" * rnd.randint(0, 120) + " end"
        yield ("stderr" if n % 5 == 0 else "stdout"), line, rnd.randint(1, len(line) - 1), rnd.random() < 0.1


PIECES = f"LINES = {LINES}\n\n" + inspect.getsource(lines_of) + textwrap.dedent("""
    import os, sys, time

    rank = int(os.environ["RANK"])
    for stream, line, cut, pause in lines_of(rank):
        out = getattr(sys, stream)
        print(line[:cut], end="", file=out, flush=True)  # a piece of the line, then the rest
        if pause:
            time.sleep(0.002)
        print(line[cut:], file=out, flush=True)
    sys.stdout.write(f"rank {rank} last words")  # no newline at exit
""")


@pytest.mark.slow
def test_every_line_written_in_pieces_by_four_ranks_under_load_comes_out_whole_and_prefixed(tmp_path):
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range((os.cpu_count() or 1) + 1)]
    try:
        result = trainpod(tmp_path, PIECES)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert result.returncode == 0, result.stderr[-3000:]
    for name, output in (("stdout", result.stdout), ("stderr", result.stderr)):
        found: dict[int, list[str]] = {}
        for line in output.splitlines():
            match = PREFIX.match(line)
            if match is None:
                assert name == "stderr" and line.startswith("[node0] ") and "[node0" not in line[1:], line[:300]
                continue
            assert "[node0" not in match[2], f"two lines in one: {line[:300]!r}"
            found.setdefault(int(match[1]), []).append(match[2])
        expected = {rank: [line for stream, line, _, _ in lines_of(rank) if stream == name] for rank in range(4)}
        if name == "stdout":
            expected = {rank: [*lines, f"rank {rank} last words"] for rank, lines in expected.items()}
        assert found == expected, f"{name}: the ranks' lines differ"
    print(f"{sum(len(v) for v in expected.values())} + {LINES * 4 - sum(len(v) for v in expected.values())} lines whole")


# --- a script's mistake, once ---

# The ranks ignore the SIGTERM with which torch stops the others once one has failed, and none fails before
# every rank ignores it: every rank prints its error, so which ranks the summary names does not depend on the pace.
IGNORE_SIGTERM = textwrap.dedent("""
    import os, signal, time

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    open(f"ready-{attempt}-{os.environ['RANK']}", "w").close()
    while not all(os.path.exists(f"ready-{attempt}-{rank}") for rank in range(int(os.environ["WORLD_SIZE"]))):
        time.sleep(0.01)
""")
MISSING_MODULE = IGNORE_SIGTERM + "import nosuchmodule\n"
USAGE = IGNORE_SIGTERM + textwrap.dedent("""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, required=True)
    parser.parse_args()
""")
# torch's excepthook prefixes each line with "[rankN]: " once the process group exists.
MISSING_FILE = IGNORE_SIGTERM + textwrap.dedent("""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    open("/nonexistent/data.bin")
""")


def shown_once(result: subprocess.CompletedProcess, first_line: str, kind: str) -> tuple[int, str]:
    """The rank whose block was shown (once), and the summary of the other ranks' (the same, not shown)."""
    shown = [PREFIX.match(line) for line in result.stderr.splitlines() if first_line in line]
    assert len(shown) == 1 and shown[0], result.stderr[-4000:]
    rank = int(shown[0][1])
    others = ranklog._ranks(sorted(set(range(4)) - {rank}), False)
    summary = [line for line in result.stderr.splitlines() if f"the same {kind} as shown for rank {rank}" in line]
    assert len(summary) == 1, result.stderr[-4000:]
    match = re.fullmatch(rf"\[node0\] trainpod: {others}: the same {kind} as shown for rank {rank} \(3 not shown; full text in "
                         r"(\S+)/<local rank>/stderr\.log\)", summary[0])
    assert match, summary[0]
    return rank, match[1]


@pytest.mark.slow
def test_a_missing_module_on_every_rank_prints_one_traceback_and_the_next_attempt_one_line(tmp_path):
    result = trainpod(tmp_path, MISSING_MODULE, "--max-restarts", "1")
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.count("Traceback (most recent call last):") == 1, result.stderr[-4000:]
    assert result.stderr.count("ModuleNotFoundError: No module named 'nosuchmodule'") == 1
    rank, directory = shown_once(result, "Traceback (most recent call last):", "traceback")
    for local_rank in range(4):  # the others' are kept in their files
        assert "ModuleNotFoundError" in (Path(directory) / str(local_rank) / "stderr.log").read_text()
    again = [line for line in result.stderr.splitlines() if "attempt 2:" in line]
    assert len(again) == 1 and re.fullmatch(
        rf"\[node0\] trainpod: attempt 2: ranks 0-3 printed the same traceback again, as shown for rank {rank} in attempt 1 "
        r"\(4 not shown; full text in \S+/<local rank>/stderr\.log\)", again[0]), result.stderr[-3000:]
    assert "restarting the worker group" in result.stderr  # two attempts, the second summed up


@pytest.mark.slow
def test_an_argparse_error_on_every_rank_is_printed_once(tmp_path):
    result = trainpod(tmp_path, USAGE, "--max-restarts", "0")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("usage: script.py [-h] --lr LR") == 1, result.stderr[-4000:]
    assert result.stderr.count("script.py: error: the following arguments are required: --lr") == 1
    shown_once(result, "usage: script.py", "usage error")


@pytest.mark.slow
def test_a_traceback_with_torchs_rank_prefix_is_printed_once(tmp_path):
    result = trainpod(tmp_path, MISSING_FILE, "--max-restarts", "0")
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.count("Traceback (most recent call last):") == 1, result.stderr[-4000:]
    rank, _ = shown_once(result, "Traceback (most recent call last):", "traceback")
    assert f"[node0 rank{rank}] [rank{rank}]: FileNotFoundError" in result.stderr


# --- as it happens, and once (issue 24) ---

# print() without flush: Python buffers a file, and a rank's stdout is one (torchrun's tee)
WAITS_FOR_GO = textwrap.dedent("""
    import os, sys, time

    print(f"rank {os.environ['RANK']} started")
    deadline = time.monotonic() + 45
    while not os.path.exists("go") and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(0 if os.path.exists("go") else 3)
""")


@pytest.mark.slow
def test_a_ranks_line_reaches_trainpods_output_file_while_the_job_runs(tmp_path):
    # Before: `trainpod run ... > job.log` without PYTHONUNBUFFERED (a user's sbatch script, nohup) held the
    # ranks' lines until the job ended.
    (tmp_path / "script.py").write_text(WAITS_FOR_GO)
    env = {k: v for k, v in environment().items() if k != "PYTHONUNBUFFERED"}
    command = [sys.executable, "-m", "trainpod", "run", "--master-port", str(free_port()), "--nproc-per-node", "2", "--",
               sys.executable, str(tmp_path / "script.py")]
    with open(tmp_path / "job.log", "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while "[node0 rank1] rank 1 started" not in (tmp_path / "job.log").read_text():
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "job.log").read_text()
            time.sleep(0.05)
        assert process.poll() is None  # the job still runs: it waits for this
        (tmp_path / "go").touch()
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr[-3000:]


@pytest.mark.slow
def test_a_bundled_examples_usage_error_is_the_ranks_line_and_one_of_trainpods(tmp_path):
    # Before: each rank's line, torch's "E... failed (exitcode: 64)" and two lines of trainpod's saying the same.
    temp = tempfile.mkdtemp(prefix="tp-")  # torch's log directory, where its own line is kept
    try:
        result = subprocess.run([sys.executable, "-m", "trainpod", "run", "--master-port", str(free_port()), "--nproc-per-node",
                                 "2", "--example", "cifar10-ddp", "--", "--backend", "nccl"],
                                env={**environment(), "TMPDIR": temp}, capture_output=True, text=True, timeout=300,
                                cwd=tmp_path)
        kept = "".join(Path(path).read_text() for path in glob.glob(os.path.join(temp, "torchelastic_*", "*", "agent.log")))
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert result.returncode == 64, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    started = [n for n, line in enumerate(lines) if line.startswith("[node0] trainpod: single: node 0 of 1, 2 process(es)")]
    assert len(started) == 1, lines
    lines = lines[started[0]:]  # what the job said once it started
    # (What only a rank can tell: torch sees no GPU. A flag the example does not take is the launcher's to say, first.)
    assert len(lines) == 3 and re.fullmatch(r"\[node0 rank[01]\] cifar10-ddp: error: --backend='nccl': expected gloo: NCCL "
                                            r"needs CUDA, and torch sees no GPU here", lines[1]), lines
    assert re.fullmatch(r"\[node0\] trainpod: rank [01] exited with 64 \(a usage error\): not restarting", lines[2]), lines
    assert result.stdout == ""
    assert "failed (exitcode: 64)" in kept, kept
