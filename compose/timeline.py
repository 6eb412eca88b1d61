"""An elastic job's membership timeline: the world size by step, from global rank 0's log lines.

    python3 compose/timeline.py trainer0=t0.log trainer1=t1.log ... [--event "trainer1 killed@UNIX_TIME"]

Each file is one node's `docker logs -t` (every line starts with its RFC 3339 time). Rank 0 of
each world says `<example>: world N, backend ...` when it starts, `... resumed from the checkpoint
of step S` when it goes on from one, then `epoch e/E step s/T ...` at its log points: one segment
per start, on whichever node holds rank 0 then. A node that left the job on its own decision (a check named
it, or its ranks failed alike twice: its agent's `... leaves the elastic job ...` line) is a row of its own,
with how soon the others trained again; so is a spare (a node beyond --nnodes' maximum) from the moment it
waits, and the round it took a lost node's place in. Used by demo-elastic.sh (and its tests import segments(),
departures() and spares()); exits 1 when no world started at all.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from datetime import datetime, timezone

_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z ")
_RANK0 = re.compile(r"\[node[^\] ]* rank0\] ")
_WORLD = re.compile(r": world (\d+), backend ")
_RESUMED = re.compile(r"resum\w* from (?:the checkpoint of )?step (\d+)")
_STEP = re.compile(r"\bepoch \d+/\d+ step (\d+)/(\d+)\b")
_FINISHED = re.compile(r"\btrainpod-metrics: ")
_STOPPED = re.compile(r"stopped by SIGTERM at step (\d+)")
_LEFT = re.compile(r"trainpod: error: (.*?): (?:this node leaves the elastic job \((--[\w-]+)\)"
                   r"|this node's ranks failed (the same way twice|on their own))")
_SPARE_WAITS = re.compile(r"trainpod: this node waits as a spare: ")
_SPARE_IN = re.compile(r"trainpod: (\d+) node\(s\) took the place of (?:one|nodes) that left: ")
_STAYED_OUT = re.compile(r"trainpod: error: this node left this elastic job \(rendezvous \S+\) and stays out of it")


@dataclass
class Segment:
    """One world, from its rank 0's start to its last step line."""

    node: str
    world: int
    started: float  # unix time of the `world N` line
    resumed_from: int = 0  # the checkpoint's step, 0 for a fresh start
    first_step: int | None = None  # the first step line's step (a log point, not always resumed_from + 1)
    first_step_at: float | None = None
    last_step: int | None = None
    total_steps: int | None = None
    end: str = ""  # "finished", "stopped at step S", or "" (lost, or failed)


