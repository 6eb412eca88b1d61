"""trainpod.agent.ranklog: the ranks' files copied by torch's TailLog (real files, written in pieces by real
processes) come out line by whole line, each with its rank's prefix; a block on stderr is shown once."""

import io
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from torch.distributed.elastic.multiprocessing import tail_log  # noqa: E402

from trainpod.agent import ranklog  # noqa: E402

# Writes the bytes of SOURCE to PATH in pieces of 1 to 300 bytes (a UTF-8 character may be cut), flushed
# one by one, with a short sleep after about one piece in eight: what a rank's print(..., end="") does.
WRITER = textwrap.dedent("""
    import os, random, sys, time
    path, source, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    data = open(source, "rb").read()
    rnd = random.Random(seed)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    at = 0
    while at < len(data):
        size = rnd.randint(1, 300)
        os.write(fd, data[at:at + size])
        at += size
        if rnd.random() < 0.125:
            time.sleep(rnd.choice((0, 0.0005, 0.002)))
""")

TRACEBACK = textwrap.dedent("""\
    Traceback (most recent call last):
      File "/job/train.py", line 3, in <module>
        import nosuchmodule
    ModuleNotFoundError: No module named 'nosuchmodule'
""")


@pytest.fixture(autouse=True)
def installed(monkeypatch):
    """torch's TailLog with trainpod's tail (restored afterwards), and a board of its own per test."""
    monkeypatch.setattr(tail_log, "tail_logfile", tail_log.tail_logfile)
    monkeypatch.setattr(ranklog, "_torch_tail_logfile", None)
    monkeypatch.setattr(ranklog, "BOARD", ranklog.Board())
    monkeypatch.setenv("TRAINPOD_NODE_RANK", "0")
    ranklog.install()


def attempt(root: Path, number: int, ranks: int, name: str = "stderr.log") -> dict[int, str]:
    """torch's layout: <run>/attempt_<number>/<local rank>/<name>, the files created (as torch does)."""
    files = {}
    for rank in range(ranks):
        (root / f"attempt_{number}" / str(rank)).mkdir(parents=True, exist_ok=True)
        files[rank] = str(root / f"attempt_{number}" / str(rank) / name)
        Path(files[rank]).touch()
    return files


def prefixes(ranks) -> dict[int, str]:
    return {rank: f"[node0 rank{rank}] " for rank in ranks}


def write_in_pieces(tmp_path: Path, files: dict[int, str], texts: dict[int, str], seed: int = 0) -> None:
    """One writer process per file, all at once."""
    writers = []
    for rank, text in texts.items():
        source = tmp_path / f"source-{rank}-{seed}"
        source.write_bytes(text.encode())
        writers.append(subprocess.Popen([sys.executable, "-c", WRITER, files[rank], str(source), str(seed * 100 + rank)]))
    for writer in writers:
        assert writer.wait(timeout=60) == 0


class CpuLoad:
    """Busy processes, one per core and one more, for the duration of a `with`."""

    def __enter__(self):
        self.busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range((os.cpu_count() or 1) + 1)]
        return self

    def __exit__(self, *exc):
        for process in self.busy:
            process.kill()
            process.wait()


def by_rank(output: str) -> dict[int, list[str]]:
    """Each output line's rank and text; fails on a line that is not one rank's whole line."""
    found: dict[int, list[str]] = {}
    for line in output.split("\n")[:-1]:
        assert line.startswith("[node0 rank") and "] " in line, f"not a rank's line: {line[:200]!r}"
        head, text = line.split("] ", 1)
        found.setdefault(int(head[len("[node0 rank"):]), []).append(text)
    assert output.endswith("\n")
    return found


# --- every line whole ---


