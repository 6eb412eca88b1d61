"""The ranks' lines as the agent shows them (torchrun's tee): every line whole, with its own prefix,
and a script's error shown once, not once per rank and attempt.

torchrun --tee 3 sends each rank's stdout and stderr to files, <log dir>/<run>/attempt_K/<local
rank>/stdout.log and stderr.log, and copies them onto the agent's stdout and stderr with the rank's
prefix, one thread per file (torch's TailLog). torch's thread, tail_logfile(), writes whatever
readline() returns: at the end of the file that is the part of a line the rank has written so far,
and the rest follows later as a "line" of its own with a new prefix. Under load two ranks' lines
came glued (issue 29): `[node0 rank2] ... Steps: 16[node0 rank3] ...`, then an empty `[node0 rank2] `.
tail_logfile() here replaces torch's (install(): TailLog.start() looks the function up by name in its
module, trainpod.agent checks that it still does) and

- reads the file in chunks of READ_SIZE bytes (a UTF-8 character cut between two reads is kept whole),
  every interval_sec (torch's 0.1 s) while nothing new has come;
- writes a line only once its newline has come; what a finished file ends with, without a newline,
  is written with one added;
- writes a line longer than MAX_LINE characters in pieces of MAX_LINE, each but the last ending with
  CUT_MARK, so that a line without a newline for a long while holds no more than that in memory;
- writes each line with one write() to the agent's stream, under one lock that every tail shares,
  and flushes before it lets go of it: lines of two ranks never share an output line, whatever the
  load, and a line is never split between two writes of the agent's buffer.

A script's mistake, once. On a rank's stderr (never its stdout) a Python traceback ("Traceback (most
recent call last):" through the exception line, and a chained traceback with it; torch's excepthook's
"[rankN]: " prefix set aside) and an argparse error ("usage: ..." through "PROG: error: ...") is a
block: it is held until it is complete, then compared with every block this agent has shown, across
the ranks and the worker group's restarts. The first is shown whole; an identical one is not shown
but counted, and when every rank's tail of that worker group has finished (the group was stopped),
one line per block says who printed it again and where the full text is:

    [node0] trainpod: ranks 1-3: the same traceback as shown for rank 0 (3 not shown; full text in
        /tmp/torchelastic_x/none_y/attempt_0/<local rank>/stderr.log)
    [node0] trainpod: attempt 2: ranks 0-3 printed the same traceback again, as shown for rank 0
        in attempt 1 (4 not shown; full text in .../attempt_1/<local rank>/stderr.log)

Identical blocks are left out always, not only before the job made progress: a block identical to
one shown already says nothing new, whenever it comes (the line says how often it came), and the
rank's log file keeps every one. A block that differs in any character is shown: nothing in it is
normalised (pids, addresses, times), so nothing that could tell two failures apart is dropped. A
block that does not complete is shown as it came: no exception line (or "PROG: error:") within
BLOCK_IDLE_S of its last line, more than MAX_BLOCK_LINES lines, another line than a block has, or
the end of the file. A traceback is held CHAIN_WAIT_S past its exception line for a chained one
("During handling of the above exception, ..."); an exception's message on more lines than one is
shown after the block, as plain lines.

A script's last words, once. An error line ("PROG: error: ...", as the bundled examples and argparse
end) that is the last thing a rank wrote to its stderr (the file ended after it; another line, or
BLOCK_IDLE_S without one, makes it a plain line again) is a block of one line, and the same line from
another rank or attempt is left out without a summary (it would be as long as the line): a bad flag
to a 4-rank example is one line, not four. The rank's file keeps it.
"""

from __future__ import annotations

import atexit
import codecs
import hashlib
import inspect
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

from trainpod import log

