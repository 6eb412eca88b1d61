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
run. A reader skips what it cannot parse (a line cut by a kill, another version's kind it does not know).
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
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


def read(output_dir: str | os.PathLike) -> list[Record]:
    """Every node's records under `output_dir`, in time order ([] where there are none)."""
    return sorted(_read(Path(output_dir) / RECORDS_DIR), key=lambda record: record.time)


def _read(directory: Path) -> Iterator[Record]:
    try:
        paths = sorted(directory.glob("*.jsonl"))
    except OSError:
        return
    for path in paths:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            try:
                item = json.loads(line)
                time, node, kind = float(item.pop("time")), str(item.pop("node")), str(item.pop("kind"))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a line cut by a kill, or not a record
            if kind in KINDS:
                yield Record(time, node, kind, item)
