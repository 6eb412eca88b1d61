"""Each rank's progress, as its agent sees it: the last step it finished and the last one committed.

    import trainpod.train.progress
    for step in ...:
        train_one_step()
        trainpod.train.progress.step(step)          # one call per step, any script

The bundled examples call it, and so does trainpod.train.checkpoint when a checkpoint is committed
(`committed(step)`), so scripts that use trainpod's checkpoints report without this call. The
agent reads it to tell a stuck job from a slow one, and a restart after progress from a crash loop.
trainpod.train.distributed.shutdown() reports `finished()` once every rank reached it: the job's
training is over, so the agent no longer restarts the group for a node that arrives to join it
(trainpod.agent.policy).

    trainpod.train.progress.measure(ddp_model)   # once, after wrapping the model: each step's own work

In a synchronous job every rank's step lasts as long as the slowest rank's, so step times cannot
name a straggler. `measure` times what a rank spends on its own work in each step: from the end of
the previous step to the moment its last gradient is computed, before it waits for the others'
(a hook on each parameter: PyTorch's post-accumulate-grad hook; CUDA events where the gradients
are on a GPU, whose work runs behind the CPU). `step()` reports it (`Record.busy`), and the
agent's straggler watch compares the ranks (trainpod.agent.stragglers). Without it `busy` is 0 and
no rank is judged.

How: torchrun's launch plan sets TRAINPOD_PROGRESS_DIR; each rank overwrites one fixed-width
line in `<dir>/rank<LOCAL_RANK>` (one pwrite, no fsync: only processes on this node read it, and
a lost update after a crash of the host does not matter). Without the variable (a script run
outside trainpod) every call is a no-op.

A rank that reports also helps the agent read its stack when the agent hangs on it
(trainpod.agent.hang): where Yama restricts ptrace to ancestors it names the agent as its tracer
(prctl PR_SET_PTRACER), and a daemon thread answers dump requests on `<dir>/rank<LOCAL_RANK>.dump`
(a FIFO) with faulthandler's dump of every thread and torch's flight recorder, no ptrace needed
(trainpod.agent.stacks). The thread sleeps in open() until a request comes.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from trainpod.contract import AGENT_PID_VAR, PROGRESS_DIR_VAR

__all__ = ["Record", "committed", "encode", "finished", "measure", "read", "step"]

PR_SET_PTRACER = 0x59616D61
YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
# Fixed width: an overwrite never leaves a tail.
_FORMAT = "{step:20d} {committed:20d} {time:20.3f} {finished:1d} {busy:14.6f} {samples:20d} {save:14.6f} {stall:14.6f}\n"
_RECORD_BYTES = len(_FORMAT.format(step=0, committed=0, time=0.0, finished=0, busy=0.0, samples=0, save=0.0, stall=0.0))
_SECONDS_MAX = 9_999_999.0  # what a field of 14 characters holds with 6 decimals


@dataclass(frozen=True)
class Record:
    step: int  # the last step this rank finished (-1: none reported yet)
    committed: int  # the last step whose checkpoint was committed (-1: none)
    time: float  # time.time() of the last report
    finished: bool = False  # the script's training is over on every rank (finished()); it is tearing down
    busy: float = 0.0  # seconds of this rank's own work in its last step (measure()); 0: not measured
    samples: int = 0  # samples this process trained on so far, where the script says (step(n, samples=...))
    save: float = 0.0  # seconds from the last committed checkpoint's save() to its commit (committed()); 0: none
    stall: float = 0.0  # seconds that save() held the training loop (the previous write, the copy); 0: none


def encode(record: Record) -> bytes:
    """The record as its rank writes it: one fixed-width line (read() reads it back)."""
    return _FORMAT.format(step=record.step, committed=record.committed, time=record.time, finished=record.finished,
                          busy=min(record.busy, _SECONDS_MAX), samples=record.samples, save=min(record.save, _SECONDS_MAX),
                          stall=min(record.stall, _SECONDS_MAX)).encode()


class _Reporter:
    def __init__(self) -> None:
        self._fd: int | None = None
        self._pid: int | None = None
        self.step = -1
        self.committed = -1
        self.finished = False
        self.busy = 0.0
        self.samples = 0
        self.save = 0.0
        self.stall = 0.0

    def report(self) -> None:
        if self._pid != os.getpid():  # first call, or a forked child (a DataLoader worker): its own state
            self._open()
        if self._fd is not None:
            record = Record(self.step, self.committed, time.time(), self.finished, self.busy, self.samples, self.save,
                            self.stall)
            os.pwrite(self._fd, encode(record), 0)

    def _open(self) -> None:
        self._pid = os.getpid()
        self._fd = None
        directory = os.environ.get(PROGRESS_DIR_VAR)
        if not directory:
            return
        local_rank = os.environ.get("LOCAL_RANK", "0")
        try:
            self._fd = os.open(Path(directory) / f"rank{local_rank}", os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError:
            self._fd = None  # progress is advisory: training must not fail for it
            return
        allow_agent_to_trace()
        fifo = Path(directory) / f"rank{local_rank}.dump"
        threading.Thread(target=_serve_dumps, args=(fifo,), name="trainpod-progress-dumps", daemon=True).start()


def allow_agent_to_trace(scope_file: str = YAMA_SCOPE) -> bool:
    """Where Yama allows ptrace only of descendants (ptrace_scope 1), name the agent as this
    process's tracer, so that its py-spy (the agent's child) may read this rank's stack."""
    agent = os.environ.get(AGENT_PID_VAR, "")
    try:
        with open(scope_file) as f:
            scope = f.read().strip()
    except OSError:
        return False  # no Yama: the same uid is enough
    if scope != "1" or not agent.isdigit():
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, int(agent), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _serve_dumps(fifo: Path) -> None:
    """Answer the agent's dump requests (trainpod.agent.stacks.request) until the process ends."""
    try:
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo, 0o600)
    except OSError:
        return
    while True:
        try:
            with open(fifo, "rb") as f:  # blocks, without the GIL, until the agent opens it
                text = f.read()
        except OSError:
            return
        try:
            dump(json.loads(text or b"{}"))
        except Exception as exc:  # a dump must never take the rank down
            print(f"trainpod: rank {os.environ.get('RANK', '?')}: dump request failed: {exc}", file=sys.stderr, flush=True)


