"""`trainpod report OUTPUT_DIR [--out FILE]`: the run, drawn in one HTML file.

    trainpod report ./output                  # writes ./output/report.html and prints its path
    trainpod report ./output --out run.html

A launcher-side command: it reads files only (never torch), on any machine that sees the job's output
directory, during the run or after it. The file holds all it needs, plotly.js included: it opens offline,
as a CI artifact or an attachment. It needs plotly (pip install 'trainpod[report]'). The file is written
whole or not at all (a temporary file beside it, then a rename): a browser that has it open never reads half.

Its inputs, each optional (it draws what there is; with neither it is one line and 78):

    <output>/records/<host>.jsonl   the run records: one file per node, written by each node's agent
                                    (trainpod.records lists their kinds and fields)
    <output>/metrics.json           written by global rank 0 of the bundled examples at the end: the loss
                                    curve, samples/s, world size, final loss, test accuracy

One figure, its rows on one time axis (seconds since the first record; the header gives that moment in
UTC), each row only where its data exists:

    events       a marker per failure, recovery, membership change, hang and straggler (hover: its node and
                 what it says); the same events are vertical lines across every row
    loss         metrics.json's loss curve, each step placed at the time global rank 0 reported it (its progress
                 records: interpolated between them, at rank 0's mean pace beyond them)
    throughput   the job's samples/s: each rank's samples so far, summed over the ranks on one grid of times and
                 differenced; where no rank reports samples, steps/s (the mean of the ranks')
    step time    per rank: seconds per step (solid) and its own work per step (dotted): the straggler view
    world size   the ranks of the running group (`started`), 0 from a `failed` to the next start
    checkpoints  each committed save, per rank: save() to commit, and how long save() held the training loop

Without progress records of rank 0 (metrics.json alone, say) the loss is drawn by step, in a figure of its own.
Above the figures, a header: the example, world, final loss, test accuracy and samples/s (metrics.json), and the
counts of restarts, recoveries, hangs and stragglers; below them, a table of every event in time order. Every value
read from the files is escaped: a node name or a cause is data, never markup.

Every node's agent sees a failure of the job and writes its own `failed` line (and its own recovery, membership change
and hang): the header counts the most that any one node recorded.

What it cannot use, it says. A records line that cannot be drawn (not JSON, not a record object, a "time" that is no
date: NaN, an infinity, 1e20) is left out with one warning on stderr, and the report lists it (file:line, what it
holds, what was expected); with nothing else to draw that is one line and 78. Left out without a word, as the records'
reader leaves them out: a file's last line cut short (its node stopped while writing it) and a kind this version does
not know (another version's). A records directory or file that cannot be read is one line naming it and 78: a report
that silently leaves out a node's records would draw another run.
"""

from __future__ import annotations

import bisect
import html
import json
import math
import os
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainpod import atomic, log, records
from trainpod.contract import RECORDS_DIR, REPORT_FILE
from trainpod.errors import ConfigError
from trainpod.examples.reporting import METRICS_FILE

GRID_POINTS = 200  # the throughput's resolution: enough to show a restart's dip, few enough to stay smooth
MAX_POINTS = 2000  # per trace: a day of once-a-second records would make the file heavy and the page slow
NAMED_NODES = 8  # the header names this many nodes (the table names every event's)
EVENTS = ("failed", "recovered", "membership", "hang", "straggler")  # drawn as markers and lines across the rows
COLORS = {"failed": "#d62728", "recovered": "#2ca02c", "membership": "#9467bd", "hang": "#ff7f0e",
          "straggler": "#8c564b"}
SYMBOLS = {"failed": "x", "recovered": "circle", "membership": "diamond", "hang": "hourglass",
           "straggler": "triangle-down"}
NEEDS_PLOTLY = "trainpod report: needs plotly: pip install 'trainpod[report]'"
NAMED_LEFT_OUT = 20  # the report lists this many of the records lines it left out (and counts the rest)


