"""When a job is hung, and who it is waiting for: the decision, as pure functions of samples.

The agent (trainpod.agent.hangwatch) samples each local rank every few seconds: its process state, the
CPU time of its process tree (DataLoader workers included), its last reported step
(trainpod.train.progress) and, when it looks idle, its Python stack. Tracker turns those samples into a
RankView per rank: what the rank is doing and since when. decide() looks at the views of every
rank of the job (the other nodes' come through the rendezvous store) and calls the job stalled
when, for --hang-timeout seconds,

- at least one rank has been WAITING in a collective (its innermost Python frame in
  torch.distributed, in DDP, or in an autograd backward that waits for DDP's all-reduce, with no
  CPU used and no step reported), while
- another is BEHIND: stopped (SIGSTOP, a debugger), idle (no CPU, no new step, the same stack:
  sleeping, blocked on a lock or a dead socket) or gone (exited while the others wait);

or when every rank of the job has been waiting in a collective that cannot complete (a rank
skipped one and sits in the next: the ranks disagree about the collective); or when every rank of
the job has been stopped or idle, none computing and none in a collective (a one-process job, or
ranks that all sleep or block outside torch.distributed: a deadlock of the script's own, a queue
that no producer fills), judged by --hang-timeout alone, never by the pace: what every rank waits
for is outside the job. A rank that computes or reads data is BUSY, so a long compute or data phase
is never a hang; a rank whose step advances is busy whatever its stack.

How long: where every rank reports its steps, the job knows its pace, and the bound is
max(ADAPTIVE_FLOOR_S, ADAPTIVE_FACTOR x the slowest rank's median step), if that is shorter than
--hang-timeout: a job of 0.1 s steps whose rank stops is named in seconds, not minutes. The median
is of the last STEP_WINDOW steps each rank reported (their own timestamps), so a slow first step or
a checkpoint now and then does not move it. --hang-timeout stays the bound where a rank reports no
steps (a script without trainpod.train.progress), where a rank behind is in uninterruptible I/O
(/proc state D: a write to slow shared storage, which a pace cannot bound), and while a group forms
(a rank in init_process_group, or in trainpod's in-process recovery: a start is not paced by steps).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainpod.contract import HANGS_DIR, OUTPUT_DIR_VAR

DEFAULT_OUTPUT = "output"
FLIGHT_RECORDER = "flight-recorder"  # <output>/hangs/flight-recorder/rank<R>: what torch's fr_trace reads
PIPE_STEM = "nccl-dump-"  # TORCH_NCCL_DEBUG_INFO_PIPE_FILE in the progress directory: NCCL makes <stem><rank>.pipe

# Where a rank's innermost Python frame sits while it waits for its peers. An idle backward is
# one too: DDP's reducer waits for its gradient all-reduce inside the autograd engine.
COLLECTIVE_PATHS = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/")
# Frames that are torch's own plumbing: a rank's position is the innermost frame outside them.
LIBRARY_PATHS = ("torch/", "<frozen ")
# Python's own library (a context manager's __exit__, threading's wait), which says nothing of where the script is:
# .../lib/python3.N/<module>, outside site-packages.
STDLIB = re.compile(r"/lib/python3\.\d+/(?!site-packages/|dist-packages/)")
BUSY_CPU_FRACTION = 0.05  # CPU seconds per second of wall time above which a rank is computing
# The adaptive bound (the module docstring): at least ADAPTIVE_FLOOR_S, ADAPTIVE_FACTOR steps of the slowest rank.
ADAPTIVE_FLOOR_S = 8.0
ADAPTIVE_FACTOR = 5.0
STEP_WINDOW = 50  # the steps a rank's median is taken over (per-look estimates: one per look that saw it advance)
MIN_ESTIMATES = 3  # looks that saw a rank advance before its pace counts
# A group that forms (a rank in init_process_group, or survivors re-forming with a replacement in trainpod's
# in-process recovery) is paced by its start, not by its steps: there --hang-timeout stays the bound.
FORMING_CALLS = ("init_process_group", "new_group")
RECOVERY_FILES = ("train/inprocess.py", "agent/keeper.py")

BUSY, WAITING, STOPPED, IDLE, GONE = "busy", "waiting", "stopped", "idle", "gone"
BEHIND_KINDS = (STOPPED, IDLE, GONE)
DESCRIBE = {STOPPED: "stopped", IDLE: "idle", GONE: "gone", WAITING: "waiting", BUSY: "busy"}


@dataclass(frozen=True)
class Frame:
    function: str
    file: str  # as the stack reader gave it (absolute where it could)
    line: int

    def short(self) -> str:
        """'train.py:31 in main', with the path cut to the last two parts."""
        return f"{'/'.join(self.file.split('/')[-2:]) if '/' in self.file else self.file}:{self.line} in {self.function}"


@dataclass(frozen=True)
class Sample:
    """One look at one rank (what hangwatch reads; synthetic in the unit tests)."""

    rank: int  # global
    local_rank: int
    time: float  # time.time() of the look
    state: str  # /proc state letter (R, S, D, T, t, Z), or "" when the process is gone
    cpu: float  # CPU seconds of the rank's process tree so far
    step: int = -1  # its last reported step (trainpod.train.progress), -1: none
    stack: tuple[Frame, ...] | None = None  # the main thread, innermost first; None: not read this time
    stack_error: str = ""  # why the stack could not be read, if it could not
    exitcode: int | None = None  # when gone and known
    step_time: float = 0.0  # when it reported that step (time.time(), the rank's own clock; 0: no step)


@dataclass(frozen=True)
class RankView:
    """What a rank is doing and since when (time.time(), comparable across nodes)."""

    rank: int
    node: str
    kind: str  # BUSY, WAITING, STOPPED, IDLE or GONE
    since: float
    step: int = -1
    where: str = ""  # 'file:line in function': the innermost frame outside torch
    call: str = ""  # the torch function it waits in ('all_reduce'), for WAITING
    detail: str = ""  # extra words: 'exited with 0', 'stack unreadable: ...'
    step_s: float = 0.0  # its median step in seconds, from its reports (0: not known: it reports no steps, or few yet)
    io_wait: bool = False  # not busy, in uninterruptible I/O (/proc state D): bounded by --hang-timeout only

    @property
    def site(self) -> str:
        return f"{self.call} at {self.where}"

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict) -> RankView:
        return RankView(**{k: data[k] for k in RankView.__dataclass_fields__ if k in data})


def is_collective(frame: Frame) -> bool:
    return any(part in frame.file for part in COLLECTIVE_PATHS)


def position(stack: Sequence[Frame]) -> tuple[str, str]:
    """(where, call): the innermost frame outside torch and Python's own library, and the innermost torch
    function name ('' when the innermost frame is not torch's). A torch function called through a logging
    wrapper is named by the wrapped function, the frame nearest the caller."""
    if not stack:
        return "", ""
    call = ""
    for frame in stack:
        if any(part in frame.file for part in LIBRARY_PATHS):
            if "wrapper" not in frame.function and "<" not in frame.function:
                call = frame.function.split(".")[-1]
            continue
        if STDLIB.search(frame.file):
            continue  # (CI: "stopped at python3.11/contextlib.py:144 in __exit__", where the example's frame says more)
        return frame.short(), call
    return stack[0].short(), call


def _idle(previous: Sample | None, state: str, cpu: float, step: int, now: float) -> bool:
    """Stopped, or running without CPU use or a new step since the previous look."""
    if state in ("T", "t"):
        return True
    if previous is None or previous.state in ("", "Z", "X", "T", "t"):
        return False  # nothing to compare with (or it was just continued): no claim yet
    elapsed = max(now - previous.time, 1e-3)
    return step == previous.step and cpu - previous.cpu <= BUSY_CPU_FRACTION * elapsed


@dataclass
class Tracker:
    """One rank's history: turns its samples into RankViews (hangwatch keeps one per local rank)."""

    rank: int
    node: str
    view: RankView | None = None
    last: Sample | None = None
    signature: tuple[Frame, ...] | None = None  # the main thread's stack, read while it was not busy
    stack_time: float = -math.inf  # when that stack was read
    paces: deque = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))  # seconds a step, one per advance seen
    reported: tuple[int, float] | None = None  # (step, its report's time) at the last advance seen

    @property
    def step_s(self) -> float:
        """The rank's median step in seconds (0 until MIN_ESTIMATES advances were seen)."""
        return statistics.median(self.paces) if len(self.paces) >= MIN_ESTIMATES else 0.0

    def _pace(self, sample: Sample) -> None:
        if sample.step < 0 or sample.step_time <= 0:
            return
        if self.reported is not None and sample.step > self.reported[0] and sample.step_time > self.reported[1]:
            self.paces.append((sample.step_time - self.reported[1]) / (sample.step - self.reported[0]))
        if self.reported is None or sample.step != self.reported[0]:
            self.reported = (sample.step, sample.step_time)  # a lower step: a new attempt started over

    def idle(self, state: str, cpu: float, step: int, now: float) -> bool:
        """Whether a look with these values would find the rank not busy (so its stack is worth reading)."""
        return _idle(self.last, state, cpu, step, now)

    def wants_stack(self, state: str, cpu: float, step: int, now: float, refresh: float) -> bool:
        """Read its stack at this look? When it is not busy and the last stack is missing or older than `refresh`."""
        if not self.idle(state, cpu, step, now):
            return False
        return self.signature is None or now - self.stack_time >= refresh

    def update(self, sample: Sample) -> RankView:
        previous, self.last = self.last, sample
        self._pace(sample)
        view = self.view
        # It has been in its present state over the interval since the previous look, at least.
        start = previous.time if previous is not None else sample.time
        moved = False
        where, call, detail = "", "", ""
        if sample.state in ("", "Z", "X"):
            kind = GONE
            detail = f"exited with {sample.exitcode}" if sample.exitcode is not None else "exited"
        elif not _idle(previous, sample.state, sample.cpu, sample.step, sample.time):
            kind = BUSY
            self.signature = None
        else:
            if sample.stack is not None:
                moved = self.signature is not None and sample.stack != self.signature
                self.signature, self.stack_time = sample.stack, sample.time
            stack = self.signature
            if stack:
                where, call = position(stack)
            elif sample.stack_error:
                detail = f"stack unreadable: {sample.stack_error}"
            if sample.state in ("T", "t"):
                kind = STOPPED
            elif stack and is_collective(stack[0]):
                kind = WAITING
            else:
                kind = IDLE
            if not stack and not sample.stack_error and kind == IDLE:
                kind = BUSY  # not idle long enough to have a stack read: no claim yet
        if view is not None and kind != BUSY and view.kind == kind and not moved and (view.where, view.call) == (where, call):
            start = view.since  # the same state at the same place: its clock keeps running
        since = sample.time if kind == BUSY else start
        self.view = RankView(self.rank, self.node, kind, since, sample.step, where, call, detail, self.step_s,
                             io_wait=kind != BUSY and sample.state == "D")
        return self.view


