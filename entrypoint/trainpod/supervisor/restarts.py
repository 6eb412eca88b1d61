"""The restart budget: restarts *without progress*, one budget for both layers, and the same failure twice.

    trainpod run --max-restarts 3 --progress-window 600 -- python train.py

torchrun's own --max-restarts counts every restart: a week-long job that loses a rank now and then
runs out of restarts although each attempt trained for hours, while a deterministic bug is retried
the whole budget long. NVIDIA's resiliency extension (nvidia-resiliency-ext) stops after three
restarts without progress. trainpod counts the same way, and stops sooner where it can tell:

- a restart counts against --max-restarts only while the job makes no progress. Progress is a
  newer committed checkpoint than at the previous failure (the ranks report each commit, and the
  checkpoint they resumed from, through trainpod.train.progress; trainpod.train.checkpoint does it for you), or,
  for a job that never committed a checkpoint, an attempt that ran longer than --progress-window
  seconds (default 600). Progress gives the whole budget back: a job that is killed every twenty
  minutes and checkpoints every five never runs out;
- the same failure twice in a row without progress in between ends the job at once with its code
  and one line, "the same failure twice at step N without progress: not restarting". The same
  failure: the same exit code, the same last committed checkpoint, and for a Python traceback in
  the failed rank's stderr (torchrun --tee keeps a copy) the same exception type and innermost
  frame; for a death by the kernel's OOM killer, any process it took (the agent names it: the
  failure's cause, trainpod.supervisor.oom). A deterministic bug ends in seconds, not after the whole budget;
- some codes are never restarted at all (NEVER_RESTARTED): 0, 64 and 78 (usage and configuration
  errors), 73 (a checkpoint cannot be written: no space, no permission), 143 (stopped by SIGTERM,
  on this node or, through the rendezvous store, on another: trainpod.agent.control);
- 69 (the master unreachable) is waiting on something outside the job: it is counted by the budget
  but never called "the same failure".

Two layers, one budget. torchrun's agent restarts the worker group after a rank fails (the agent
asks Budget.decide() first: trainpod.agent); supervisord's listener restarts the agent after it
failed (trainpod.supervisor.supervise asks the same Budget). Both keep it in one file, budget.json in the
supervisor's directory (TRAINPOD_SUPERVISOR_DIR); they never run at the same time, as the
listener acts only once the agent has exited. A process that decides the job is over records that
in the file (`final`), so the other layer does not restart it. Without supervision
(--no-supervise) the budget lives in the agent's memory.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from trainpod.atomic import write_bytes_atomic
from trainpod.contract import BUDGET_FILE, EXIT_HANG, SUPERVISOR_DIR_VAR
from trainpod.errors import EXIT_CANTCREAT, EXIT_CONFIG, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from trainpod.train import progress

EXIT_STOPPED = 128 + signal.SIGTERM  # 143: stopped on purpose (docker stop, pre-emption), checkpointed
NEVER_RESTARTED = (EXIT_OK, EXIT_USAGE, EXIT_CANTCREAT, EXIT_CONFIG, EXIT_STOPPED)
TRANSIENT = (EXIT_UNAVAILABLE,)  # counted, but never "the same failure": it waits on another node
WHY_FINAL = {
    EXIT_USAGE: "a usage error",
    EXIT_CONFIG: "a configuration error",
    EXIT_CANTCREAT: "a checkpoint cannot be written",
    EXIT_STOPPED: "stopped by SIGTERM",
}
TAIL_BYTES = 64 * 1024  # of a rank's stderr log: where its last traceback is

_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
_EXCEPTION = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(:|$)")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?", re.M)


def describe_code(code: int) -> str:
    """'exited with 3', 'exited with 137 (SIGKILL)': 128 + N is how a shell reports signal N."""
    if code == EXIT_HANG:
        return f"hung ({EXIT_HANG}: stopped by the hang watch)"
    if code > 128:
        try:
            return f"exited with {code} ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exited with {code}"


def traceback_where(text: str) -> str:
    """'ValueError in /app/train.py:12 (step)': the type and innermost frame of the last Python
    traceback in `text`, or '' if it holds none."""
    # torch.distributed's excepthook prefixes each line of a rank's traceback with "[rank3]: ".
    text = _RANK_PREFIX.sub("", text)
    start = text.rfind("Traceback (most recent call last):")
    if start < 0:
        return ""
    frame = None
    for line in text[start:].splitlines()[1:]:
        match = _FRAME.match(line)
        if match:
            frame = match
            continue
        if line[:1].isspace() or not line.strip():
            continue  # the frame's source line, 3.11's ^^^^ markers
        exception = _EXCEPTION.match(line)
        if exception and frame:
            return f"{exception['type']} in {frame['path']}:{frame['line']} ({frame['func']})"
        break
    return ""


def read_where(path: str | os.PathLike | None) -> str:
    """traceback_where() of the end of a rank's stderr log; '' if there is none."""
    if not path:
        return ""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - TAIL_BYTES))
            return traceback_where(log.read().decode("utf-8", errors="replace"))
    except OSError:
        return ""