@dataclass(frozen=True)
class Run:
    """What an output directory holds: its records (time order) and rank 0's metrics.json (None where absent)."""

    directory: Path
    records: list[records.Record]
    metrics: dict[str, Any] | None
    left_out: tuple[str, ...] = ()  # the first NAMED_LEFT_OUT records lines that cannot be drawn: "FILE:LINE: why"
    left_out_count: int = 0  # how many there are in all

    @property
    def start(self) -> float:
        """The time axis' zero: the first record (unix seconds)."""
        return self.records[0].time if self.records else 0.0

    def of(self, *kinds: str) -> list[records.Record]:
        return [record for record in self.records if record.kind in kinds]


# --- reading ---------------------------------------------------------------------------------------


def load(output_dir: str | os.PathLike) -> Run:
    """The run in `output_dir`; ConfigError (78) where it is no directory or holds neither input."""
    directory = Path(output_dir)
    if not directory.exists():
        raise ConfigError(f"trainpod report: {directory}: no such directory: expected a job's output directory "
                          f"(with {RECORDS_DIR}/*.jsonl or {METRICS_FILE})")
    if not directory.is_dir():
        raise ConfigError(f"trainpod report: {directory}: not a directory: expected a job's output directory "
                          f"(with {RECORDS_DIR}/*.jsonl or {METRICS_FILE})")
    read, (metrics, problem) = _records(directory), _metrics(directory / METRICS_FILE)
    found = read.records
    if problem and not found:
        raise ConfigError(f"trainpod report: {directory / METRICS_FILE}: {problem}: expected the JSON object rank 0 "
                          f"writes (and there are no run records to draw without it: {read.none()})")
    if problem:
        _warn(f"{directory / METRICS_FILE}: {problem}: drawn without it")
    if not found and metrics is None:
        if read.files:  # files, but not one record in them that can be drawn: say what they hold
            raise ConfigError(f"trainpod report: {read.none()}; and no {METRICS_FILE} in {directory}")
        raise ConfigError(f"trainpod report: no run records ({RECORDS_DIR}/*.jsonl) or {METRICS_FILE} in {directory}: "
                          "expected a job's output directory (--output-dir, TRAINPOD_OUTPUT_DIR), written by its "
                          "agents and its rank 0")
    if read.left_out:
        more = f" (and {read.count - 1} more; the report lists them)" if read.count > 1 else ""
        _warn(f"{read.left_out[0]}: left out{more}")
    return Run(directory, found, metrics, tuple(read.left_out), read.count)


@dataclass
class _Read:
    """The records for the report (trainpod.records.scan) and the lines that cannot be drawn: the first
    NAMED_LEFT_OUT, "FILE:LINE: what it holds: what was expected", and how many."""

    directory: Path  # OUTPUT/records
    files: list[Path]
    records: list[records.Record]
    left_out: list[str]
    count: int = 0

    def none(self) -> str:
        """Why there is no record to draw, in words."""
        if self.left_out:
            more = f" (and {self.count - 1} more lines that cannot be drawn)" if self.count > 1 else ""
            return f"{self.left_out[0]}{more}; no other run record in {self.directory}/*.jsonl"
        if self.files:
            named = str(self.files[0]) + (f" and {len(self.files) - 1} more files" if len(self.files) > 1 else "")
            return (f"no run record in {named}: expected lines {records.LINE} with kind one of {', '.join(records.KINDS)} "
                    "(a last line cut short, by a node that stopped while writing it, is left out)")
        return f"no {self.directory}/*.jsonl"


def _records(directory: Path) -> _Read:
    """The records under directory/records; a ConfigError (78) naming the records directory or a file of it that
    cannot be read (a report without a node's records would be another run's)."""
    try:
        found = records.scan(directory)
    except OSError as error:
        where = error.filename or directory / RECORDS_DIR
        what = ("the directory of the nodes' records files (*.jsonl)" if Path(where).name == RECORDS_DIR
                else "a node's records file")
        raise ConfigError(f"trainpod report: {where}: {error.strerror or error}: expected {what}, readable by this user") from None
    named = [f"{path}:{number}: {why}" for path, number, why in found.left_out[:NAMED_LEFT_OUT]]
    return _Read(found.directory, found.files, found.records, named, len(found.left_out))