@dataclass(frozen=True)
class Verdict:
    """The job is stalled: who is behind, who waits for them, for how long."""

    behind: tuple[RankView, ...]
    waiting: tuple[RankView, ...]
    stalled_for: float
    mismatch: bool = False  # every rank waits, in collectives that disagree
    sites: dict = field(default_factory=dict)  # mismatch: site -> ranks
    limit: float = 0.0  # the bound it was judged by
    step_s: float = 0.0  # the slowest rank's median step, when the bound came from the job's pace (else 0)


def limit(views: Sequence[RankView], timeout: float) -> tuple[float, float]:
    """(the bound, the pace it came from or 0): the adaptive bound where every rank reports its pace and none
    behind waits for I/O, if shorter than --hang-timeout (`timeout`); else `timeout` (the module docstring)."""
    if not views or any(v.step_s <= 0 for v in views) or any(v.io_wait for v in views):
        return timeout, 0.0
    if any(v.call in FORMING_CALLS or any(f in v.where for f in RECOVERY_FILES) for v in views):
        return timeout, 0.0
    pace = max(v.step_s for v in views)
    adaptive = max(ADAPTIVE_FLOOR_S, ADAPTIVE_FACTOR * pace)
    return (adaptive, pace) if adaptive < timeout else (timeout, 0.0)