def dump(what: dict) -> None:
    """Write what the request asks for: `stack` (faulthandler, every thread, with a first line naming
    the main thread) and `flight_recorder` (torch's, as its fr_trace analyser reads it)."""
    if what.get("stack"):
        path = Path(what["stack"])
        with open(path.with_suffix(".tmp"), "w") as f:
            f.write(f"main thread 0x{threading.main_thread().ident:016x}\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        os.replace(path.with_suffix(".tmp"), path)
    buffer = os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")).strip()
    if what.get("flight_recorder") and "torch.distributed" in sys.modules and buffer != "0":
        from torch._C._distributed_c10d import _dump_fr_trace

        path = Path(what["flight_recorder"])
        path.parent.mkdir(parents=True, exist_ok=True)
        # Without the collectives' stack traces: symbolising them imports torch._dynamo (seconds);
        # the agent reads the stacks itself.
        path.with_suffix(".tmp").write_bytes(_dump_fr_trace(includeStackTraces=False))
        os.replace(path.with_suffix(".tmp"), path)


class _Compute:
    """When this rank's last gradient of the step was computed: a post-accumulate-grad hook on every parameter.
    The last hook of a step marks the end of the rank's own work; what follows is waiting for the others."""

    def __init__(self) -> None:
        self.handles: list = []
        self.began = 0.0  # time.perf_counter() at the end of the previous step
        self.ready = 0.0  # ... when the last gradient so far was computed (CPU)
        self.began_event = None  # CUDA: the same two points, as events on the gradients' stream
        self.ready_event = None
        self.stream = None
        self.last = 0.0  # the last measured step's seconds (CUDA: kept while the newest is still running)

    def watch(self, model) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for p in model.parameters() if p.requires_grad]
        self.began, self.ready, self.last = time.perf_counter(), 0.0, 0.0
        self.began_event = self.ready_event = self.stream = None
        cuda = next((p.device for p in model.parameters() if p.is_cuda), None)
        if cuda is not None:
            import torch

            self.began_event = torch.cuda.Event(enable_timing=True)
            self.ready_event = torch.cuda.Event(enable_timing=True)
            self.stream = torch.cuda.current_stream(cuda)
            self.began_event.record(self.stream)

    def _ready(self, param) -> None:
        # Autograd's thread; runs once per parameter per step, so it does as little as it can.
        if self.ready_event is not None:
            self.ready_event.record()  # the last record of the step wins: the stream's position after its last gradient
        else:
            self.ready = time.perf_counter()

    def take(self) -> float:
        """Seconds of the step just ended (0.0 before measure()); the start of the next one."""
        if not self.handles:
            return 0.0
        if self.ready_event is not None:
            # The GPU may still be on this step: read a finished one, never wait for it (that would cost the step).
            if self.ready_event.query() and self.began_event.query():
                self.last = max(self.began_event.elapsed_time(self.ready_event) / 1000.0, 0.0)
            self.began_event.record(self.stream)
            return self.last
        now = time.perf_counter()
        if self.ready > self.began:  # a gradient was computed this step (not so in a step skipped before backward)
            self.last = self.ready - self.began
        self.began = now
        return self.last


