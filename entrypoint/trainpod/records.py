"""The run's records: what each node's agent saw happen, on one time axis, for `trainpod report`.

    <output>/records/<host>.jsonl        one file per node (its host name), one JSON object per line

Each node's agent (trainpod.agent.metrics' Recorder) appends a line when something happens and, while
the ranks train, once a second for each local rank that advanced; `trainpod report OUTPUT_DIR`
(trainpod.launcher.report) reads every node's file back and draws the run. A file per node: nodes that
share the output directory (a volume, NFS) never append to one file, where appends from two hosts may
interleave. Every line is `{"time": <unix seconds>, "node": <host>, "kind": <KIND>, ...its fields}`:

    started      a worker group started: world (ranks), nodes, ranks (this node's global ranks)
    failed       the group failed: cause ("failure" or "hang"), restarting (true: the agent restarts it)
    recovered    the first step after a failure: seconds (from the failure), step
    membership   a rendezvous round met with other nodes: nodes, before (their numbers), new (where as many met:
                 the nodes that took the place of those that left, spares)
    hang         the hang watch named a hang: ranks (those behind), stalled_s (how long), limit_s (its bound)
    straggler    a rank of this node paces the job: rank, own_s, others_s (its own work and the others', per
                 step); `"recovered": true` when it keeps pace again
    progress     a rank advanced: rank, step, samples (so far, where the script reports them), own_s (its own
                 work in its last step, 0 where not measured), step_s (seconds per step since the last line)
    checkpoint   a rank committed a checkpoint it saved: rank, step, save_s (save() to commit), stall_s (how long
                 save() held the training loop)

Writing never fails the job: an unwritable directory loses the records (the agent says so once), never the
run. A reader (scan) takes every line that is a record, and says which are none (the report lists them),
but for a line cut by a kill and another version's kind, which it passes over without a word.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainpod.contract import RECORDS_DIR

KINDS = ("started", "failed", "recovered", "membership", "hang", "straggler", "progress", "checkpoint")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class Record:
    time: float  # unix seconds
    node: str  # the host name of the node whose agent wrote it
    kind: str  # one of KINDS
    fields: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


def node_file(output_dir: str | os.PathLike, host: str | None = None) -> Path:
    """This node's records file under `output_dir` (its host name, made safe for a file name)."""
    name = _UNSAFE.sub("_", host or socket.gethostname()) or "node"
    return Path(output_dir) / RECORDS_DIR / f"{name}.jsonl"


class Writer:
    """Appends this node's records; after the first failure to write it writes nothing more (one warning)."""

    def __init__(self, output_dir: str | os.PathLike, say=None, host: str | None = None):
        self.path = node_file(output_dir, host)
        self.node = host or socket.gethostname()
        self._say = say
        self._broken = False

    def write(self, kind: str, at: float, **fields: Any) -> bool:
        if self._broken:
            return False
        line = json.dumps(_finite({"time": round(at, 3), "node": self.node, "kind": kind, **fields}), allow_nan=False)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # One write per line, O_APPEND: a line is whole or absent, whoever else appends on this host.
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
            return True
        except OSError as error:
            self._broken = True
            if self._say is not None:
                self._say(f"warning: {self.path}: {getattr(error, 'strerror', None) or error}: the run's records stop "
                          "here (trainpod report draws what was written)")
            return False


def _finite(value: Any) -> Any:
    """`value` with each NaN or infinity made null: JSON has no word for them (a loss that diverged)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


# A records line, in the words of a reader's messages.
LINE = '{"time": <unix seconds>, "node": <host>, "kind": <kind>, ...}'


@dataclass
class Scan:
    """What a records directory holds: the records, in time order, and the lines that are none (FILE, LINE
    number, why), but for a last line cut short (its node stopped while writing it) and another version's kind."""

    directory: Path  # OUTPUT/records
    files: list[Path] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    left_out: list[tuple[Path, int, str]] = field(default_factory=list)


def read(output_dir: str | os.PathLike) -> list[Record]:
    """Every node's records under `output_dir`, in time order ([] where there are none, or none can be read)."""
    try:
        return scan(output_dir).records
    except OSError:
        return []


def scan(output_dir: str | os.PathLike) -> Scan:
    """Every node's records under `output_dir` and what could not be taken; OSError (with its path) where the
    directory or a file of it cannot be read. A missing directory, or a file gone once listed, is no error."""
    found = Scan(Path(output_dir) / RECORDS_DIR)
    try:
        with os.scandir(found.directory) as entries:
            names = sorted(entry.name for entry in entries if entry.name.endswith(".jsonl"))
    except FileNotFoundError:
        names = []
    for name in names:
        path = found.directory / name
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except FileNotFoundError:
            continue
        found.files.append(path)
        lines = text.split("\n")
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            record, why = parse(line)
            if record is not None:
                found.records.append(record)
            elif why is not None and not (number == len(lines) and why.startswith("not JSON")):
                found.left_out.append((path, number, why))  # (a last line without its newline: cut by a kill)
    found.records.sort(key=lambda record: record.time)
    return found


def parse(line: str) -> tuple[Record | None, str | None]:
    """(the record on this line, None), (None, why it is none), or (None, None) for a kind this version does not
    know. Its time must be a date: NaN, an infinity or 1e20 would break every reader's time axis."""
    try:
        item = json.loads(line)
    except ValueError:
        return None, f"not JSON: expected a run record {LINE}"
    if not isinstance(item, dict):
        return None, f"a JSON {_json_type(item)}, not an object: expected a run record {LINE}"
    for name in ("time", "node", "kind"):
        if name not in item:
            return None, f'no "{name}": expected a run record {LINE}'
    time, node, kind = item.pop("time"), str(item.pop("node")), str(item.pop("kind"))
    if kind not in KINDS:
        return None, None
    try:
        time = float(time)
        datetime.fromtimestamp(time, timezone.utc)
    except (TypeError, ValueError, OverflowError, OSError):
        return None, f'"time" {_shown(time)}: expected unix seconds, a finite number (a date from year 1 to 9999)'
    return Record(time, node, kind, item), None


def _json_type(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")


def _shown(value: Any) -> str:
    """A value as the JSON it came from, shortened."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