def _metrics(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(metrics.json's object, None), (None, None) where there is none, (None, what is wrong) where it cannot be used."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as error:
        return None, str(getattr(error, "strerror", None) or error)
    if not isinstance(data, dict):
        return None, f"a JSON {type(data).__name__}, not an object"
    return data, None


def _warn(message: str) -> None:
    print(f"{log.prefix()}: warning: trainpod report: {message}", file=sys.stderr)


def _number(value: Any) -> float | None:
    """A finite number, or None (a field another version wrote differently, a null)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


# --- the series (plain lists: testable without plotly) -----------------------------------------------


def progress_by_rank(run: Run) -> dict[int, list[records.Record]]:
    """Each global rank's progress records, in time order."""
    ranks: dict[int, list[records.Record]] = defaultdict(list)
    for record in run.of("progress"):
        rank, step = record.get("rank"), _number(record.get("step"))
        if isinstance(rank, int) and not isinstance(rank, bool) and step is not None:
            ranks[rank].append(record)
    return dict(sorted(ranks.items()))


def loss_curve(metrics: dict[str, Any] | None) -> list[tuple[float, float]]:
    """metrics.json's [[step, loss], ...], what of it is numbers."""
    points = []
    curve = (metrics or {}).get("loss_curve")
    for item in curve if isinstance(curve, list) else []:
        if isinstance(item, (list, tuple)) and len(item) == 2:
            step, loss = _number(item[0]), _number(item[1])
            if step is not None and loss is not None:
                points.append((step, loss))
    return points


def step_clock(rank0: Sequence[records.Record]):
    """step -> time, from rank 0's (step, time): its last report of each step (a step trained again after a restart
    counts when it was trained last), interpolated between them and at rank 0's mean pace beyond them; None without
    any report."""
    last: dict[float, float] = {}
    for record in rank0:
        last[float(record.get("step"))] = record.time
    if not last:
        return None
    steps = sorted(last)
    times = [last[step] for step in steps]
    pace = (times[-1] - times[0]) / (steps[-1] - steps[0]) if len(steps) > 1 else 0.0  # seconds per step

    def at(step: float) -> float:
        if step <= steps[0]:
            return times[0] - (steps[0] - step) * pace
        if step >= steps[-1]:
            return times[-1] + (step - steps[-1]) * pace
        i = bisect.bisect_right(steps, step)
        share = (step - steps[i - 1]) / (steps[i] - steps[i - 1])
        return times[i - 1] + share * (times[i] - times[i - 1])

    return at


def _done(progress: Sequence[records.Record], field: str) -> list[tuple[float, float]]:
    """(time, how much of `field` this rank has done since its first record): a count that falls (a new process
    after a restart, counting from its checkpoint or from 0) starts again from there, adding nothing."""
    points, total, previous = [], 0.0, None
    for record in progress:
        value = _number(record.get(field)) or 0.0
        if previous is not None and value > previous:
            total += value - previous
        previous = value
        points.append((record.time, total))
    return points


def _value_at(points: Sequence[tuple[float, float]], times: Sequence[float], t: float) -> float:
    """The piecewise-linear value of `points` at t (held flat before the first and after the last)."""
    if t <= times[0]:
        return points[0][1]
    if t >= times[-1]:
        return points[-1][1]
    i = bisect.bisect_right(times, t)
    (t0, v0), (t1, v1) = points[i - 1], points[i]
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1


def throughput(by_rank: dict[int, list[records.Record]]) -> tuple[str, list[float], list[float]]:
    """("samples/s" or "steps/s", times, rates): the job's rate between the points of a grid over the progress
    records. Samples add up over the ranks (each trains its own share); steps are the ranks' mean (they step
    together), counted over the ranks that report at that time."""
    field = "samples" if any(_number(r.get("samples")) for rs in by_rank.values() for r in rs) else "step"
    unit = {"samples": "samples/s", "step": "steps/s"}[field]
    curves = [_done(progress, field) for progress in by_rank.values() if progress]
    if not curves:
        return unit, [], []
    first, last = min(c[0][0] for c in curves), max(c[-1][0] for c in curves)
    if last <= first:
        return unit, [], []
    grid = [first + (last - first) * i / GRID_POINTS for i in range(GRID_POINTS + 1)]
    stamps = [[t for t, _ in curve] for curve in curves]
    values = [[_value_at(curve, ts, t) for t in grid] for curve, ts in zip(curves, stamps)]
    times, rates = [], []
    for i in range(GRID_POINTS):
        dt = grid[i + 1] - grid[i]
        gained = [v[i + 1] - v[i] for v, ts in zip(values, stamps) if ts[0] <= grid[i] and grid[i + 1] <= ts[-1]]
        share = 1 if field == "samples" else max(len(gained), 1)  # steps: the mean of the ranks that report
        times.append((grid[i] + grid[i + 1]) / 2)
        rates.append(sum(gained) / share / dt)
    return unit, times, rates


def world_line(run: Run) -> list[tuple[float, float]]:
    """(time, world size): a group's `started` sets it, a `failed` sets 0; held to the last record."""
    points = []
    for record in run.of("started", "failed"):
        world = _number(record.get("world")) if record.kind == "started" else 0.0
        if world is not None:
            points.append((record.time, world))
    if points and run.records[-1].time > points[-1][0]:
        points.append((run.records[-1].time, points[-1][1]))
    return points


def restarts(run: Run) -> int:
    """The most restarts any one node recorded (every node writes its own `failed` for a failure of the job)."""
    return most_per_node(record for record in run.of("failed") if record.get("restarting"))


def most_per_node(found) -> int:
    """The most records any one node wrote of an event every node sees and records (a recovery, a membership change)."""
    per_node: dict[str, int] = defaultdict(int)
    for record in found:
        per_node[record.node] += 1
    return max(per_node.values(), default=0)


def describe(record: records.Record) -> str:
    """What an event says, in words (plain text: escaped where it is drawn)."""
    get, kind = record.get, record.kind
    if kind == "started":
        ranks = get("ranks")
        mine = f", this node's ranks {_ranks(ranks)}" if isinstance(ranks, list) and ranks else ""
        return f"world {_plain(get('world'))} on {_plain(get('nodes'))} nodes{mine}"
    if kind == "failed":
        return f"cause {_plain(get('cause'))}; " + ("restarting" if get("restarting") else "not restarted")
    if kind == "recovered":
        return f"{_seconds(get('seconds'))} after the failure, at step {_plain(get('step'))}"
    if kind == "membership":
        new = f", {_plain(get('new'))} of them in the place of nodes that left" if get("new") else ""
        return f"{_plain(get('nodes'))} nodes (were {_plain(get('before'))}{new})"
    if kind == "hang":
        ranks = get("ranks") if isinstance(get("ranks"), list) else []
        blamed = f"rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}" if ranks else "no rank named"
        return f"{blamed} stalled {_seconds(get('stalled_s'))} (bound {_seconds(get('limit_s'))})"
    if kind == "straggler":
        if get("recovered"):
            return f"rank {_plain(get('rank'))} keeps pace again"
        return (f"rank {_plain(get('rank'))} paces the job: its own work {_seconds(get('own_s'))} per step, "
                f"the others' {_seconds(get('others_s'))}")
    if kind == "checkpoint":
        return (f"rank {_plain(get('rank'))}, step {_plain(get('step'))}: saved in {_seconds(get('save_s'))}, "
                f"training held {_seconds(get('stall_s'))}")
    return ", ".join(f"{name} {_plain(value)}" for name, value in record.fields.items())


def _plain(value: Any) -> str:
    return "?" if value is None else str(value)


def _seconds(value: Any) -> str:
    number = _number(value)
    return f"{number:.3g} s" if number is not None else _plain(value)


def _ranks(ranks: list) -> str:
    if all(isinstance(r, int) for r in ranks) and ranks == list(range(ranks[0], ranks[0] + len(ranks))) and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(str(r) for r in ranks)


def _thin(*columns: list, limit: int = MAX_POINTS) -> tuple[list, ...]:
    """Every k-th point of the columns (and the last), at most about `limit`."""
    size = len(columns[0])
    if size <= limit:
        return columns
    keep = list(range(0, size, math.ceil(size / limit)))
    if keep[-1] != size - 1:
        keep.append(size - 1)
    return tuple([column[i] for i in keep] for column in columns)


# --- the figures ------------------------------------------------------------------------------------


def _plotly():
    """(plotly.graph_objects, plotly.subplots.make_subplots), or the one line that says how to get them."""
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError:
        raise ConfigError(NEEDS_PLOTLY) from None
    return go, make_subplots


def _rows(run: Run, go) -> list[tuple[str, str, list]]:
    """(title, y axis title, traces) per row of the run's figure, only the rows that have data."""
    start, rows = run.start, []
    by_rank = progress_by_rank(run)
    events = run.of(*EVENTS)
    if events:
        traces = []
        for kind in EVENTS:
            mine = [record for record in events if record.kind == kind]
            if mine:
                traces.append(go.Scatter(
                    x=[r.time - start for r in mine], y=[kind] * len(mine), mode="markers", name=kind,
                    legendgroup=kind, marker={"color": COLORS[kind], "symbol": SYMBOLS[kind], "size": 11},
                    hovertext=[html.escape(f"{r.node}: {describe(r)}") for r in mine], hoverinfo="x+y+text"))
        rows.append(("events", "", traces))
    clock = step_clock(by_rank.get(0, []))
    curve = loss_curve(run.metrics)
    if clock and curve:
        xs, ys, steps = _thin([clock(step) - start for step, _ in curve], [loss for _, loss in curve],
                              [f"step {step:g}" for step, _ in curve])
        rows.append(("loss (metrics.json), placed by global rank 0's steps", "loss", [go.Scatter(
            x=xs, y=ys, mode="lines+markers", name="loss", marker={"size": 4}, hovertext=steps,
            hoverinfo="x+y+text")]))
    if by_rank:
        unit, times, rates = throughput(by_rank)
        if times:
            rows.append((f"throughput of the job ({unit})", unit, [go.Scatter(
                x=[t - start for t in times], y=rates, mode="lines", name=unit, line={"shape": "hvh"})]))
        traces = []
        for i, (rank, progress) in enumerate(by_rank.items()):
            color = _palette(i)
            for field, name, dash in (("step_s", "step", "solid"), ("own_s", "own work", "dot")):
                points = [(r.time - start, _number(r.get(field))) for r in progress]
                points = [(t, v) for t, v in points if v]  # own_s 0: not measured; step_s null: the first report
                if points:
                    xs, ys = _thin([t for t, _ in points], [v for _, v in points])
                    traces.append(go.Scatter(x=xs, y=ys, mode="lines", name=f"rank {rank} {name}",
                                             legendgroup=f"rank {rank}", line={"color": color, "dash": dash}))
        if traces:
            rows.append(("seconds per step (solid) and own work per step (dotted), per rank", "seconds", traces))
    world = world_line(run)
    if world:
        rows.append(("world size (ranks)", "ranks", [go.Scatter(
            x=[t - start for t, _ in world], y=[w for _, w in world], mode="lines", name="world size",
            line={"shape": "hv", "color": "#1f77b4"})]))
    saves = run.of("checkpoint")
    if saves:
        traces = [go.Scatter(
            x=[r.time - start for r in saves], y=[_number(r.get(field)) for r in saves], mode="markers", name=name,
            marker={"symbol": symbol, "size": 8},
            hovertext=[html.escape(f"{r.node}: {describe(r)}") for r in saves], hoverinfo="x+y+text")
            for field, name, symbol in (("save_s", "checkpoint: save to commit", "circle"),
                                        ("stall_s", "checkpoint: training held", "x"))]
        rows.append(("checkpoints: seconds from save() to commit, and seconds save() held training", "seconds",
                     traces))
    return rows


def _palette(i: int) -> str:
    colors = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
              "#17becf")
    return colors[i % len(colors)]


def run_figure(run: Run, go, make_subplots):
    """The run's rows on one time axis, with the events as lines across them; None without records."""
    rows = _rows(run, go) if run.records else []
    if not rows:
        return None
    heights = [0.5 if title == "events" else 1.0 for title, _, _ in rows]
    figure = make_subplots(rows=len(rows), cols=1, shared_xaxes=True, vertical_spacing=0.35 / len(rows),
                           subplot_titles=[title for title, _, _ in rows], row_heights=heights)
    for row, (_, axis, traces) in enumerate(rows, start=1):
        for trace in traces:
            figure.add_trace(trace, row=row, col=1)
        figure.update_yaxes(title_text=axis, row=row, col=1)
    for record in run.of(*EVENTS):
        # One line from top to bottom (the rows' x axes are matched, so any one of them places it).
        figure.add_shape(type="line", xref="x", yref="paper", x0=record.time - run.start, x1=record.time - run.start,
                         y0=0, y1=1, layer="below", line={"color": COLORS[record.kind], "width": 1, "dash": "dot"})
    figure.update_xaxes(showticklabels=True)
    figure.update_xaxes(title_text="seconds since the first record", row=len(rows), col=1)
    figure.update_layout(height=140 + sum(260 * h for h in heights), hovermode="closest",
                         margin={"l": 70, "r": 20, "t": 60, "b": 50})
    return figure


def loss_by_step_figure(run: Run, go):
    """The loss by step, where the records cannot place it in time (none of rank 0's progress); else None."""
    curve = loss_curve(run.metrics)
    if not curve or step_clock(progress_by_rank(run).get(0, [])):
        return None
    xs, ys = _thin([step for step, _ in curve], [loss for _, loss in curve])
    figure = go.Figure(go.Scatter(x=xs, y=ys, mode="lines+markers", name="loss", marker={"size": 4}))
    figure.update_layout(title="loss by step (metrics.json; no progress records of global rank 0 to place it in time)",
                         xaxis_title="step", yaxis_title="loss", height=400, margin={"l": 70, "r": 20, "t": 60, "b": 50})
    return figure


def figures(run: Run) -> list[tuple[str, Any]]:
    """(div id, figure) for each figure there is data for."""
    go, make_subplots = _plotly()
    made = [("trainpod-run", run_figure(run, go, make_subplots)), ("trainpod-loss-by-step", loss_by_step_figure(run, go))]
    return [(name, figure) for name, figure in made if figure is not None]


# --- the page ---------------------------------------------------------------------------------------


STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em 2em; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
.where { color: #666; margin-top: 0; font-family: monospace; }
dl { display: grid; grid-template-columns: max-content auto; gap: 0.2em 1.2em; }
dt { font-weight: 600; }
dd { margin: 0; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
td.number { text-align: right; font-variant-numeric: tabular-nums; }
"""


def header(run: Run) -> list[tuple[str, str]]:
    """(what, value) lines above the figures, plain text."""
    lines = []
    metrics = run.metrics or {}
    if "example" in metrics:
        lines.append(("example", _plain(metrics["example"])))
    if "world_size" in metrics:
        nodes = f" on {_plain(metrics['nnodes'])} nodes" if "nnodes" in metrics else ""
        lines.append(("world", f"{_plain(metrics['world_size'])} ranks{nodes}"))
    for key, name, fmt in (("final_loss", "final loss", ".4f"), ("test_accuracy", "test accuracy", ".3f"),
                           ("samples_per_sec", "samples/s", ".1f")):
        if key in metrics:
            number = _number(metrics[key])
            lines.append((name, format(number, fmt) if number is not None else _plain(metrics[key])))
    if run.records:
        nodes = sorted({record.node for record in run.records})
        named = ", ".join(nodes[:NAMED_NODES]) + (f" and {len(nodes) - NAMED_NODES} more" if len(nodes) > NAMED_NODES else "")
        began = datetime.fromtimestamp(run.start, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        lines.append(("records", f"{len(run.records)} from {len(nodes)} nodes ({named}), "
                                 f"{run.records[-1].time - run.start:.0f} s from {began}"))
        recoveries = [_number(r.get("seconds")) for r in run.of("recovered")]
        longest = max((s for s in recoveries if s is not None), default=None)
        lines += [
            ("restarts", str(restarts(run))),
            ("recoveries", f"{most_per_node(run.of('recovered'))}"
                           + (f" (the longest {longest:.1f} s)" if longest is not None else "")),
            ("hangs", str(most_per_node(run.of("hang")))),
            ("stragglers", str(sum(1 for r in run.of("straggler") if not r.get("recovered")))),
            ("membership changes", str(most_per_node(run.of("membership")))),
            ("checkpoints saved", str(len(run.of("checkpoint")))),
        ]
    else:
        lines.append(("records", f"none ({RECORDS_DIR}/*.jsonl): only {METRICS_FILE} is drawn"))
    if run.left_out_count:
        s = "s" if run.left_out_count > 1 else ""
        lines.append(("left out", f"{run.left_out_count} records line{s} that cannot be drawn (listed below the events)"))
    return lines


def left_out_list(run: Run) -> str:
    """The records lines left out, as an HTML list (escaped: a line's text is data); "" where none is."""
    if not run.left_out_count:
        return ""
    items = "\n".join(f"<li>{html.escape(line)}</li>" for line in run.left_out)
    more = run.left_out_count - len(run.left_out)
    if more:
        items += f"\n<li>and {more} more</li>"
    return f"\n<h2>Records lines left out</h2>\n<ul>\n{items}\n</ul>"


def events_table(run: Run) -> str:
    """Every record but the progress lines, in time order, as an HTML table (every value escaped)."""
    rows = []
    for record in run.records:
        if record.kind == "progress":
            continue
        when = datetime.fromtimestamp(record.time, timezone.utc).strftime("%H:%M:%S.%f")[:-3]
        rows.append(f"<tr><td class=\"number\">{record.time - run.start:.1f}</td><td>{when}</td>"
                    f"<td>{html.escape(record.node)}</td><td>{html.escape(record.kind)}</td>"
                    f"<td>{html.escape(describe(record))}</td></tr>")
    if not rows:
        return "<p>No events recorded.</p>"
    return ("<table><thead><tr><th>s</th><th>UTC</th><th>node</th><th>event</th><th>what it says</th></tr></thead>"
            "<tbody>\n" + "\n".join(rows) + "\n</tbody></table>")


def render(run: Run) -> str:
    """The whole page: header, figures (plotly.js embedded once, with the first), the events' table."""
    drawn = figures(run)
    parts = []
    for i, (div_id, figure) in enumerate(drawn):
        parts.append(figure.to_html(full_html=False, include_plotlyjs=(i == 0), div_id=div_id,
                                    config={"displaylogo": False, "responsive": True}))
    if not drawn:
        parts.append("<p>Nothing to draw: no progress, events or loss curve.</p>")
    what = (run.metrics or {}).get("example") or run.directory.resolve().name or str(run.directory)
    title = html.escape(f"trainpod report: {_plain(what)}")
    facts = "\n".join(f"<dt>{html.escape(name)}</dt><dd>{html.escape(value)}</dd>" for name, value in header(run))
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{title}</title>\n"
            f"<style>{STYLE}</style>\n</head>\n<body>\n<h1>{title}</h1>\n"
            f"<p class=\"where\">{html.escape(str(run.directory))}</p>\n<dl>\n{facts}\n</dl>\n"
            + "\n".join(parts) + f"\n<h2>Events</h2>\n{events_table(run)}{left_out_list(run)}\n</body>\n</html>\n")


def write(output_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Draw the run in `output_dir` into `out` (default OUTPUT_DIR/report.html), atomically; its path."""
    run = load(output_dir)
    path = Path(out) if out is not None else Path(output_dir) / REPORT_FILE
    named = f"--out {path}" if out is not None else str(path)
    if path.is_dir():
        raise ConfigError(f"trainpod report: {named}: is a directory: expected a file to write the report to")
    if not path.parent.is_dir():  # said before the drawing, which takes a second
        raise ConfigError(f"trainpod report: {named}: no such directory {path.parent}: expected a file in a directory "
                          "that exists")
    page = render(run).encode()
    try:
        atomic.write_bytes_atomic(path, page)
    except OSError as error:
        where = "a file in a directory that exists and can be written" if out is not None else \
            "an output directory this user can write to, or --out FILE elsewhere"
        raise ConfigError(f"trainpod report: {named}: {error.strerror or error}: expected {where}") from None
    return path