READ_SIZE = 64 * 1024  # bytes per read of a rank's file
MAX_LINE = 64 * 1024  # characters: a longer line is written in pieces
CUT_MARK = f" [trainpod: line cut at {MAX_LINE} characters; it goes on in the next line]"
BLOCK_IDLE_S = 5.0  # a block with no new line for this long is shown as it is
CHAIN_WAIT_S = 0.5  # after a traceback's exception line: how long a chained traceback may take to follow
MAX_BLOCK_LINES = 2000
MAX_SHOWN = 10_000  # blocks remembered (by digest) per agent

TRACEBACK = "Traceback (most recent call last):"
CHAINS = ("During handling of the above exception, another exception occurred:",
          "The above exception was the direct cause of the following exception:")
RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")  # torch.distributed's excepthook (as in trainpod.supervisor.restarts)
_HEADER_RANK = re.compile(r"\brank(\d+)\]")  # the global rank in trainpod's prefix, "[node0 rank3] "
_ARGPARSE_ERROR = re.compile(r"^\S.*?: error: ")
_SYNTAX_ERROR = re.compile(r'^  File ".*", line \d+$')  # Python's report of a script it cannot compile: no header

_WRITE = threading.Lock()  # every tail's writes, so that lines never interleave


def _write(dst: TextIO, lines: list[str]) -> None:
    """Each line (prefixed, newline-terminated) in one write(), then a flush, under the shared lock."""
    if not lines:
        return
    with _WRITE:
        for line in lines:
            try:
                dst.write(line)
            except UnicodeEncodeError:  # a destination in ASCII: as Python writes stderr
                dst.write(line.encode(dst.encoding or "ascii", "backslashreplace").decode(dst.encoding or "ascii"))
        dst.flush()


# --- the blocks shown and left out, per worker group ---


@dataclass
class _Group:
    """One worker group's stderr tails (one start of the ranks; attempt `number` in this agent)."""

    number: int
    directory: str  # torch's attempt directory
    expected: int  # its local ranks
    started: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)
    hidden: dict[tuple[str, str], _Hidden] = field(default_factory=dict)  # (kind, digest) -> what was left out
    reported: dict[tuple[str, str], int] = field(default_factory=dict)  # -> how many blocks were said already
    local: bool = False  # ranks are local ranks (no global rank in the prefix)


@dataclass(frozen=True)
class _Shown:
    group: int
    rank: int
    local: bool


@dataclass
class _Hidden:
    first: _Shown
    ranks: dict[int, int] = field(default_factory=dict)  # rank -> blocks left out


