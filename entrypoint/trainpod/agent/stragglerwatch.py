"""The agent's straggler watch: a thread that reads the local ranks' reports and acts on trainpod.agent.stragglers.

Every INTERVAL_S it reads each local rank's progress record (trainpod.train.progress: its step and
its own work in that step), keeps the figures of the last seconds, and judges every rank of the job.
Several nodes: each agent publishes its ranks' figures in the rendezvous store the agents share (a
key per node, under this round's prefix, as the hang watch does) and reads the others', so every
agent judges the same figures. Each agent speaks for its own ranks only: the line naming a straggler
comes from the agent of the node that has it, once, and again when it keeps pace again, and the same
events go to `<output>/stragglers.jsonl` (one JSON object per line: the run's record of them).

It costs the ranks nothing but their report (trainpod.train.progress.measure), and the agent a read
of a few small files and one store round trip per INTERVAL_S.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from trainpod import log
from trainpod.agent import metrics
from trainpod.agent.hang import output_dir
from trainpod.agent.stragglers import SPAN_S, Judge, Pace, Reports, Straggler, describe, describe_recovered
from trainpod.contract import PROGRESS_DIR_VAR, STRAGGLERS_FILE
from trainpod.train import progress

INTERVAL_S = 2.0
KEY_PREFIX = "trainpod/stragglers/"


class StragglerWatch:
    """One per agent; start() per worker group, stop() when the group stops."""

    def __init__(self, window: float, node: str, say: log.Log, env: Mapping[str, str], interval: float = INTERVAL_S,
                 span: float = SPAN_S):
        self.window = window
        self.span = span
        self.node = node
        self.say = say
        self.interval = interval
        self.output = Path(output_dir(env))
        self.progress_dir = Path(env.get(PROGRESS_DIR_VAR, "").strip() or ".")
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._named: dict[int, Straggler] = {}  # this node's ranks named and not keeping pace again (this group's)

    @staticmethod
    def wanted(window: float, node: str, say: log.Log, env: Mapping[str, str]) -> StragglerWatch | None:
        """The watch --straggler-window asks for (RunSpec.straggler_window), None when it is 0."""
        return StragglerWatch(window, node, say, env) if window > 0 else None

    def start(self, ranks: Mapping[int, int], world_size: int, store=None, group_rank: int = 0,
              group_world_size: int = 1) -> None:
        """Watch a worker group: `ranks` maps each local rank to its global rank."""
        self.stop()
        self._stop = threading.Event()
        self._named = {}
        keys = ([f"{KEY_PREFIX}node{g}" for g in range(group_world_size)], f"{KEY_PREFIX}node{group_rank}") \
            if store is not None and group_world_size > 1 else None
        self._thread = threading.Thread(target=self._run, args=(dict(ranks), world_size, store, keys, time.time(), self._stop),
                                        name="trainpod-straggler-watch", daemon=True)
        self._thread.start()

    def named_here(self) -> list[Straggler]:
        """This node's ranks that the watch named and that do not keep pace again yet (the agent's --replace-stragglers)."""
        return list(self._named.values())

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self._thread = None

    def _run(self, ranks: dict[int, int], world_size: int, store, keys, started: float, stop: threading.Event) -> None:
        reports, judge = Reports(self.span), Judge(self.window)
        try:
            while not stop.wait(self.interval):
                now = time.time()
                records = progress.read(self.progress_dir)
                for local, rank in ranks.items():
                    record = records.get(local)
                    if record is not None and record.time >= started:  # older ones are the last group's
                        reports.add(rank, record.step, record.busy, now)
                paces = reports.paces(self.node, now)
                if keys is not None:
                    paces = self._exchange(store, keys, paces)
                named, recovered = judge.update(paces, world_size, now)
                mine = set(ranks.values())
                self._tell([s for s in named if s.rank in mine], [s for s in recovered if s.rank in mine], paces, now)
        except Exception as exc:  # the watch must never take the agent down
            self.say(f"warning: the straggler watch stopped: {type(exc).__name__}: {exc}")

    def _exchange(self, store, keys: tuple[list[str], str], paces: list[Pace]) -> list[Pace]:
        """This node's figures published, every node's read back (this one's as they are)."""
        every, own = keys
        try:
            store.set(own, json.dumps([p.to_dict() for p in paces]))
            theirs = [key for key in every if key != own]
            found = [key for key in theirs if store.check([key])]
            return paces + [Pace.from_dict(d) for key in found for d in json.loads(store.get(key))]
        except Exception:  # the store is gone (node 0's agent ended): judge what this node sees
            return paces

    def _tell(self, named: list[Straggler], recovered: list[Straggler], paces: list[Pace], now: float) -> None:
        now_named = dict(self._named)
        for straggler in recovered:
            now_named.pop(straggler.rank, None)
        now_named.update((straggler.rank, straggler) for straggler in named)
        self._named = now_named  # replaced whole: the agent's thread reads it (named_here)
        for line in describe(named, paces, now) + describe_recovered(recovered):
            self.say(line)
        if (figures := metrics.recorder()) is not None:
            for straggler in named:
                figures.count("trainpod_stragglers_total")
                figures.set("trainpod_straggler", 1, str(straggler.rank))
                figures.event("straggler", at=now, rank=straggler.rank, own_s=straggler.busy_s, others_s=straggler.others_s)
            for straggler in recovered:
                figures.set("trainpod_straggler", 0, str(straggler.rank))
                figures.event("straggler", at=now, rank=straggler.rank, own_s=straggler.busy_s, others_s=straggler.others_s,
                              recovered=True)
        events = [{"event": "straggler", "time": now, **s.to_dict()} for s in named]
        events += [{"event": "keeps pace", "time": now, **s.to_dict()} for s in recovered]
        if not events:
            return
        try:
            self.output.mkdir(parents=True, exist_ok=True)
            with open(self.output / STRAGGLERS_FILE, "a") as f:  # one write per event line: appends do not interleave
                for event in events:
                    f.write(json.dumps(event) + "\n")
        except OSError as exc:  # the line matters more than the file
            self.say(f"warning: {self.output / STRAGGLERS_FILE}: {exc.strerror}: the straggler event is in this log only")


class StragglerAgent:
    """torch's agent hooks for the straggler watch: `class Agent(..., StragglerAgent, LocalElasticAgent)`, with
    `straggler_watch` set to a StragglerWatch (None: no watch)."""

    straggler_watch: StragglerWatch | None = None

    def _start_workers(self, worker_group):
        pids = super()._start_workers(worker_group)
        watch = self.straggler_watch
        if watch is not None and worker_group.workers:
            watch.start({w.local_rank: w.global_rank for w in worker_group.workers},
                        world_size=worker_group.workers[0].world_size, store=worker_group.store,
                        group_rank=worker_group.group_rank or 0, group_world_size=worker_group.group_world_size or 1)
        return pids

    def _stop_workers(self, *args, **kwargs):
        if self.straggler_watch is not None:
            self.straggler_watch.stop()
        return super()._stop_workers(*args, **kwargs)

    def _shutdown(self, *args, **kwargs):
        if self.straggler_watch is not None:
            self.straggler_watch.stop()
        return super()._shutdown(*args, **kwargs)