def reported(directory: str | os.PathLike | None) -> tuple[int, int]:
    """(last committed step, last step) over the ranks that report to `directory`; -1 where none did."""
    records = progress.read(directory) if directory else {}
    return (max((r.committed for r in records.values()), default=-1), max((r.step for r in records.values()), default=-1))


@dataclass(frozen=True)
class Failure:
    """One failed attempt, as the budget compares it with the one before."""

    code: int
    committed: int = -1  # the newest committed checkpoint known at the failure (-1: none)
    step: int = -1  # the last step a rank reported (-1: none)
    where: str = ""  # traceback_where() of the failed rank's stderr ('' for a signal, a shell script, the agent)
    ran_s: float = 0.0  # how long the attempt ran
    who: str = "the job"  # 'rank 3' or 'the job' (the agent, for the listener)
    # What happened, in words, where "<who> exited with <code>" would mislead: "rank 1 was killed by the kernel's
    # OOM killer (...)", "rank 1 exited 0 at step 3 while the other ranks were still training". Never compared:
    # `where` is what makes two such failures the same (trainpod.agent.policy sets both).
    cause: str = ""

    def what(self) -> str:
        """'rank 3 exited with 1', or the cause."""
        return self.cause or f"{self.who} {describe_code(self.code)}"

    def same_as(self, other: Failure | None) -> bool:
        return other is not None and (self.code, self.committed, self.where) == (other.code, other.committed, other.where)

    def at(self) -> str:
        """'at step 7': the last step reported, else the last committed one; '' when neither is known."""
        if self.step >= 0:
            return f"at step {self.step}"
        if self.committed >= 0:
            return f"at step {self.committed}"
        return ""


@dataclass(frozen=True)
class Decision:
    restart: bool
    code: int
    line: str  # what to say, one line
    used: int = 0  # restarts without progress so far, this one included
    attempt: int = 1  # the attempt that follows (restart) or the number of attempts made (final)
    repeated: bool = False  # final because it was the same failure twice without progress


@dataclass
class State:
    used: int = 0  # restarts since the job last made progress
    attempts: int = 1  # attempts so far, both layers
    committed: int = -1  # the newest committed checkpoint seen at a failure
    last: dict[str, Any] | None = None  # the previous failure (asdict(Failure)), None after progress
    first: dict[str, Any] | None = None  # the first failure since the last progress: an end names it too, if it differs
    final: dict[str, Any] | None = None  # {"code", "line"}: a process decided the job is over
    extra: dict[str, Any] = field(default_factory=dict)


