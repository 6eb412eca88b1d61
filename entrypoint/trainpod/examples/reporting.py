"""What a training example reports: progress on rank 0, a weight checksum, metrics as JSON.

Shared by the examples so that every one of them prints and writes the same shapes, and tools
(the benchmarks, the tests) read them one way: `metrics.json` in the output directory, and one
short stdout line `trainpod-metrics: {...}` (summary(): the main figures and where the file is)
for callers that see only the log.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from trainpod.atomic import write_bytes_atomic

METRICS_FILE = "metrics.json"
METRICS_PREFIX = "trainpod-metrics: "

_IMPORTED_AT = time.time()


def process_start_time() -> float:
    """When this process started, as a time.time() value.

    Read from /proc so that interpreter start-up and `import torch` count in "time to first
    step"; where /proc is missing, the time this module was imported.
    """
    try:
        with open("/proc/self/stat") as f:
            # The command name (field 2) may hold spaces: split after its closing parenthesis.
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22, starttime, in clock ticks after boot
        with open("/proc/stat") as f:
            boot_time = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot_time + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


def state_dict_checksum(state_dict: Mapping[str, Any]) -> str:
    """sha256 hex of a state_dict's tensors: in sorted key order, each as key, dtype, shape, raw bytes.

    The names, dtypes and shapes go in too, so that two different models cannot share a checksum
    by having the same bytes. Tensors are copied to the CPU; non-tensor entries are skipped.
    """
    import torch

    h = hashlib.sha256()
    for key in sorted(state_dict):
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            continue
        t = value.detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        # Through uint8 because numpy has no bfloat16; reshape because 0-d tensors cannot change dtype size.
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Write obj as JSON so that readers see the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_bytes_atomic(path, (json.dumps(obj, indent=2) + "\n").encode())


# What the log line carries: enough to read a run at a glance and to time it from outside (bench/);
# the loss curve and every rank's checksum stay in metrics.json.
SUMMARY_KEYS = ("example", "dataset", "precision", "world_size", "nnodes", "steps", "final_loss", "test_accuracy",
                "samples_per_sec", "first_step_unix", "checksum", "exactly_once")


def summary(metrics: Mapping[str, Any], path: str | os.PathLike) -> dict[str, Any]:
    """The short form of `metrics` for the log: a few figures, whether the ranks agree, and the file."""
    short = {key: metrics[key] for key in SUMMARY_KEYS if key in metrics}
    for key in ("final_loss", "test_accuracy", "samples_per_sec"):
        if isinstance(short.get(key), float):
            short[key] = round(short[key], 4)
    if "rank_checksums" in metrics:
        short["ranks_agree"] = len(set(metrics["rank_checksums"])) == 1
    short["metrics"] = str(Path(path).absolute())
    return short


def metrics_line(metrics: Mapping[str, Any]) -> str:
    """The one stdout line that carries (the summary of) the metrics (json.dumps never emits a newline)."""
    return METRICS_PREFIX + json.dumps(metrics)


def parse_metrics_line(text: str) -> dict | None:
    """The metrics from the last `trainpod-metrics:` line of a log, or None.

    The marker may follow a prefix: `trainpod run` starts every rank's line with `[nodeN rankR] `.
    """
    found = None
    for line in text.splitlines():
        if METRICS_PREFIX in line:
            found = line.split(METRICS_PREFIX, 1)[1]
    return json.loads(found) if found is not None else None


class Throughput:
    """Samples per second, leaving out the first `warmup_steps` steps (allocation, first batches)."""

    def __init__(self, warmup_steps: int = 5, clock=time.perf_counter):
        self.warmup_steps = warmup_steps
        self._clock = clock
        self._start = clock()
        self.steps = 0
        self.samples = 0
        self._steady_start: float | None = self._start if warmup_steps <= 0 else None
        self._steady_samples = 0
        self._window_start = self._start
        self._window_samples = 0
        self._last = self._start

    def step(self, samples: int) -> None:
        """Count one completed step of `samples` samples."""
        now = self._clock()
        self.steps += 1
        self.samples += samples
        self._window_samples += samples
        self._last = now
        if self._steady_start is not None:
            self._steady_samples += samples
        elif self.steps == self.warmup_steps:
            self._steady_start = now

    def overall(self) -> float:
        """Steady-state samples/s so far; over all steps if there were too few to leave warm-up out."""
        if self._steady_start is not None and self._steady_samples and self._last > self._steady_start:
            return self._steady_samples / (self._last - self._steady_start)
        return self.samples / (self._last - self._start) if self._last > self._start else 0.0

    def window(self) -> float:
        """Samples/s since the previous call (or the start); starts the next window."""
        now = self._clock()
        rate = self._window_samples / (now - self._window_start) if now > self._window_start else 0.0
        self._window_start, self._window_samples = now, 0
        return rate


def want_progress_bar(stream: IO[str] | None = None, env: Mapping[str, str] | None = None) -> bool:
    """A bar on a terminal (or when TRAINPOD_PROGRESS=bar), periodic lines in logs (or =lines)."""
    env = os.environ if env is None else env
    stream = sys.stdout if stream is None else stream
    choice = env.get("TRAINPOD_PROGRESS", "").strip().lower()
    if choice in ("bar", "lines"):
        return choice == "bar"
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """Rank 0's progress: one redrawn line on a terminal, or a log line at each log point.

    Create it on every rank with enabled=(rank == 0): the other ranks then print nothing.
    """

    def __init__(
        self,
        total_steps: int,
        epochs: int,
        *,
        bar: bool | None = None,
        enabled: bool = True,
        stream: IO[str] | None = None,
        width: int = 30,
        min_interval_s: float = 0.1,
        clock=time.monotonic,
    ):
        self.stream = sys.stdout if stream is None else stream
        self.bar = want_progress_bar(self.stream) if bar is None else bar
        self.total_steps = total_steps
        self.epochs = epochs
        self.enabled = enabled
        self.width = width
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._last_draw = None
        self._drawn_len = 0

    def update(self, epoch: int, step: int, loss: float | None, samples_per_sec: float, log_point: bool) -> None:
        """Call after every step; `epoch` and `step` count from 1, `step` over the whole run."""
        if not self.enabled:
            return
        text = f"epoch {epoch}/{self.epochs} step {step}/{self.total_steps}"
        if loss is not None:
            text += f" loss {loss:.4f}"
        text += f" {samples_per_sec:.1f} samples/s"
        if not self.bar:
            if log_point:
                self._write(text + "\n")
            return
        now = self._clock()
        # Redrawing at every step floods slow terminals (and log collectors that see a pty).
        if step < self.total_steps and self._last_draw is not None and now - self._last_draw < self.min_interval_s:
            return
        self._last_draw = now
        filled = int(self.width * min(step, self.total_steps) / max(self.total_steps, 1))
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {text}"
        # Pad to the previous length so that a shorter line leaves no tail of the longer one.
        self._write("\r" + line.ljust(self._drawn_len))
        self._drawn_len = len(line)

    def print(self, text: str) -> None:
        """A line of its own, ending the bar's line first."""
        if self.enabled:
            self.close()
            self._write(text + "\n")

    def close(self) -> None:
        """End the bar's line so that what follows starts on a line of its own."""
        if self.enabled and self._drawn_len:
            self._write("\n")
            self._drawn_len = 0

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