@pytest.mark.slow
def test_lines_written_in_pieces_by_many_ranks_under_load_come_out_whole_and_prefixed(tmp_path):
    ranks = 8
    rnd = random.Random(5)
    texts = {}
    for rank in range(ranks):
        lines = [f"rank {rank} line {n} {'é漢字' * rnd.randint(0, 5)}{'x' * rnd.randint(0, 150)} end" for n in range(1500)]
        texts[rank] = "\n".join(lines)  # the last line without a newline, as a rank that exits mid-line
    files = attempt(tmp_path, 0, ranks, "stdout.log")
    with open(tmp_path / "out", "w", encoding="utf-8") as dst, CpuLoad():
        tail = tail_log.TailLog("trainer", files, dst, prefixes(range(ranks)), interval_sec=0.01).start()
        write_in_pieces(tmp_path, files, texts)
        tail.stop()
    found = by_rank((tmp_path / "out").read_text(encoding="utf-8"))
    assert sorted(found) == list(range(ranks))
    for rank in range(ranks):
        assert found[rank] == texts[rank].split("\n"), f"rank {rank}'s lines differ"


def test_a_file_that_ends_without_a_newline_gives_its_last_line_with_one(tmp_path):
    files = attempt(tmp_path, 0, 1, "stdout.log")
    Path(files[0]).write_text("one\ntwo")
    dst = io.StringIO()
    tail = tail_log.TailLog("trainer", files, dst, prefixes([0]), interval_sec=0.01).start()
    tail.stop()
    assert dst.getvalue() == "[node0 rank0] one\n[node0 rank0] two\n"


def test_a_partial_line_waits_for_its_newline(tmp_path):
    files = attempt(tmp_path, 0, 1, "stdout.log")
    dst = io.StringIO()
    tail = tail_log.TailLog("trainer", files, dst, prefixes([0]), interval_sec=0.01).start()
    with open(files[0], "a") as rank:
        rank.write("Epoch 228 | Steps: 16")
        rank.flush()
        time.sleep(0.2)  # twenty polls of the tail
        assert dst.getvalue() == ""
        rank.write(" | loss 0.1\n")
    tail.stop()
    assert dst.getvalue() == "[node0 rank0] Epoch 228 | Steps: 16 | loss 0.1\n"