def decide(views: Iterable[RankView], now: float, timeout: float, world_size: int | None = None) -> Verdict | None:
    """The verdict over every rank's view (the other nodes' included), or None while the job is not
    stalled for its bound (limit(): --hang-timeout, `timeout`, or shorter where the job's pace is known).
    `world_size`: the job's ranks, to tell that every one waits."""
    views = sorted(views, key=lambda v: v.rank)
    waiting = [v for v in views if v.kind == WAITING]
    behind = [v for v in views if v.kind in BEHIND_KINDS]
    if world_size and len(views) == world_size and all(v.kind in (STOPPED, IDLE) for v in views):
        start = max(v.since for v in views)  # every rank idle: none is waited for, so --hang-timeout, not the pace
        if now - start < timeout:
            return None
        return Verdict(behind=tuple(views), waiting=(), stalled_for=now - start, limit=timeout)
    if world_size and len(views) < world_size:
        bound, pace = timeout, 0.0  # a node's views are missing: the pace of the whole job is not known
    else:
        bound, pace = limit(views, timeout)
    timeout = bound
    if waiting and behind:
        start = max(min(v.since for v in waiting), min(v.since for v in behind))
        if now - start < timeout:
            return None
        late = tuple(v for v in behind if now - v.since >= timeout)
        return Verdict(behind=late, waiting=tuple(waiting), stalled_for=now - start, limit=bound, step_s=pace)
    if waiting and not behind and world_size and len(waiting) == world_size:
        start = max(v.since for v in waiting)
        if now - start < timeout:
            return None
        groups = Counter(v.site for v in waiting)
        sites = {site: [v.rank for v in waiting if v.site == site] for site in groups}
        top = groups.most_common()
        if len(top) > 1 and top[0][1] > top[1][1]:
            odd = tuple(v for v in waiting if v.site != top[0][0])  # the minority: the ones out of step
            rest = tuple(v for v in waiting if v.site == top[0][0])
        else:
            odd, rest = tuple(waiting), ()  # a tie (or one site for all): every rank is named
        return Verdict(behind=odd, waiting=rest, stalled_for=now - start, mismatch=len(groups) > 1, sites=sites, limit=bound,
                       step_s=pace)
    return None


