"""The node's metrics for Prometheus (--metrics-port), and the run's records (trainpod.records): what this node's
agent knows, served over HTTP and appended to <output>/records/<host>.jsonl for `trainpod report`.

    trainpod run --metrics-port 9400 ...        # then: curl http://<node>:9400/metrics

The agent serves them (prometheus_client's HTTP server, a daemon thread), from two sources:

- the local ranks' progress records (trainpod.train.progress), read every SAMPLE_S by a thread of
  this module: each rank's last step, its steps and samples so far (counted from the steps it
  reported: a step trained again after a restart counts again, as it cost again), its step time's
  quantiles over the last STEP_WINDOW steps it was seen to take, its own work per step (the
  straggler view), and the last committed checkpoint;
- events the agent's other parts report (record_*()): the worker group's world and node count,
  restarts by cause, membership changes, recoveries (from a failure to the next step), hangs,
  stragglers.

METRICS is the one table of their names, types, labels and meanings (Prometheus' conventions: the
`trainpod_` prefix, base units, `_total` for counters); docs/metrics.md is generated from it. Off by
default: a port on every node is something a job exposes only when asked. The server listens on every
interface (Prometheus scrapes the nodes from elsewhere); it serves nothing but these figures.

The same Recorder writes the run's records wherever the job has an output directory (the example's
--output-dir, TRAINPOD_OUTPUT_DIR), with or without a port: each event as it happens, and each local
rank's progress once a second while it advances (trainpod.records lists the kinds and their fields).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from trainpod import records as run_records
from trainpod.train import progress

SAMPLE_S = 1.0
STEP_WINDOW = 50
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # counter or gauge
    labels: tuple[str, ...]
    help: str


METRICS = (
    Metric("trainpod_step", "gauge", ("rank",), "the last step the rank finished (trainpod.train.progress.step)"),
    Metric("trainpod_steps_total", "counter", ("rank",), "steps the rank finished, as this node's agent saw them "
           "(a step trained again after a restart counts again)"),
    Metric("trainpod_samples_total", "counter", ("rank",), "samples the rank trained on, where it reports them "
           "(progress.step(n, samples=...); the bundled examples do)"),
    Metric("trainpod_step_seconds", "gauge", ("rank", "quantile"), "the rank's step time over its last 50 steps "
           "seen: quantiles 0.5, 0.9 and 0.99"),
    Metric("trainpod_own_work_seconds", "gauge", ("rank",), "the rank's own work in its last step, before it waits for "
           "the others (progress.measure(); the straggler watch compares it)"),
    Metric("trainpod_committed_step", "gauge", (), "the newest step whose checkpoint a rank of this node reported "
           "committed (-1: none)"),
    Metric("trainpod_checkpoint_save_seconds", "gauge", ("rank",), "the rank's last committed checkpoint: from its "
           "save() to its commit, the write running beside training (trainpod.train.checkpoint)"),
    Metric("trainpod_checkpoint_stall_seconds", "gauge", ("rank",), "how long the rank's last committed checkpoint's "
           "save() held its training loop: waiting for the previous write, then copying the state"),
    Metric("trainpod_world_size", "gauge", (), "ranks in the worker group now running (0: none)"),
    Metric("trainpod_nodes", "gauge", (), "nodes in the worker group now running (0: none)"),
    Metric("trainpod_spare", "gauge", (), "1 while this node waits as a spare (an elastic job at --nnodes' maximum: it "
           "takes the place of the first node that leaves), else 0"),
    Metric("trainpod_restarts_total", "counter", ("cause",), "worker-group restarts this node's agent made, by cause: "
           "failure (a rank exited non-zero or died of a signal), hang (the hang watch)"),
    Metric("trainpod_membership_changes_total", "counter", (), "rendezvous rounds that met with other nodes than "
           "the last: another number of them, or a node in the place of one that left (a spare)"),
    Metric("trainpod_recoveries_total", "counter", (), "restarts followed by a step: the recoveries "
           "trainpod_recovery_seconds times"),
    Metric("trainpod_recovery_seconds", "gauge", (), "the last recovery: from the failure to the first step after it"),
    Metric("trainpod_hangs_total", "counter", (), "hangs the hang watch named (each ends the worker group)"),
    Metric("trainpod_stragglers_total", "counter", (), "times a rank of this node was named a straggler"),
    Metric("trainpod_straggler", "gauge", ("rank",), "1 while the rank is named a straggler, else 0"),
)
BY_NAME = {metric.name: metric for metric in METRICS}


class _Rank:
    def __init__(self) -> None:
        self.step = -1
        self.samples = 0
        self.committed = -1  # the commit its last report named (a checkpoint record for each other one it saved)
        self.seen: tuple[int, float] | None = None  # (step, its report's time) at the last look
        self.steps: deque[float] = deque(maxlen=STEP_WINDOW)


class Recorder:
    """The figures, kept between scrapes; the agent's parts report events to it, a thread samples the ranks."""

    def __init__(self, progress_dir: str | Path, records: run_records.Writer | None = None):
        self.progress_dir = Path(progress_dir)
        self.records = records  # the run's records, where the job has an output directory
        self.lock = threading.Lock()
        self.counters: dict[tuple[str, tuple[str, ...]], float] = {}
        self.gauges: dict[tuple[str, tuple[str, ...]], float] = {("trainpod_committed_step", ()): -1,
                                                                 ("trainpod_world_size", ()): 0, ("trainpod_nodes", ()): 0,
                                                                 ("trainpod_spare", ()): 0}
        self.ranks: dict[int, _Rank] = {}
        self.local: dict[int, int] = {}  # local rank -> global rank, of the group now running
        self.started = 0.0  # time.time() when that group started
        self.failed_at: float | None = None  # a failure not yet followed by a step

    # --- events -----------------------------------------------------------------------------------

    def count(self, name: str, *labels: str, by: float = 1) -> None:
        with self.lock:
            key = (name, labels)
            self.counters[key] = self.counters.get(key, 0) + by

    def set(self, name: str, value: float, *labels: str) -> None:
        with self.lock:
            self.gauges[(name, labels)] = value

    def event(self, kind: str, at: float | None = None, **fields) -> None:
        """A run record of `kind` (trainpod.records.KINDS) at `at` (time.time() when None)."""
        if self.records is not None:
            self.records.write(kind, time.time() if at is None else at, **fields)

    def group_started(self, local_to_global: Mapping[int, int], world_size: int, nodes: int) -> None:
        with self.lock:
            self.local, self.started = dict(local_to_global), time.time()
            self.gauges[("trainpod_world_size", ())] = world_size
            self.gauges[("trainpod_nodes", ())] = nodes
            for rank in self.local.values():
                self.gauges.setdefault(("trainpod_straggler", (str(rank),)), 0)
        self.event("started", at=self.started, world=world_size, nodes=nodes, ranks=sorted(local_to_global.values()))

    def group_failed(self, cause: str, restarting: bool) -> None:
        if restarting:
            self.count("trainpod_restarts_total", cause)
        with self.lock:
            self.failed_at = self.failed_at or time.time()
            # The failed group's ranks may still report a step they finished before the failure was seen: none of theirs
            # counts from here on (a recovery is timed to the next group's first step, never to one of theirs).
            self.local, self.started = {}, float("inf")
            self.gauges[("trainpod_world_size", ())] = 0
            self.gauges[("trainpod_nodes", ())] = 0
        self.event("failed", cause=cause, restarting=restarting)

    # --- the ranks' reports -----------------------------------------------------------------------

    def sample(self) -> None:
        records = progress.read(self.progress_dir)
        events: list[tuple] = []  # written once the lock is released: a slow disk never holds a scrape
        with self.lock:
            for local, rank in self.local.items():
                record = records.get(local)
                if record is None or record.time < self.started:
                    continue  # none yet, or the last group's
                state = self.ranks.setdefault(rank, _Rank())
                per_step = None
                if state.seen is not None and record.step > state.seen[0] and record.time > state.seen[1]:
                    advanced = record.step - state.seen[0]
                    per_step = (record.time - state.seen[1]) / advanced
                    state.steps.extend([per_step] * min(advanced, STEP_WINDOW))
                    self.counters[("trainpod_steps_total", (str(rank),))] = \
                        self.counters.get(("trainpod_steps_total", (str(rank),)), 0) + advanced
                if record.samples > state.samples or (state.seen is None and record.samples):
                    gained = record.samples - state.samples if record.samples > state.samples else record.samples
                    self.counters[("trainpod_samples_total", (str(rank),))] = \
                        self.counters.get(("trainpod_samples_total", (str(rank),)), 0) + gained
                state.samples = record.samples
                if state.seen is None or record.step != state.seen[0]:
                    if self.failed_at is not None and record.step >= 0:  # the first step since the failure
                        self.gauges[("trainpod_recovery_seconds", ())] = record.time - self.failed_at
                        self.counters[("trainpod_recoveries_total", ())] = self.counters.get(("trainpod_recoveries_total", ()), 0) + 1
                        events.append(("recovered", record.time, {"seconds": round(record.time - self.failed_at, 3),
                                                                  "step": record.step}))
                        self.failed_at = None
                    if record.step >= 0:
                        events.append(("progress", record.time, {
                            "rank": rank, "step": record.step, "samples": record.samples, "own_s": round(record.busy, 6),
                            "step_s": None if per_step is None else round(per_step, 6)}))
                    state.seen = (record.step, record.time)
                state.step = record.step
                self.gauges[("trainpod_step", (str(rank),))] = record.step
                self.gauges[("trainpod_own_work_seconds", (str(rank),))] = record.busy
                if record.save:  # a checkpoint this rank saved and committed (a resumed one reports none)
                    self.gauges[("trainpod_checkpoint_save_seconds", (str(rank),))] = record.save
                    self.gauges[("trainpod_checkpoint_stall_seconds", (str(rank),))] = record.stall
                    if record.committed != state.committed:  # a new commit (a step saved again after a resume too)
                        events.append(("checkpoint", record.time, {"rank": rank, "step": record.committed,
                                                                   "save_s": round(record.save, 6),
                                                                   "stall_s": round(record.stall, 6)}))
                state.committed = record.committed
                if state.steps:
                    ordered = sorted(state.steps)
                    for q in QUANTILES:
                        value = ordered[min(len(ordered) - 1, int(q * len(ordered)))] if q < 1 else ordered[-1]
                        self.gauges[("trainpod_step_seconds", (str(rank), f"{q:g}"))] = value
            committed = max((r.committed for r in records.values()), default=-1)
            if committed > self.gauges[("trainpod_committed_step", ())]:
                self.gauges[("trainpod_committed_step", ())] = committed
        for kind, at, fields in events:
            self.event(kind, at=at, **fields)

    # --- prometheus_client's side -----------------------------------------------------------------

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self.lock:
            counters, gauges = dict(self.counters), dict(self.gauges)
        for metric in METRICS:
            if metric.kind == "counter":
                # prometheus_client adds `_total` to a counter's samples itself: the family is named without it.
                family = CounterMetricFamily(metric.name.removesuffix("_total"), metric.help, labels=metric.labels)
                values = counters
            else:
                family = GaugeMetricFamily(metric.name, metric.help, labels=metric.labels)
                values = gauges
            found = [(labels, value) for (name, labels), value in sorted(values.items()) if name == metric.name]
            if not found and not metric.labels:
                found = [((), 0.0)]  # an unlabelled counter exists from the start, at 0
            for labels, value in found:
                family.add_metric(list(labels), value)
            yield family


_recorder: Recorder | None = None


def recorder() -> Recorder | None:
    """This agent's Recorder, None where it serves no metrics and writes no records."""
    return _recorder


def start(progress_dir: str | Path, port: int = 0, records: run_records.Writer | None = None,
          address: str = "0.0.0.0") -> Recorder:
    """The Recorder and its sampling thread; with a `port`, the HTTP server first (OSError where it cannot be bound)."""
    global _recorder
    recorder_ = Recorder(progress_dir, records)
    if port:
        from prometheus_client import start_http_server
        from prometheus_client.registry import CollectorRegistry

        registry = CollectorRegistry(auto_describe=True)
        registry.register(recorder_)
        start_http_server(port, addr=address, registry=registry)

    def sample_forever() -> None:
        while True:
            time.sleep(SAMPLE_S)
            with contextlib.suppress(Exception):  # the figures must never take the agent down
                recorder_.sample()

    def last_look() -> None:  # the ranks' last steps and commits, made after the last sample: the job's end in the records
        with contextlib.suppress(Exception):
            recorder_.sample()

    threading.Thread(target=sample_forever, name="trainpod-metrics", daemon=True).start()
    atexit.register(last_look)
    _recorder = recorder_
    return recorder_