class Board:
    """What this agent has shown of the ranks' blocks, and what it left out (one per agent: BOARD)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[str, _Group] = {}  # attempt directory -> its latest group
        self._all: list[_Group] = []
        self._count = 0
        self._shown: dict[tuple, _Shown] = {}

    def join(self, file: str) -> tuple[_Group, int]:
        """The group of a stderr tail that starts (torch's layout: <attempt dir>/<local rank>/stderr.log)."""
        rank_dir = os.path.dirname(os.path.abspath(file))
        directory, name = os.path.dirname(rank_dir), os.path.basename(rank_dir)
        local_rank = int(name) if name.isdigit() else 0
        with self._lock:
            group = self._groups.get(directory)
            if group is None or local_rank in group.started:  # torch reuses an attempt's directory
                self._count += 1
                group = self._groups[directory] = _Group(self._count, directory, _local_ranks(directory))
                self._all.append(group)
            group.started.add(local_rank)
            return group, local_rank

    def block(self, group: _Group, rank: int, local: bool, kind: str, lines: list[str]) -> bool:
        """Whether to show a complete block (the first like it); else it is counted."""
        key = (kind, hashlib.sha256("\n".join(lines).encode("utf-8", "surrogatepass")).hexdigest())
        with self._lock:
            first = self._shown.get(key)
            if first is None:
                self._shown[key] = _Shown(group.number, rank, local)
                if len(self._shown) > MAX_SHOWN:  # the oldest is forgotten: if it comes again, it is shown again
                    del self._shown[next(iter(self._shown))]
                return True
            if kind == ERROR_LINE:
                return False  # left out, said nowhere: a line that says who else printed it would be as long
            ranks = group.hidden.setdefault(key, _Hidden(first)).ranks
            ranks[rank] = ranks.get(rank, 0) + 1
            group.local = group.local or local
            return False

    def done(self, group: _Group, local_rank: int) -> list[str]:
        """A tail finished: the group's summary once every rank's tail has."""
        with self._lock:
            group.finished.add(local_rank)
            if len(group.finished) < group.expected:
                return []
            return self._summarise(group)

    def pending(self) -> list[str]:
        """Summary lines not said yet, of every group (an agent that ends before its tails did)."""
        with self._lock:
            return [line for group in self._all for line in self._summarise(group)]

    def _summarise(self, group: _Group) -> list[str]:
        lines = []
        for key, hidden in group.hidden.items():
            count = sum(hidden.ranks.values())
            if count <= group.reported.get(key, 0):
                continue
            group.reported[key] = count
            first, kind = hidden.first, key[0]
            who = _ranks(sorted(hidden.ranks), group.local)
            where = f"{count} not shown; full text in {os.path.join(group.directory, '<local rank>', 'stderr.log')}"
            as_shown = f"as shown for {'local rank' if first.local else 'rank'} {first.rank}"
            if first.group == group.number:
                lines.append(f"{who}: the same {kind} {as_shown} ({where})")
            else:
                lines.append(f"attempt {group.number}: {who} printed the same {kind} again, {as_shown} in attempt "
                             f"{first.group} ({where})")
        return lines


def _local_ranks(directory: str) -> int:
    """How many local ranks torch made directories for in an attempt's directory (before it started them)."""
    try:
        return max(1, sum(1 for name in os.listdir(directory) if name.isdigit()))
    except OSError:
        return 1


def _ranks(ranks: list[int], local: bool) -> str:
    """'rank 2', 'ranks 1-3', 'ranks 0, 2-3' ('local ranks ...' where the prefix has no global rank)."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    word = "local rank" if local else "rank"
    return f"{word}s {text}" if len(ranks) > 1 else f"{word} {text}"


BOARD = Board()


# --- one rank's file ---

_PLAIN, _TRACE, _TRACE_END, _CHAIN, _USAGE, _LAST = range(6)
ERROR_LINE = "error line"  # the kind of a one-line block: left out without a summary, which would be no shorter


class _Tail:
    """One rank's file onto `dst`: whole lines; on stderr, blocks held, shown once (`board`)."""

    def __init__(self, header: str, dst: TextIO, keep: Callable[[str], bool] | None, board: Board | None = None,
                 group: _Group | None = None, rank: int = 0, local: bool = True, say: str = "trainpod"):
        self.header, self.dst, self.keep = header, dst, keep
        self.board, self.group, self.rank, self.local, self.say = board, group, rank, local, say
        self.partial = ""
        self.state = _PLAIN
        self.held: list[str] = []  # the block's lines (newline-terminated, as the rank wrote them)
        self.trailer: list[str] = []  # blank lines after an exception line: a chain's, or plain ones
        self.out: list[str] = []  # what to write next

    # the text, in pieces as read

    def feed(self, text: str) -> None:
        if "\n" not in text:
            self.partial += text
        else:
            lines = (self.partial + text).split("\n")
            self.partial = lines.pop()
            for line in lines:
                self.line(self._cut(line) + "\n")
        self.partial = self._cut(self.partial)

    def _cut(self, text: str) -> str:
        """Writes the MAX_LINE pieces of a longer line but its last, which it returns: the same pieces
        whether the line's newline came with it or not yet."""
        start = 0
        while len(text) - start > MAX_LINE:
            self._give_up()
            self._plain(text[start:start + MAX_LINE] + CUT_MARK + "\n")
            start += MAX_LINE
        return text[start:] if start else text

    def idle(self, seconds: float) -> None:
        """Nothing new for `seconds`."""
        if self.state == _TRACE_END and seconds >= CHAIN_WAIT_S:
            self._complete()
        elif self.state != _PLAIN and seconds >= BLOCK_IDLE_S:
            self._give_up()

    def end(self) -> None:
        """The file is finished: its last line, without a newline, and a block held."""
        if self.partial:
            line, self.partial = self.partial, ""
            self.line(line + "\n")
        if self.state in (_TRACE_END, _LAST):
            self._complete()
        else:
            self._give_up()

    def take(self) -> list[str]:
        out, self.out = self.out, []
        return out

    # the lines

    def line(self, raw: str) -> None:
        if self.board is None:
            self._plain(raw)
            return
        text = RANK_PREFIX.sub("", raw.rstrip("\r\n"))
        state = self.state
        if state == _PLAIN:
            if text == TRACEBACK or _SYNTAX_ERROR.match(text):
                self._hold(raw, _TRACE)
            elif text.startswith("usage: "):
                self._hold(raw, _USAGE)
            elif _ARGPARSE_ERROR.match(text):
                self._hold(raw, _LAST)  # a block if nothing follows it: a script's last words ("PROG: error: ...")
            else:
                self._plain(raw)
        elif state == _TRACE:
            self._hold(raw, _TRACE_END if text and not text[0].isspace() else _TRACE)  # the exception line
        elif state == _TRACE_END:
            if not text and len(self.trailer) < 2:
                self.trailer.append(raw)
            elif text in CHAINS and self.trailer:
                self.held += self.trailer
                self.trailer = []
                self._hold(raw, _CHAIN)
            else:
                self._complete()
                self.line(raw)
        elif state == _CHAIN:
            if not text:
                self._hold(raw, _CHAIN)
            elif text == TRACEBACK:
                self._hold(raw, _TRACE)
            else:
                self._give_up()
                self.line(raw)
        elif state == _USAGE:
            if text[:1].isspace():  # the usage, wrapped
                self._hold(raw, _USAGE)
            elif _ARGPARSE_ERROR.match(text):
                self._hold(raw, _USAGE)
                self._complete()
            else:
                self._give_up()
                self.line(raw)
        elif state == _LAST:  # more came: a line of the script's output like any other
            self._give_up()
            self.line(raw)

    def _hold(self, raw: str, state: int) -> None:
        self.held.append(raw)
        self.state = state
        if len(self.held) > MAX_BLOCK_LINES:
            self._give_up()

    def _plain(self, raw: str) -> None:
        if self.keep is None or self.keep(raw):
            self.out.append(self.header + raw)

    def _give_up(self) -> None:
        """Not a complete block: its lines as they came."""
        held, trailer = self.held, self.trailer
        self.held, self.trailer, self.state = [], [], _PLAIN
        for raw in held + trailer:
            self._plain(raw)

    def _complete(self) -> None:
        if not self.held:
            return
        held, trailer = self.held, self.trailer
        kind = {_USAGE: "usage error", _LAST: ERROR_LINE}.get(self.state, "traceback")
        self.held, self.trailer, self.state = [], [], _PLAIN
        lines = [RANK_PREFIX.sub("", raw.rstrip("\r\n")) for raw in held]
        if self.board is None or self.group is None or self.board.block(self.group, self.rank, self.local, kind, lines):
            for raw in held:
                self._plain(raw)
        for raw in trailer:
            self._plain(raw)

    def finish(self, local_rank: int) -> None:
        """This tail is over: the group's summary, if it was the last."""
        if self.board is not None and self.group is not None:
            self.out += [f"{self.say}: {line}\n" for line in self.board.done(self.group, local_rank)]


def tail_logfile(header: str, file: str, dst: TextIO, finished: threading.Event, interval_sec: float,
                 log_line_filter: Callable[[str], bool] | None = None) -> None:
    """torch's tail_logfile(), line by whole line: copy `file` to `dst`, each line after `header`, until
    `finished` is set and the file has been read to its end (torch's signature: TailLog calls it so)."""
    board = BOARD if _is_stderr(file, dst) else None
    group, local_rank = board.join(file) if board is not None else (None, 0)
    global_rank = _HEADER_RANK.search(header)
    tail = _Tail(header, dst, log_line_filter, board, group, int(global_rank.group(1)) if global_rank else local_rank,
                 global_rank is None, log.prefix(log.node_from_env()))
    try:
        while not os.path.exists(file):
            if finished.wait(interval_sec) and not os.path.exists(file):
                return  # the rank never started
        _copy(tail, file, dst, finished, interval_sec)
    finally:
        tail.finish(local_rank)
        _write(dst, tail.take())


def _copy(tail: _Tail, file: str, dst: TextIO, finished: threading.Event, interval_sec: float) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    fd = os.open(file, os.O_RDONLY)
    try:
        last = time.monotonic()
        while True:
            done = finished.is_set()  # before the read: whatever the rank wrote before it was set, the read sees
            got = False
            while True:
                chunk = os.read(fd, READ_SIZE)
                if not chunk:
                    break
                got = True
                tail.feed(decoder.decode(chunk))
                _write(dst, tail.take())
            if got:
                last = time.monotonic()
                continue
            if done:
                tail.feed(decoder.decode(b"", final=True))
                tail.end()
                return
            tail.idle(time.monotonic() - last)
            _write(dst, tail.take())
            finished.wait(interval_sec)
    finally:
        os.close(fd)


def _is_stderr(file: str, dst: TextIO) -> bool:
    """A rank's stderr copied onto the agent's (not torch's filtered copy into a file of its own)."""
    return os.path.basename(file) == "stderr.log" and (dst is sys.stderr or dst is sys.__stderr__)


# --- installing it in torch ---

_torch_tail_logfile: Callable | None = None  # torch's own, once replaced


def install() -> None:
    """Make torch's TailLog use tail_logfile() above (the agent calls it before the launcher starts)."""
    global _torch_tail_logfile
    from torch.distributed.elastic.multiprocessing import tail_log

    if tail_log.tail_logfile is not tail_logfile:
        _torch_tail_logfile = tail_log.tail_logfile
        tail_log.tail_logfile = tail_logfile
        atexit.register(_say_pending)


def _say_pending() -> None:
    lines = BOARD.pending()
    if lines:
        _write(sys.stderr, [f"{log.prefix(log.node_from_env())}: {line}\n" for line in lines])


SIGNATURE = ["header", "file", "dst", "finished", "interval_sec", "log_line_filter"]


def torch_internals_missing() -> list[str]:
    """What of torch's tail this module relies on is missing ([] if nothing): tail_log.tail_logfile with
    its signature, called by name from TailLog.start(); the ranks' stderr tailed onto sys.stderr."""
    from torch.distributed.elastic.multiprocessing import api, tail_log

    missing = []
    torch_own = _torch_tail_logfile or getattr(tail_log, "tail_logfile", None)
    try:
        names = list(inspect.signature(torch_own).parameters) if callable(torch_own) else None
    except (TypeError, ValueError):
        names = None
    if names != SIGNATURE:
        missing.append(f"torch.distributed.elastic.multiprocessing.tail_log.tail_logfile({', '.join(SIGNATURE)}) "
                       "(trainpod.agent.ranklog replaces it: every rank's line whole)")
    start = getattr(getattr(tail_log, "TailLog", None), "start", None)
    if start is None or not re.search(r"\btail_logfile,", inspect.getsource(start)):
        missing.append("TailLog.start() calling tail_log.tail_logfile by name (trainpod.agent.ranklog replaces it)")
    if "sys.stderr" not in inspect.getsource(api.PContext.__init__):
        missing.append("PContext's TailLog of the ranks' stderr onto sys.stderr (trainpod.agent.ranklog: a block shown once)")
    return missing