def unix_time(line: str) -> float | None:
    found = _TIME.match(line)
    if not found:
        return None
    fraction = (found.group(2) or "0")[:6].ljust(6, "0")  # docker gives nanoseconds, datetime takes micro
    stamp = datetime.strptime(f"{found.group(1)}.{fraction}", "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=timezone.utc)
    return stamp.timestamp()


def segments(logs: dict[str, str]) -> list[Segment]:
    """Every world's segment, in order of start, from each node's `docker logs -t` text. A node's lines are taken in
    the order of their times: `docker logs` writes a container's stdout and stderr to two streams, which a reader of
    both (2>&1) may get in another order than they were written."""
    found: list[Segment] = []
    for node, text in logs.items():
        current: Segment | None = None
        stamped = sorted(((at, line) for line in text.splitlines() if (at := unix_time(line)) is not None),
                         key=lambda item: item[0])
        for at, line in stamped:
            if not _RANK0.search(line):
                continue
            if world := _WORLD.search(line):
                current = Segment(node=node, world=int(world.group(1)), started=at)
                found.append(current)
            elif current is None:
                continue
            elif resumed := _RESUMED.search(line):
                current.resumed_from = int(resumed.group(1))
            elif step := _STEP.search(line):
                if current.first_step is None:
                    current.first_step, current.first_step_at = int(step.group(1)), at
                current.last_step, current.total_steps = int(step.group(1)), int(step.group(2))
            elif _FINISHED.search(line):
                current.end = "finished"
            elif stopped := _STOPPED.search(line):
                current.end = f"stopped at step {stopped.group(1)}"
    return sorted(found, key=lambda s: s.started)


def departures(logs: dict[str, str]) -> list[tuple[str, float]]:
    """(what, unix time) of each node that left the job on its own decision: excluded by a check or by its failures;
    and of each that was started again and stayed out (trainpod.rendezvous.exclusions)."""
    found = []
    for node, text in logs.items():
        for line in text.splitlines():
            at, left = unix_time(line), _LEFT.search(line)
            if at is not None and _STAYED_OUT.search(line):
                found.append((f"{node} was started again and stayed out (excluded)", at))
            elif at is not None and left:
                why = (f"named by {left.group(2)}" if left.group(2) else "its ranks failed the same way twice"
                       if left.group(3) == "the same way twice" else "its ranks kept failing: --max-restarts spent")
                found.append((f"{node} left the job ({why})", at))
    return sorted(found, key=lambda event: event[1])


def spares(logs: dict[str, str]) -> list[tuple[str, float]]:
    """(what, unix time) of each node that began to wait as a spare, and of each round that spares joined in the place
    of nodes that left. Every node of such a round says so: the rounds are those of the node that said it most."""
    found, rounds = [], {}
    for node, text in logs.items():
        for line in text.splitlines():
            at = unix_time(line)
            if at is not None and _SPARE_WAITS.search(line):
                found.append((f"{node} waits as a spare", at))
            elif at is not None and (took := _SPARE_IN.search(line)):
                rounds.setdefault(node, []).append((at, int(took.group(1))))
    if rounds:
        for at, count in max(rounds.values(), key=len):
            found.append((f"{count} spare(s) took the place of node(s) that left", at))
    return sorted(found, key=lambda event: event[1])


def render(found: list[Segment], events: list[tuple[str, float]] = ()) -> str:
    t0 = min([s.started for s in found] + [t for _, t in events])
    rows = [(s.started, _row(s, t0)) for s in found] + [(t, f"  {t - t0:+7.1f} s  {text}") for text, t in events]
    lines = ["membership timeline (world size by step, from global rank 0's lines):"]
    lines += [row for _, row in sorted(rows, key=lambda r: r[0])]
    for text, at in events:  # how long the job took to train again after each event
        after = next((s for s in found if s.started >= at), None)
        if after is not None:
            first = "" if after.first_step_at is None else f", its first step line at {after.first_step_at - at:.1f} s"
            lines.append(f"  after {text}: world {after.world} started {after.started - at:.1f} s later{first}")
    return "\n".join(lines)


def _row(s: Segment, t0: float) -> str:
    steps = "no step" if s.last_step is None else f"steps {s.resumed_from + 1}-{s.last_step}"
    how = f"resumed from step {s.resumed_from}" if s.resumed_from else "fresh start"
    end = s.end or "then lost or failed"
    return f"  {s.started - t0:+7.1f} s  world {s.world}  {steps:<15} rank 0 on {s.node} ({how}; {end})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", metavar="NODE=FILE", help="a node's `docker logs -t` output")
    parser.add_argument("--event", action="append", default=[], metavar="TEXT@UNIX_TIME", help="a mark, e.g. a kill")
    args = parser.parse_args(argv)
    logs = {}
    for item in args.logs:
        node, _, path = item.partition("=")
        with open(path, encoding="utf-8", errors="replace") as f:
            logs[node] = f.read()
    events = [(text, float(at)) for text, _, at in (e.rpartition("@") for e in args.event)] + departures(logs) + spares(logs)
    found = segments(logs)
    if not found:
        print("timeline: no rank 0 ever said `world N` in these logs", file=sys.stderr)
        return 1
    print(render(found, events))
    return 0


if __name__ == "__main__":
    sys.exit(main())