class Budget:
    """The restart budget of one node: in `directory`/budget.json when supervised, else in memory."""

    def __init__(self, max_restarts: int, progress_window: float, directory: str | os.PathLike | None = None):
        self.max_restarts = max_restarts
        self.progress_window = progress_window
        self.path = Path(directory, BUDGET_FILE) if directory else None
        self._memory = State()

    def load(self) -> State:
        if self.path is None:
            return self._memory
        try:
            data = json.loads(self.path.read_text())
            return State(**{k: v for k, v in data.items() if k in State.__dataclass_fields__})
        except (OSError, ValueError, TypeError):
            return State()

    def save(self, state: State) -> None:
        if self.path is None:
            self._memory = state
        else:
            write_bytes_atomic(self.path, json.dumps(asdict(state)).encode())

    def final(self) -> dict[str, Any] | None:
        """{"code", "line"} once a process decided the job is over, else None."""
        return self.load().final

    def end(self, code: int, line: str) -> Decision:
        """Record that the job is over with `code` (so that neither layer restarts it)."""
        state = self.load()
        state.final = {"code": code, "line": line}
        self.save(state)
        return Decision(restart=False, code=code, line=line, used=state.used, attempt=state.attempts)

    def decide(self, failure: Failure) -> Decision:
        """Restart after `failure`, or end the job: the rules in this module's docstring."""
        state = self.load()
        if failure.code == EXIT_OK:
            return self.end(EXIT_OK, "")
        if failure.code in NEVER_RESTARTED:
            why = WHY_FINAL[failure.code]
            return self.end(failure.code, f"{failure.what()} ({why}): not restarting")
        progressed = self._progressed(failure, state)
        note = ""
        if progressed:
            note = f" (progress since the last failure: {progressed}; the budget is full again)" if state.used else ""
            state.used, state.last, state.first = 0, None, None
        previous = Failure(**state.last) if state.last else None
        first = _earlier(state.first, failure)
        if failure.code not in TRANSIENT and failure.same_as(previous):
            said = f": {failure.cause}" if failure.cause else f", {failure.where}" if failure.where else ""
            detail = f"exit code {failure.code}{said}"
            self.save(state)
            at = f"twice {failure.at()} without progress" if failure.at() else "twice without progress (no step reported)"
            return replace(self.end(failure.code, f"the same failure {at}: not restarting ({detail}){first}"), repeated=True)
        if state.used >= self.max_restarts:
            self.save(state)
            return self.end(
                failure.code,
                f"{failure.what()}{_at_where(failure)} after {state.attempts} attempt(s), "
                f"{state.used} restart(s) without progress (--max-restarts {self.max_restarts}): giving up{first}",
            )
        state.used += 1
        state.attempts += 1
        state.last = asdict(failure)
        state.first = state.first or asdict(failure)
        state.committed = max(state.committed, failure.committed)
        self.save(state)
        return Decision(
            restart=True,
            code=failure.code,
            line=f"{failure.what()}: restart {state.used} of {self.max_restarts} without progress{note}",
            used=state.used,
            attempt=state.attempts,
        )

    def membership_changed(self) -> None:
        """The last failure was a node leaving an elastic job (the next rendezvous had fewer nodes): it takes
        back the restart it counted, forgets the failure (the next one is not "the same failure twice"), and
        an end it recorded (the budget spent, or the same failure twice) no longer holds."""
        state = self.load()
        if state.last is not None:
            state.used = max(0, state.used - 1)
        state.last = state.first = None
        state.final = None
        self.save(state)

    def reprieve(self) -> None:
        """An elastic job's end for a lost peer is put off for one more attempt (trainpod.agent.policy): the end it
        recorded no longer holds, and the failure stays counted (the next one like it ends the job again)."""
        state = self.load()
        state.final = None
        self.save(state)

    def _progressed(self, failure: Failure, state: State) -> str:
        """Why `failure`'s attempt counts as progress ('' if it does not)."""
        if failure.committed > state.committed:
            return f"checkpoint of step {failure.committed} committed"
        if failure.committed < 0 and state.committed < 0 and failure.ran_s >= self.progress_window:
            return f"ran {failure.ran_s:.0f}s, no checkpoints, --progress-window {self.progress_window:g}s"
        return ""

    def left(self) -> int:
        """Restarts still allowed before the next progress."""
        return max(0, self.max_restarts - self.load().used)


def node_budget(max_restarts: int, progress_window: float, env: Mapping[str, str] = os.environ) -> Budget:
    """This node's budget, as the agent and the job read it: budget.json in the supervisor's directory, or
    in memory when the job runs unsupervised (its `path` is None then)."""
    return Budget(max_restarts, progress_window, env.get(SUPERVISOR_DIR_VAR) or None)


def _at_where(failure: Failure) -> str:
    """' (ValueError in /app/train.py:12 (step))': where a failure's traceback ended, if it had one (a cause says it all)."""
    return f" ({failure.where})" if failure.where and not failure.cause else ""


def _earlier(first: dict[str, Any] | None, failure: Failure) -> str:
    """'; the first failure since the last progress was ...' where the job is given up on for another failure than
    the one that began the streak (a failed download leaves an empty file, the retry dies on the empty file: the
    download's error is the one to fix)."""
    if not first:
        return ""
    began = Failure(**first)
    if (began.code, began.where) == (failure.code, failure.where):
        return ""
    return f"; the first failure without progress: {began.what()}{_at_where(began)}"

