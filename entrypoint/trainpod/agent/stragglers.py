"""Which rank paces the job, and since when: the straggler decision, as pure functions of the ranks' reports.

In a synchronous job every rank waits for the slowest one in each gradient all-reduce, so every
rank's step lasts as long and step times name nobody. What differs is each rank's own work per
step: from the end of its previous step to its last gradient, before it waits for the others
(trainpod.train.progress.measure, reported as `Record.busy`). A rank whose own work stays at least
SLOWER (30 %) above the median of the other ranks' for --straggler-window seconds is a straggler:
the whole job runs at its pace (a throttled CPU, a slow GPU, a node's slow disk under its data
loader). A node every rank of which is a straggler is named as the node.

A rank's figure is the median of the reports its agent saw in the last SPAN_S seconds (one per
look that saw its step advance), so a checkpoint or a slow batch now and then moves nothing. A
rank counts once it has MIN_REPORTS of them, and ranks are compared only while every rank of the
job has a figure: a script that does not call measure() is never judged. Slow "for the window"
means slow at every judgement in it: one look at the job's usual pace starts the count again. A named
rank keeps pace again once its own work stays below KEEPING (15 %) above the others' median for the
window too: a rank whose figure wavers about the bound (a loaded host: 1.27 then 1.4 times the others')
was named, said to keep pace, and named again within a minute.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

SLOWER = 0.3  # how much more own work per step than the other ranks' median makes a rank slow
KEEPING = 0.15  # how much more a named rank may do and keep pace again (below SLOWER: no flapping about one bound)
SPAN_S = 15.0  # the reports a rank's figure is the median of
MIN_REPORTS = 3


@dataclass(frozen=True)
class Pace:
    """A rank's own work per step, as its agent has seen it lately (what the agents share)."""

    rank: int  # global
    node: str
    busy_s: float  # the median of its reports over the last SPAN_S seconds

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict) -> Pace:
        return Pace(rank=int(data["rank"]), node=str(data["node"]), busy_s=float(data["busy_s"]))


class Reports:
    """The reports of one node's ranks, one per look that saw a rank's step advance."""

    def __init__(self, span: float = SPAN_S):
        self.span = span
        self._seen: dict[int, deque[tuple[float, float]]] = {}  # rank -> (time of the look, busy seconds)
        self._step: dict[int, int] = {}

    def add(self, rank: int, step: int, busy: float, now: float) -> None:
        if step == self._step.get(rank) or step < 0:
            return
        self._step[rank] = step
        seen = self._seen.setdefault(rank, deque())
        if busy > 0:  # 0: not measured (a script without measure(), or a step without a backward)
            seen.append((now, busy))
        while seen and seen[0][0] < now - self.span:
            seen.popleft()

    def paces(self, node: str, now: float) -> list[Pace]:
        paces = []
        for rank, seen in sorted(self._seen.items()):
            recent = [busy for at, busy in seen if at >= now - self.span]
            if len(recent) >= MIN_REPORTS:
                paces.append(Pace(rank, node, statistics.median(recent)))
        return paces


@dataclass(frozen=True)
class Straggler:
    """A rank named slow (or, in `recovered`, no longer)."""

    rank: int
    node: str
    busy_s: float  # its own work per step
    others_s: float  # the median of the other ranks'
    since: float  # time.time() since when it has been slow

    @property
    def slower(self) -> float:
        return self.busy_s / self.others_s - 1 if self.others_s > 0 else 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def slow(paces: Iterable[Pace], world_size: int) -> dict[int, tuple[Pace, float]]:
    """Rank -> (its pace, the other ranks' median) for each rank at least SLOWER above the others' median;
    nothing unless every rank of the job has a pace."""
    by_rank = {p.rank: p for p in paces}
    if world_size < 2 or len(by_rank) < world_size:
        return {}
    found = {}
    for rank, pace in by_rank.items():
        others = statistics.median(p.busy_s for r, p in by_rank.items() if r != rank)
        if others > 0 and pace.busy_s >= (1 + SLOWER) * others:
            found[rank] = (pace, others)
    return found


class Judge:
    """Since when each rank has been slow; which ones are named now, and which named ones keep pace again."""

    def __init__(self, window: float):
        self.window = window
        self._since: dict[int, float] = {}
        self._keeping: dict[int, float] = {}  # a named rank -> since when it has kept pace
        self.named: dict[int, Straggler] = {}

    def update(self, paces: Sequence[Pace], world_size: int, now: float) -> tuple[list[Straggler], list[Straggler]]:
        """(the ranks named by this judgement, the named ranks that keep pace again)."""
        found = slow(paces, world_size)
        if not found and len({p.rank for p in paces}) < world_size:
            return [], []  # not every rank has a figure (a group forming, a look too early): no judgement
        for rank in list(self._since):
            if rank not in found:
                del self._since[rank]
        named = []
        for rank, (pace, others) in sorted(found.items()):
            since = self._since.setdefault(rank, now)
            if rank not in self.named and now - since >= self.window:
                self.named[rank] = Straggler(rank, pace.node, pace.busy_s, others, since)
                named.append(self.named[rank])
        recovered = []
        by_rank = {p.rank: p for p in paces}
        for rank in list(self.named):
            pace = by_rank.get(rank)
            others = [p.busy_s for r, p in by_rank.items() if r != rank]
            median = statistics.median(others) if others else 0.0
            if pace is not None and median > 0 and pace.busy_s >= median * (1 + KEEPING):
                self._keeping.pop(rank, None)  # still slow, or between the two bounds: still named
                continue
            if now - self._keeping.setdefault(rank, now) >= self.window:
                gone = self.named.pop(rank)
                del self._keeping[rank]
                recovered.append(Straggler(rank, gone.node, pace.busy_s if pace else 0.0, median, gone.since))
        return named, recovered


def describe(stragglers: Sequence[Straggler], paces: Sequence[Pace], now: float) -> list[str]:
    """One line per node: the node when every rank it has is named, else each rank."""
    lines = []
    ranks_of: dict[str, set[int]] = {}
    for pace in paces:
        ranks_of.setdefault(pace.node, set()).add(pace.rank)
    by_node: dict[str, list[Straggler]] = {}
    for straggler in stragglers:
        by_node.setdefault(straggler.node, []).append(straggler)
    for node, named in sorted(by_node.items()):
        busy = statistics.median(s.busy_s for s in named)
        others = statistics.median(s.others_s for s in named)
        ranks = sorted(s.rank for s in named)
        if len(named) > 1 and set(ranks) == ranks_of.get(node, set()):
            who = f"node {node} (ranks {', '.join(map(str, ranks))})"
        else:
            who = ", ".join(f"rank {r}" for r in ranks) + f" (node {node})"
        for_s = now - min(s.since for s in named)
        lines.append(f"straggler: {who} spends {busy:.3g}s of its own work per step, the other ranks {others:.3g}s "
                     f"(+{busy / others - 1:.0%}), for {for_s:.0f}s: the whole job runs at its pace")
    return lines


def describe_recovered(recovered: Sequence[Straggler]) -> list[str]:
    return [f"straggler: rank {s.rank} (node {s.node}) keeps pace again: {s.busy_s:.3g}s of its own work per step, "
            f"the other ranks {s.others_s:.3g}s" for s in recovered]