def test_a_very_long_line_is_written_in_pieces_with_a_mark_however_it_arrives(tmp_path):
    long = "a" * 100_000
    expected = [long[:ranklog.MAX_LINE] + ranklog.CUT_MARK, long[ranklog.MAX_LINE:], "short"]
    for rank, (pieces, pause) in enumerate([(10, 0.02), (1, 0)]):  # slowly, the tail sees it grow; all at once
        files = attempt(tmp_path / str(rank), 0, 1, "stdout.log")
        dst = io.StringIO()
        tail = tail_log.TailLog("trainer", files, dst, {0: "[node0 rank0] "}, interval_sec=0.01).start()
        with open(files[0], "a") as file:
            for at in range(0, len(long), len(long) // pieces):
                file.write(long[at:at + len(long) // pieces])
                file.flush()
                time.sleep(pause)
            file.write("\nshort\n")
        tail.stop()
        assert by_rank(dst.getvalue()) == {0: expected}


def test_a_line_is_cut_at_the_same_places_whether_its_newline_came_or_not():
    size = ranklog.MAX_LINE
    for length in (size, size + 1, 2 * size, 2 * size + 3):
        text = "b" * length
        whole, grown = ranklog._Tail("", None, None), ranklog._Tail("", None, None)
        whole.feed(text + "\n")
        for at in range(0, length, 4096):
            grown.feed(text[at:at + 4096])
        grown.feed("\n")
        assert whole.take() == grown.take()


def test_lines_of_several_tails_never_interleave_on_a_destination_that_writes_in_pieces():
    class Slow:
        """A stream whose write() lets other threads run in the middle of a line."""

        def __init__(self):
            self.parts: list[str] = []

        def write(self, text):
            half = len(text) // 2
            self.parts.append(text[:half])
            time.sleep(0)
            self.parts.append(text[half:])

        def flush(self):
            pass

    dst = Slow()
    lines = {n: [f"[r{n}] line {i} {'y' * (i % 50)}\n" for i in range(300)] for n in range(6)}
    threads = [threading.Thread(target=lambda n=n: [ranklog._write(dst, [line]) for line in lines[n]]) for n in lines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out = "".join(dst.parts).splitlines(keepends=True)
    assert sorted(out) == sorted(line for each in lines.values() for line in each)
    for n in lines:
        assert [line for line in out if line.startswith(f"[r{n}]")] == lines[n]


def test_torchs_line_filter_still_applies(tmp_path):
    files = attempt(tmp_path, 0, 1, "stdout.log")
    Path(files[0]).write_text("keep this\ndrop this\nkeep that")
    dst = io.StringIO()
    tail = tail_log.TailLog("trainer", files, dst, prefixes([0]), interval_sec=0.01,
                            log_line_filter=lambda line: "keep" in line).start()
    tail.stop()
    assert dst.getvalue() == "[node0 rank0] keep this\n[node0 rank0] keep that\n"


# --- a block once ---


def agent_stderr(monkeypatch) -> io.StringIO:
    """The agent's sys.stderr, which torch's TailLog of the ranks' stderr writes to (set in the test's
    body: pytest puts its own back between a fixture's setup and the test)."""
    capture = io.StringIO()
    monkeypatch.setattr(sys, "stderr", capture)
    return capture


def wait_for(capture: io.StringIO, text: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while text not in capture.getvalue():
        assert time.monotonic() < deadline, f"{text!r} not written: {capture.getvalue()[-2000:]!r}"
        time.sleep(0.01)


def rank_prefixed(text: str, rank: int) -> str:
    """As torch.distributed's excepthook writes it: "[rankN]: " before every line but an empty one."""
    return "\n".join(f"[rank{rank}]: {line}" if line else "" for line in text.split("\n"))


def test_the_same_traceback_on_every_rank_is_shown_once_with_a_line_for_the_others(tmp_path, monkeypatch):
    stderr = agent_stderr(monkeypatch)
    files = attempt(tmp_path, 0, 4)
    tail = tail_log.TailLog("trainer", files, sys.stderr, prefixes(range(4)), interval_sec=0.01).start()
    Path(files[0]).write_text(f"before 0\n{TRACEBACK}after 0\n")
    wait_for(stderr, "after 0")  # rank 0's is the first
    texts = {rank: f"before {rank}\n{rank_prefixed(TRACEBACK, rank) if rank > 1 else TRACEBACK}after {rank}\n"
             for rank in (1, 2, 3)}
    with CpuLoad():
        write_in_pieces(tmp_path, files, texts)
        tail.stop()
    lines = stderr.getvalue().split("\n")
    assert lines[-2] == (f"[node0] trainpod: ranks 1-3: the same traceback as shown for rank 0 (3 not shown; full text in "
                         f"{tmp_path}/attempt_0/<local rank>/stderr.log)")
    assert by_rank("\n".join(lines[:-2]) + "\n") == {
        0: ["before 0", *TRACEBACK.splitlines(), "after 0"], **{rank: [f"before {rank}", f"after {rank}"] for rank in (1, 2, 3)}}
    for rank in (1, 2, 3):  # the rank's own file keeps it
        assert "ModuleNotFoundError" in Path(files[rank]).read_text()


@pytest.mark.slow
def test_the_same_block_in_a_later_attempt_is_summed_up_and_a_different_one_is_shown(tmp_path, monkeypatch):
    stderr = agent_stderr(monkeypatch)
    first = attempt(tmp_path, 0, 2)
    tail = tail_log.TailLog("trainer", first, sys.stderr, prefixes(range(2)), interval_sec=0.01).start()
    Path(first[0]).write_text(TRACEBACK)
    wait_for(stderr, "ModuleNotFoundError")
    Path(first[1]).write_text(TRACEBACK)
    tail.stop()
    assert stderr.getvalue().count("Traceback") == 1
    assert stderr.getvalue().endswith("[node0] trainpod: rank 1: the same traceback as shown for rank 0 (1 not shown; full "
                                      f"text in {tmp_path}/attempt_0/<local rank>/stderr.log)\n")
    for count, number in ((2, 1), (3, 1)):  # torch makes attempt_1 for the next attempt, and again after a budget given back
        stderr.truncate(0)
        stderr.seek(0)
        again = attempt(tmp_path, number, 2)
        for file in again.values():
            Path(file).write_text("")
        tail = tail_log.TailLog("trainer", again, sys.stderr, prefixes(range(2)), interval_sec=0.01).start()
        write_in_pieces(tmp_path, again, {0: TRACEBACK, 1: rank_prefixed(TRACEBACK, 1)}, seed=count)
        tail.stop()
        assert stderr.getvalue() == (f"[node0] trainpod: attempt {count}: ranks 0-1 printed the same traceback again, as "
                                     f"shown for rank 0 in attempt 1 (2 not shown; full text in {tmp_path}/attempt_1/<local "
                                     "rank>/stderr.log)\n")
    stderr.truncate(0)
    stderr.seek(0)
    last = attempt(tmp_path, 2, 2)
    other = TRACEBACK.replace("nosuchmodule", "othermodule")
    tail = tail_log.TailLog("trainer", last, sys.stderr, prefixes(range(2)), interval_sec=0.01).start()
    write_in_pieces(tmp_path, last, {0: TRACEBACK, 1: other}, seed=7)
    tail.stop()
    assert stderr.getvalue().count("Traceback") == 1 and "othermodule" in stderr.getvalue()  # differs: shown
    assert stderr.getvalue().endswith("[node0] trainpod: attempt 4: rank 0 printed the same traceback again, as shown for "
                                      f"rank 0 in attempt 1 (1 not shown; full text in {tmp_path}/attempt_2/<local rank>/stderr.log)\n")


def test_stdout_is_never_deduplicated(tmp_path, monkeypatch):
    stderr = agent_stderr(monkeypatch)
    files = attempt(tmp_path, 0, 2, "stdout.log")
    for file in files.values():
        Path(file).write_text(TRACEBACK)
    dst = io.StringIO()
    tail_log.TailLog("trainer", files, dst, prefixes(range(2)), interval_sec=0.01).start().stop()
    assert dst.getvalue().count("Traceback") == 2 and stderr.getvalue() == ""


# the blocks, line by line (no files, no threads)

def pure(board: ranklog.Board, rank: int, directory: str = "/nonexistent/attempt_0") -> ranklog._Tail:
    group, local_rank = board.join(f"{directory}/{rank}/stderr.log")
    return ranklog._Tail(f"[node0 rank{rank}] ", None, None, board, group, rank, False, "[node0] trainpod")


def shown(board: ranklog.Board, rank: int, text: str, directory: str = "/nonexistent/attempt_0") -> list[str]:
    tail = pure(board, rank, directory)
    tail.feed(text)
    tail.end()
    return [line[len(f"[node0 rank{rank}] "):] for line in tail.take()]


CHAINED = textwrap.dedent("""\
    Traceback (most recent call last):
      File "/job/train.py", line 2, in <module>
        {}["x"]
        ~~^^^^^
    KeyError: 'x'

    During handling of the above exception, another exception occurred:

    Traceback (most recent call last):
      File "/job/train.py", line 4, in <module>
        raise ValueError("no x")
    ValueError: no x
""")

USAGE = textwrap.dedent("""\
    usage: train.py [-h] --lr LR
                    [--epochs EPOCHS]
    train.py: error: the following arguments are required: --lr
""")

SYNTAX = textwrap.dedent("""\
      File "/job/train.py", line 1
        def (
            ^
    SyntaxError: invalid syntax
""")


@pytest.mark.parametrize("block", [CHAINED, USAGE, SYNTAX, TRACEBACK], ids=["chained", "argparse", "syntax", "traceback"])
def test_a_block_is_one_however_it_is_written_and_prefixed(block):
    board = ranklog.Board()
    assert shown(board, 0, "a\n" + block + "b\n") == ["a\n", *block.splitlines(keepends=True), "b\n"]
    assert shown(board, 1, "a\n" + rank_prefixed(block, 1) + "b\n") == ["a\n", "b\n"]
    tail = pure(board, 2)
    for char in block:  # a character at a time
        tail.feed(char)
    tail.end()
    assert tail.take() == []
    assert board.pending() == [f"ranks 1-2: the same {'usage error' if 'usage' in block else 'traceback'} as shown for "
                               f"rank 0 (2 not shown; full text in /nonexistent/attempt_0/<local rank>/stderr.log)"]


def test_a_block_that_does_not_complete_is_shown_as_it_came(monkeypatch):
    board = ranklog.Board()
    shown(board, 0, TRACEBACK)
    frames = "".join(TRACEBACK.splitlines(keepends=True)[:3])
    assert shown(board, 1, frames) == frames.splitlines(keepends=True)  # the file ended
    tail = pure(board, 2)
    tail.feed(frames)
    tail.idle(ranklog.BLOCK_IDLE_S - 0.1)
    assert tail.take() == []
    tail.idle(ranklog.BLOCK_IDLE_S)  # no exception line in time
    assert len(tail.take()) == 3
    assert shown(board, 3, "usage: train.py [-h]\nnot argparse's\n") == ["usage: train.py [-h]\n", "not argparse's\n"]
    assert shown(board, 4, "usage: x\n" * (ranklog.MAX_BLOCK_LINES + 5)) == ["usage: x\n"] * (ranklog.MAX_BLOCK_LINES + 5)
    assert board.pending() == []


def test_a_traceback_waits_a_moment_for_a_chained_one_then_is_complete():
    board = ranklog.Board()
    tail = pure(board, 0)
    tail.feed(TRACEBACK + "\n")  # and a blank line: a chain may follow
    tail.idle(ranklog.CHAIN_WAIT_S - 0.1)
    assert tail.take() == []
    tail.idle(ranklog.CHAIN_WAIT_S)
    assert [line.split("] ", 1)[1] for line in tail.take()] == [*TRACEBACK.splitlines(keepends=True), "\n"]
    tail = pure(board, 1)
    tail.feed(TRACEBACK + "\n")
    tail.idle(ranklog.CHAIN_WAIT_S)
    assert [line.split("] ", 1)[1] for line in tail.take()] == ["\n"]  # the same block, and a blank line of its own


ERROR = "cifar10-ddp: error: trainpod.examples (cifar10-ddp): unrecognized arguments: --bogus 1\n"


def test_an_error_line_that_ends_a_ranks_output_is_shown_once_without_a_summary():
    # Issue 24: a bad flag to a bundled example printed its one line once per rank (then torch's and two of
    # trainpod's lines): now once per agent, as the rank's last words; its file keeps every rank's.
    board = ranklog.Board()
    assert shown(board, 0, "a\n" + ERROR) == ["a\n", ERROR]
    assert shown(board, 1, "a\n" + ERROR) == ["a\n"]
    assert shown(board, 0, ERROR, "/nonexistent/attempt_1") == []  # the next attempt's too
    assert board.pending() == []  # no line saying who else printed it: it would be as long


def test_an_error_line_that_more_lines_follow_is_a_line_like_any_other():
    board = ranklog.Board()
    assert shown(board, 0, ERROR) == [ERROR]
    assert shown(board, 1, ERROR + "step 2\n") == [ERROR, "step 2\n"]  # a script's log line, not its last words
    tail = pure(board, 2)
    tail.feed(ERROR)
    tail.idle(ranklog.BLOCK_IDLE_S - 0.1)
    assert tail.take() == []  # held: the file may end after it
    tail.idle(ranklog.BLOCK_IDLE_S)
    assert [line.split("] ", 1)[1] for line in tail.take()] == [ERROR]  # the rank goes on: shown as it came


def test_ranks_and_counts_in_the_summary():
    assert ranklog._ranks([2], False) == "rank 2"
    assert ranklog._ranks([0, 1, 2, 3], False) == "ranks 0-3"
    assert ranklog._ranks([0, 2, 3, 5], False) == "ranks 0, 2-3, 5"
    assert ranklog._ranks([1, 2], True) == "local ranks 1-2"
    board = ranklog.Board()
    assert len(shown(board, 0, TRACEBACK * 4)) == len(TRACEBACK.splitlines())  # one rank, again and again: counted too
    assert board.pending() == ["rank 0: the same traceback as shown for rank 0 (3 not shown; full text in "
                               "/nonexistent/attempt_0/<local rank>/stderr.log)"]
    assert board.pending() == []  # said once


def test_the_private_torch_api_the_tail_replaces_is_there_and_used():
    assert ranklog.torch_internals_missing() == []
    assert tail_log.tail_logfile is ranklog.tail_logfile
    from torch.distributed.elastic.multiprocessing import api

    assert api.TailLog is tail_log.TailLog  # what PContext starts, which calls the module's function