def _ranks(views: Sequence[RankView]) -> str:
    numbers = [str(v.rank) for v in views]
    return ("rank " if len(numbers) == 1 else "ranks ") + ", ".join(numbers)


def _node(view: RankView, here: str) -> str:
    return "" if view.node == here else f" on node{view.node}"


def _step(view: RankView) -> str:
    return f"step {view.step}" if view.step >= 0 else "no step reported"


def _behind(view: RankView, here: str) -> str:
    words = {STOPPED: "stopped", IDLE: "idle (no CPU, same stack)", GONE: view.detail or "exited",
             WAITING: f"waiting in {view.call or 'a collective'}"}[view.kind]
    if view.kind == IDLE and view.detail:
        words = f"idle ({view.detail})"
    at = f" at {view.where}" if view.where else ""
    return f"rank {view.rank}{_node(view, here)} {words}{at}, {_step(view)}"


def _stalled(verdict: Verdict) -> str:
    paced = (f" (the job's pace: steps of {verdict.step_s:.2g}s; bound {verdict.limit:.0f}s)" if verdict.step_s > 0 else "")
    return f"hang: no progress for {verdict.stalled_for:.0f}s{paced}"


def describe(verdict: Verdict, here: str) -> str:
    """What is stuck, in words (the agent adds where the stacks are and what it does next)."""
    if verdict.sites:
        everyone = {v.rank: v for v in verdict.behind + verdict.waiting}
        sites = "; ".join(f"{_ranks([everyone[r] for r in ranks])} in {site}" for site, ranks in verdict.sites.items())
        odd = ", ".join(f"rank {v.rank}{_node(v, here)} ({_step(v)})" for v in verdict.behind)
        head = "the ranks wait in different collectives" if verdict.mismatch else "every rank waits in the same collective"
        return f"{_stalled(verdict)}, {head} ({sites}); out of step: {odd}"
    behind = "; ".join(_behind(v, here) for v in verdict.behind)
    if not verdict.waiting:
        return f"{_stalled(verdict)}; every rank is idle, none computing or in a collective: {behind}"
    calls = sorted({v.call for v in verdict.waiting if v.call})
    verb = "waits" if len(verdict.waiting) == 1 else "wait"
    wait = f"{_ranks(verdict.waiting)} {verb} for {'it' if len(verdict.behind) == 1 else 'them'}"
    return f"{_stalled(verdict)}; behind: {behind}; {wait}" + (f" in {', '.join(calls)}" if calls else "")


# --- what the launch plan sets ---------------------------------------------------------------------


def output_dir(env: Mapping[str, str]) -> str:
    """The stacks go to <output>/hangs/ (the examples write their metrics to <output>)."""
    return env.get(OUTPUT_DIR_VAR, "").strip() or DEFAULT_OUTPUT


def plan_env(env: Mapping[str, str]) -> dict[str, str]:
    """The ranks' variable for the watch: where torch's flight recorder dumps,
    <output>/hangs/flight-recorder/rank<R> (torch records the last 2000 collectives of every gloo and
    NCCL process group by default; TORCH_FR_BUFFER_SIZE=0 turns it off). The agent adds the progress
    directory and NCCL's dump-on-request pipe beside it (pipe_env). A variable the user set stays theirs."""
    recorder = {"TORCH_FR_DUMP_TEMP_FILE": str(Path(output_dir(env)) / HANGS_DIR / FLIGHT_RECORDER / "rank")}
    return {name: value for name, value in recorder.items() if not env.get(name)}


def pipe_env(progress_dir: str, env: Mapping[str, str]) -> dict[str, str]:
    """NCCL's dump-on-request pipe, beside the ranks' progress files (unless the user set it)."""
    name = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
    return {} if env.get(name) else {name: str(Path(progress_dir) / PIPE_STEM)}