_reporter = _Reporter()
_compute = _Compute()


def step(n: int, samples: int | None = None) -> None:
    """This rank finished step `n`. Cheap (one pwrite); call it after every step, on every rank. `samples`: how many
    samples this step trained on in this process (its batch), for the node's metrics (trainpod_samples_total)."""
    _reporter.step = int(n)
    if samples is not None:
        _reporter.samples += int(samples)
    _reporter.busy = _compute.take()
    _reporter.report()


def measure(model) -> None:
    """Report this rank's own work per step with each step() (the DDP model, or the module it wraps), so the agent can
    name a rank slower than the others (trainpod.agent.stragglers). Call once after the model is built; calling it
    again (a new model) replaces the hooks. Costs a Python call per parameter per step."""
    _compute.watch(model)


def committed(n: int, save_seconds: float | None = None, stall_seconds: float | None = None) -> None:
    """The checkpoint of step `n` is committed (durable). trainpod.train.checkpoint calls it for you, with how long
    its save took to commit (`save_seconds`, in the background) and held the training loop (`stall_seconds`), for
    the node's metrics (trainpod_checkpoint_save_seconds, trainpod_checkpoint_stall_seconds)."""
    _reporter.committed = int(n)
    if save_seconds is not None:
        _reporter.save = max(0.0, float(save_seconds))
    if stall_seconds is not None:
        _reporter.stall = max(0.0, float(stall_seconds))
    _reporter.report()


def finished() -> None:
    """Every rank of the group is past its last collective (trainpod.train.distributed.shutdown() calls it after its
    barrier): the group ends on its own, so the agent does not restart it for a node that arrives now."""
    _reporter.finished = True
    _reporter.report()


def read(directory: str | os.PathLike) -> dict[int, Record]:
    """Local rank -> its last report, for every rank that reported (the agent's side)."""
    records: dict[int, Record] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return records
    for name in names:
        if not (name.startswith("rank") and name[4:].isdigit()):
            continue
        try:
            with open(Path(directory) / name, "rb") as f:
                fields = f.read(_RECORD_BYTES).split()
            busy = float(fields[4]) if len(fields) > 4 else 0.0  # a record of an older trainpod has none
            samples = int(fields[5]) if len(fields) > 5 else 0
            save, stall = (float(fields[6]), float(fields[7])) if len(fields) > 7 else (0.0, 0.0)
            records[int(name[4:])] = Record(int(fields[0]), int(fields[1]), float(fields[2]), fields[3:4] == [b"1"], busy,
                                            samples, save, stall)
        except (OSError, ValueError, IndexError):
            continue  # being written for the first time: read it at the next look
    return records
