"""Every GPU of the job works, and as fast as its peers: a short check of each node's devices at the rendezvous.

One bad GPU slows or breaks a whole job: a synchronous job runs at the pace of its slowest device, and a GPU
whose memory has an uncorrected error kills its rank some hours in, after a checkpoint's worth of work. Neither
shows in any figure torch gives before the job fails. So each node's agent, after a rendezvous round and before
its ranks start, runs this check on its local GPUs and publishes the result in the round's store; every node reads
everyone's and, from the same data, reaches the same verdict: the nodes it names (`Verdict.ranks`) are bad. What
the job then does is the agent's policy (`--devcheck`); this module measures and judges.

What is measured, per local CUDA device (torch's order, under CUDA_VISIBLE_DEVICES), all devices at once:
- gemm_tflops: fp16 matrix products of GEMM_N x GEMM_N, timed with CUDA events after a warm-up that lets
  the clocks rise (an idle GPU runs slow for its first milliseconds of work);
- memory_gbs: a copy of COPY_BYTES within the device's memory, counted as bytes read plus bytes written,
  as a data sheet counts memory bandwidth; the copy must hold its source's bytes (compared by their sum);
- peer_gbs: where the node has several GPUs, a copy of COPY_BYTES from each to the next (the last to the
  first), bytes sent over the link, one pair at a time; it must arrive intact. These are the links NCCL's
  ring uses within a node;
- health, from NVML (pynvml, the nvidia-ml-py package), each field None where NVML cannot tell:
  ecc_uncorrected, the volatile count of uncorrected memory errors (since the driver loaded or the GPU was
  reset); retired_pending, memory pages waiting for a reset to be retired (GPUs before Ampere);
  remap_pending and remap_failure, the same for row remapping (Ampere and later); xids, the Xid
  errors the driver raised for the device while the check ran.

NVML tells Xids only as events, to a listener registered before they happen: the check registers first
thing, before torch creates a CUDA context, so the window it sees is its own run (context creation and the
work included), seconds; an Xid from before is not seen (its traces are in the ECC and retirement
fields, or in a device that fails the work). Xids 13, 31, 43 and 45 (APPLICATION_XIDS) are a program's
doing, a bad pointer or a killed process, and may come from another process on a shared GPU or from the
ranks just stopped: they are not counted against the device.

What is named (verdict()): a GPU whose GEMM or memory copy is below SLOW_FRACTION of the median of the
job's GPUs of the same model (the name CUDA gives it); a copy to the next GPU below that fraction of the
median of the copies at the same place (same model, same number of GPUs on the node, same index: the
links between GPUs differ by place within a node, PCIe switch or socket, but not between nodes built
alike); an uncorrected ECC error; a page retirement or row remapping pending or failed; an Xid other than
a program's; a work that failed or returned other data; NVML saying the GPU is lost or needs a reset; and a
node whose check did not finish in TIMEOUT_S or was killed by a signal (a GPU that hangs a matrix product hangs
training too; which device is unknown, so the node is named with what the check was doing). A GPU with no
peer of its model is compared with none. A field NVML cannot read is not a finding: it is counted in the
summary.

The work runs in a short-lived child process (run(): main() in a fresh interpreter, which prints one JSON
line; `python -m trainpod.agent.devcheck` by hand), never in the agent: a CUDA context holds memory on its
device until its process ends, and the agent lives as long as the job. A host without CUDA (no torch, a CPU
build, no device visible) checks nothing, and says so in its note; a host whose NVML cannot be used is
measured, and its note says what was not read.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import trainpod
from trainpod.agent import round_gather

SLOW_FRACTION = 0.5  # far below, not noise: a GPU's figures vary by a few percent between runs, a throttled or broken one by 2x or more
APPLICATION_XIDS = frozenset({13, 31, 43, 45})  # NVIDIA's Xid catalog: the application's (or its end's) doing
BUDGET_S = 1.0  # the timed work of all devices together, after torch and CUDA start (which take longer)
TIMEOUT_S = 60.0  # for the child: importing torch and creating the contexts is seconds; past this, something hangs
KEY_PREFIX = "trainpod/devcheck/"  # + the node's rank in the round, in the round's store
WAIT_S = TIMEOUT_S + 30.0  # for the other nodes' results: each may take its whole TIMEOUT_S
GEMM_N = 8192  # 2 * 8192^3 = 1.1 TFLOP a product: long enough to time with events, 384 MiB of fp16 operands
COPY_BYTES = 256 << 20
MIN_STEPS, MAX_STEPS = 3, 200  # timed repetitions per device and figure, chosen from a first timed one
SHOWN = 8  # findings in the verdict's line; more are counted
NOTHING = "nothing checked: "  # a note's start where the node checked no GPU
STEP = "devcheck step:"  # the child's stderr line before each step: what a check that hangs was doing
XID_SETTLE_S = 0.1  # the driver delivers an event a moment after the fault: the check waits this long before reading


@dataclass(frozen=True)
class Device:
    """One local GPU's figures and health. None: not measured, or not readable through NVML."""

    index: int  # torch's (CUDA_VISIBLE_DEVICES order)
    name: str  # the model, as CUDA names it: GPUs are compared with their own model only
    bus: str = ""  # PCI bus id, as nvidia-smi shows it: which GPU of the host this is
    gemm_tflops: float | None = None
    memory_gbs: float | None = None
    peer_gbs: float | None = None  # to device index + 1 (the last to 0); None on a node of one GPU
    ecc_uncorrected: int | None = None
    retired_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    xids: tuple[int, ...] | None = None  # seen while the check ran; None: nobody listened
    faults: tuple[str, ...] = ()  # the work failed or returned other data, or NVML calls the GPU lost


@dataclass(frozen=True)
class NodeDevices:
    """One node's check: its devices, what it could not check (note), and whether the check itself failed."""

    host: str
    devices: tuple[Device, ...] = ()
    note: str = ""  # what was not checked, and why; never a finding
    failed: str = ""  # the check did not finish or crashed: a finding, against the node

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str | bytes) -> NodeDevices:
        data = json.loads(text)
        known = {f.name for f in fields(Device)}  # a newer trainpod's extra fields are left out, not an error
        devices = []
        for entry in data.get("devices", []):
            entry = {key: value for key, value in entry.items() if key in known}
            if entry.get("xids") is not None:
                entry["xids"] = tuple(entry["xids"])
            entry["faults"] = tuple(entry.get("faults", ()))
            devices.append(Device(**entry))
        return NodeDevices(host=str(data.get("host", "")), devices=tuple(devices), note=str(data.get("note", "")),
                           failed=str(data.get("failed", "")))


@dataclass(frozen=True)
class Verdict:
    """The nodes named, and why: `ranks` (in the round) for the policy, `line` to print."""

    ranks: frozenset[int]
    findings: tuple[str, ...]

    @property
    def line(self) -> str:
        more = len(self.findings) - SHOWN
        return "; ".join(self.findings[:SHOWN]) + (f"; and {more} more" if more > 0 else "")


# ---- health, through NVML ----

def bus_id(domain: int, bus: int, device: int) -> str:
    """'00000000:3B:00.0': how NVML and nvidia-smi write a GPU's PCI address (function 0: a GPU's)."""
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}".rstrip(": ")


class Nvml:
    """NVML through pynvml, opened at once with an Xid listener on every GPU it sees. `module` stands in for pynvml
    (the tests' seam). A call that fails makes its field None (not supported, no permission, no library, an old
    pynvml without the function: none of them tells anything about the GPU), except the errors that do:
    FAULT_ERRORS, which become the device's faults."""

    FAULT_ERRORS = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED")

    def __init__(self, module=None):
        self.note = ""
        self.nv = None
        self._handles: dict[str, object] = {}  # bus id -> handle
        self._events: dict[str, object] = {}  # bus id -> its own event set, so an event names its GPU
        self._faults: dict[str, list[str]] = {}
        if module is None:
            try:
                import pynvml as module
            except ImportError:
                self.note = "NVML not read: pynvml (the nvidia-ml-py package) is not installed"
                return
        try:
            module.nvmlInit()
        except Exception as error:  # no driver, no library (a CPU host), a library older than the driver
            self.note = f"NVML not read: {_short(error)}"
            return
        self.nv = module
        for position in range(self._ask("", "nvmlDeviceGetCount") or 0):
            handle = self._ask("", "nvmlDeviceGetHandleByIndex", position)
            pci = self._ask("", "nvmlDeviceGetPciInfo", handle) if handle is not None else None
            if pci is None:
                continue
            key = bus_id(pci.domain, pci.bus, pci.device)
            self._handles[key] = handle
            events = self._ask(key, "nvmlEventSetCreate")
            if events is None:
                continue
            if self._ask(key, "nvmlDeviceRegisterEvents", handle, module.nvmlEventTypeXidCriticalError, events, ok=True) is None:
                self._ask(key, "nvmlEventSetFree", events)
                continue
            self._events[key] = events

    def _ask(self, key: str, name: str, *args, ok: bool = False):
        """NVML's function `name`(*args), or None where it fails (and a fault of the GPU at `key` where the error says
        one); `ok`: the function returns nothing, so True stands for success."""
        try:
            value = getattr(self.nv, name)(*args)
        except Exception as error:
            code = getattr(error, "value", None)
            if key and code in {getattr(self.nv, fault, None) for fault in self.FAULT_ERRORS}:
                self._faults.setdefault(key, []).append(f"NVML: {error}")
            return None
        return True if ok else value

    def count(self) -> int:
        return len(self._handles)

    def health(self, key: str) -> dict:
        """Device's health fields for the GPU at PCI address `key` (all None where NVML does not know it)."""
        nv, handle = self.nv, self._handles.get(key)
        found: dict = {"ecc_uncorrected": None, "retired_pending": None, "remap_pending": None, "remap_failure": None,
                       "xids": None, "faults": ()}
        if nv is None or handle is None:
            return found
        found["ecc_uncorrected"] = self._ask(key, "nvmlDeviceGetTotalEccErrors", handle,
                                             nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
        pending = self._ask(key, "nvmlDeviceGetRetiredPagesPendingStatus", handle)
        found["retired_pending"] = None if pending is None else pending == nv.NVML_FEATURE_ENABLED
        rows = self._ask(key, "nvmlDeviceGetRemappedRows", handle)  # (correctable, uncorrectable, pending, failure)
        if rows is not None:
            found["remap_pending"], found["remap_failure"] = bool(rows[2]), bool(rows[3])
        if key in self._events:
            found["xids"] = self._xids(key)
        found["faults"] = tuple(self._faults.get(key, ()))
        return found

    def _xids(self, key: str) -> tuple[int, ...] | None:
        """The Xids waiting in the GPU's event set (a wait of 0 ms returns one or raises NVML's timeout)."""
        nv, seen = self.nv, []
        while len(seen) < 100:  # a storm of one Xid tells nothing more after the first
            try:
                data = nv.nvmlEventSetWait_v2(self._events[key], 0)
            except Exception as error:
                if getattr(error, "value", None) == nv.NVML_ERROR_TIMEOUT:
                    break
                return tuple(seen) if seen else None
            if data.eventType & nv.nvmlEventTypeXidCriticalError:
                seen.append(int(data.eventData))
        return tuple(seen)

    def close(self) -> None:
        if self.nv is None:
            return
        for events in self._events.values():
            self._ask("", "nvmlEventSetFree", events)
        self._ask("", "nvmlShutdown")
        self.nv = None


# ---- the work, on the devices ----

def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Span:
    """Start and stop marks on a device's current stream: CUDA events; on the CPU (the tests), the clock, torch's
    CPU operations being synchronous."""

    def __init__(self, torch, device):
        self.torch, self.device = torch, device
        self.marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else [0.0, 0.0]

    def mark(self, which: int) -> None:
        if self.device.type == "cuda":
            self.marks[which].record(self.torch.cuda.current_stream(self.device))
        else:
            self.marks[which] = time.perf_counter()

    def seconds(self) -> float:
        """After a sync of the device."""
        if self.device.type == "cuda":
            return self.marks[0].elapsed_time(self.marks[1]) / 1e3
        return self.marks[1] - self.marks[0]


def _per_step(torch, work: Mapping[int, tuple[object, Callable[[], object]]], seconds: float, warm_s: float,
              faults: dict[int, list[str]], what: str) -> dict[int, float]:
    """Seconds per call of each device's step, the devices working at once: steps until warm_s has passed (once at
    least), one timed step to choose how many fill `seconds`, then those, between two marks. A device whose step
    fails is left out, with a fault; the others go on."""
    live = dict(work)

    def each(action: Callable[[int], object]) -> None:
        for key in list(live):
            try:
                action(key)
            except Exception as error:
                faults[key].append(f"{what} failed: {_short(error)}")
                del live[key]

    start = time.monotonic()
    while True:
        each(lambda key: live[key][1]())
        each(lambda key: _sync(torch, live[key][0]))
        if not live or time.monotonic() - start >= warm_s:
            break
    spans = {key: _Span(torch, device) for key, (device, _) in live.items()}
    counts = dict.fromkeys(live, 1)
    took: dict[int, float] = {}

    def timed(key: int) -> None:
        spans[key].mark(0)
        for _ in range(counts[key]):
            live[key][1]()
        spans[key].mark(1)

    for _ in range(2):  # first one step, to size the second
        each(timed)
        each(lambda key: _sync(torch, live[key][0]))
        took.clear()
        each(lambda key: took.__setitem__(key, spans[key].seconds() / counts[key]))
        counts.update({key: min(MAX_STEPS, max(MIN_STEPS, int(seconds / max(t, 1e-9)))) for key, t in took.items()})
    return took


def _intact(torch, source, copy, faults: list[str], what: str) -> bool:
    """Whether a copy holds its source's bytes (their sums: the two may be on different devices); else a fault."""
    try:
        if int(copy.view(torch.int32).sum(dtype=torch.int64)) == int(source.view(torch.int32).sum(dtype=torch.int64)):
            return True
        faults.append(f"{what} returned other data")
    except Exception as error:  # the device failed in the sum: as much a fault
        faults.append(f"{what} failed: {_short(error)}")
    return False


def work(torch, devices: Sequence, budget_s: float = BUDGET_S, gemm_n: int = GEMM_N, copy_bytes: int = COPY_BYTES,
         say: Callable[[str], None] = lambda _: None) -> list[dict]:
    """GEMM, memory copy and copy to the next device on each of `devices` (torch.device; the CPU in the tests):
    per device, its figures and faults. `say` is told each step before it runs (the child's stderr: what a hung
    check was doing)."""
    faults: dict[int, list[str]] = {k: [] for k in range(len(devices))}
    found: list[dict] = [{"gemm_tflops": None, "memory_gbs": None, "peer_gbs": None} for _ in devices]
    buffers: dict[int, tuple] = {}
    say("allocating on every device (creating the CUDA contexts)")
    for k, device in enumerate(devices):
        try:
            a, b = (torch.randn(gemm_n, gemm_n, device=device, dtype=torch.float16) for _ in range(2))
            source = torch.randint(0, 256, (copy_bytes,), dtype=torch.uint8, device=device)
            buffers[k] = (a, b, torch.empty_like(a), source, torch.empty_like(source))
            _sync(torch, device)
        except Exception as error:  # out of memory (another process holds it), or a device that fails at once
            faults[k].append(f"allocating failed: {_short(error)}")

    say("timing the GEMM on every device")
    gemm = {k: (devices[k], lambda a=a, b=b, c=c: torch.matmul(a, b, out=c)) for k, (a, b, c, _, _) in buffers.items()}
    for k, t in _per_step(torch, gemm, budget_s * 0.25, budget_s * 0.3, faults, "GEMM").items():
        found[k]["gemm_tflops"] = 2 * gemm_n**3 / t / 1e12

    say("timing the memory copy on every device")
    copy = {k: (devices[k], lambda s=s, d=d: d.copy_(s)) for k, (_, _, _, s, d) in buffers.items() if not faults[k]}
    for k, t in _per_step(torch, copy, budget_s * 0.15, 0.0, faults, "memory copy").items():
        if _intact(torch, buffers[k][3], buffers[k][4], faults[k], "memory copy"):
            found[k]["memory_gbs"] = 2 * copy_bytes / t / 1e9

    if len(devices) > 1:
        for k in range(len(devices)):  # one pair at a time: the figure is the link's, not shared with other pairs
            j = (k + 1) % len(devices)
            if faults[k] or faults[j] or k not in buffers or j not in buffers:
                continue
            say(f"timing the copy from device {k} to device {j}")
            source, target = buffers[k][3], buffers[j][4]  # j's memory copy target, free now
            pair = {k: (devices[k], lambda s=source, d=target: d.copy_(s))}
            for _, t in _per_step(torch, pair, budget_s * 0.3 / len(devices), 0.0, faults, f"copy to device {j}").items():
                if _intact(torch, source, target, faults[k], f"copy to device {j}"):
                    found[k]["peer_gbs"] = copy_bytes / t / 1e9
    for k, entry in enumerate(found):
        entry["faults"] = tuple(faults[k])
    return found


def measure(budget_s: float = BUDGET_S, nvml_module=None, say: Callable[[str], None] = lambda _: None) -> NodeDevices:
    """This node's check (in the child process: see run()). `nvml_module` stands in for pynvml (the tests)."""
    host = socket.gethostname()
    nvml = Nvml(nvml_module)  # first: Xids from here on are seen
    try:
        try:
            import torch
        except ImportError:
            return NodeDevices(host=host, note=f"{NOTHING}torch is not installed")
        if torch.version.cuda is None:
            return NodeDevices(host=host, note=f"{NOTHING}torch {torch.__version__} is a build without CUDA")
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            seen = f" (NVML sees {nvml.count()}: CUDA_VISIBLE_DEVICES, or a driver older than CUDA {torch.version.cuda}?)"
            return NodeDevices(host=host, note=f"{NOTHING}torch {torch.__version__} sees no CUDA device"
                                                + (seen if nvml.count() else ""))
        devices = [torch.device("cuda", k) for k in range(torch.cuda.device_count())]
        props = [torch.cuda.get_device_properties(d) for d in devices]
        found = work(torch, devices, budget_s, say=say)
        time.sleep(XID_SETTLE_S)
        checked = []
        for k, (p, figures) in enumerate(zip(props, found)):
            key = bus_id(*(getattr(p, f"pci_{part}_id", 0) for part in ("domain", "bus", "device")))  # older torch: no domain
            health = nvml.health(key)
            checked.append(Device(index=k, name=p.name, bus=key, **{**figures, **health,
                                                                    "faults": figures["faults"] + health["faults"]}))
        return NodeDevices(host=host, devices=tuple(checked), note=nvml.note)
    finally:
        nvml.close()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m trainpod.agent.devcheck`: this node's check as one JSON line on stdout; the step in progress on stderr."""
    parser = argparse.ArgumentParser(prog="python -m trainpod.agent.devcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds of timed work, all devices together")
    args = parser.parse_args(argv)

    def say(step: str) -> None:
        print(f"{STEP} {step}", file=sys.stderr, flush=True)

    try:
        result = measure(args.budget, say=say)
    except Exception as error:  # the check's own failure, not a device's (those are caught per device)
        result = NodeDevices(host=socket.gethostname(), note=f"{NOTHING}the check raised {_short(error)}")
    print(result.to_json(), flush=True)
    return 0


def run(timeout_s: float = TIMEOUT_S, budget_s: float = BUDGET_S) -> NodeDevices:
    """measure() in a child process, bounded by timeout_s. A child that does not finish is killed and its node
    is `failed` (a GPU that hangs the check would hang training), with the step it was in; so is one killed by a
    signal (a segfault in the driver) or whose result cannot be read. One that exits with Python's error checked
    nothing (a note)."""
    host = socket.gethostname()
    # The child imports this trainpod, wherever the agent found it, and none of the working directory's files (a
    # json.py of the job's would shadow the standard library's): `python -m` would put the working directory first.
    root = str(Path(trainpod.__file__).resolve().parent.parent)
    code = (f"import sys; sys.path[:1] = [] if {root!r} in sys.path[1:] else [{root!r}]; "
            "from trainpod.agent.devcheck import main; sys.exit(main(sys.argv[1:]))")
    command = [sys.executable, "-c", code, "--budget", f"{budget_s:g}"]
    try:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
    except OSError as error:
        return NodeDevices(host=host, note=f"{NOTHING}the check could not start: {_short(error)}")
    try:
        out, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        try:  # a process stuck in the driver may not die at once: its output is not worth waiting for
            out, err = child.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        steps = [line for line in (err or "").splitlines() if line.startswith(STEP)]
        return NodeDevices(host=host, failed=f"the device check did not finish in {timeout_s:g} s"
                                             + (f" ({steps[-1][len(STEP):].strip()})" if steps else ""))
    line = _last(out)
    if child.returncode == 0 and line.startswith("{"):
        try:
            return NodeDevices.from_json(line)
        except (ValueError, TypeError, KeyError) as error:
            return NodeDevices(host=host, failed=f"the device check printed no result it could read: {_short(error)}")
    said = _last(err)[:200] or "no output"
    if child.returncode < 0:  # a signal: the driver's segfault or abort
        return NodeDevices(host=host, failed=f"the device check was killed by signal {-child.returncode}: {said}")
    # Python's own error (an import that fails): the check's failure, not a device's (those are caught per device)
    return NodeDevices(host=host, note=f"{NOTHING}the check exited with {child.returncode}: {said}")


def _last(text: str) -> str:
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


# ---- the verdict, over every node ----

FIGURES = (("gemm_tflops", "GEMM", "TFLOP/s"), ("memory_gbs", "memory copy", "GB/s"), ("peer_gbs", "copy to the next GPU", "GB/s"))


def _name(rank: int, node: NodeDevices) -> str:
    return f"{rank} ({node.host})" if node.host else str(rank)


def _who(rank: int, node: NodeDevices) -> str:
    return f"node {_name(rank, node)}"


def _place(attr: str, node: NodeDevices, device: Device) -> tuple:
    """What a figure is compared with: the same model; for a copy to the next GPU, also the same place in a node alike."""
    return (device.name, len(node.devices), device.index) if attr == "peer_gbs" else (device.name,)


def _figure(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _peers(by_node: Mapping[int, NodeDevices]) -> dict[tuple, list[float]]:
    peers: dict[tuple, list[float]] = {}
    for node in by_node.values():
        for device in node.devices:
            for attr, _, _ in FIGURES:
                value = getattr(device, attr)
                if value is not None:
                    peers.setdefault((attr, *_place(attr, node, device)), []).append(value)
    return peers


def _findings(node: NodeDevices, device: Device, peers: Mapping[tuple, list[float]], slow_fraction: float) -> list[str]:
    what = list(device.faults)
    for attr, label, unit in FIGURES:
        value, others = getattr(device, attr), peers.get((attr, *_place(attr, node, device)), [])
        if value is None or len(others) < 2:
            continue
        median = statistics.median(others)
        if value < slow_fraction * median:
            among = (f"the job's {len(others)} GPUs of this model" if attr != "peer_gbs" else
                     f"the {len(others)} at this place on nodes of {len(node.devices)} such GPUs")
            what.append(f"{label} {_figure(value)} {unit}, below {slow_fraction:g} x the median {_figure(median)} of {among}")
    if device.ecc_uncorrected:
        what.append(f"{device.ecc_uncorrected} uncorrected ECC error(s) since the driver loaded or the GPU was reset")
    if device.retired_pending:
        what.append("memory pages wait for a reset to be retired")
    if device.remap_failure:
        what.append("a row remapping failed")
    elif device.remap_pending:
        what.append("a row remapping waits for a reset")
    hardware = [xid for xid in device.xids or () if xid not in APPLICATION_XIDS]
    if hardware:
        what.append("Xid " + ", ".join(str(x) for x in sorted(set(hardware))) + " during the check")
    return what


def verdict(by_node: Mapping[int, NodeDevices], slow_fraction: float = SLOW_FRACTION) -> Verdict | None:
    """None when no node has a finding; else the nodes named (by rank in the round) and one finding per GPU (and
    per node whose check failed), in rank order: every node computes the same from the same results."""
    peers = _peers(by_node)
    ranks: set[int] = set()
    findings: list[str] = []
    for rank in sorted(by_node):
        node = by_node[rank]
        if node.failed:
            ranks.add(rank)
            findings.append(f"{_who(rank, node)}: {node.failed}")
        for device in node.devices:
            what = _findings(node, device, peers, slow_fraction)
            if what:
                ranks.add(rank)
                where = f"{device.name}, {device.bus}" if device.bus else device.name
                findings.append(f"{_who(rank, node)} GPU {device.index} ({where}): " + ", ".join(what))
    return Verdict(ranks=frozenset(ranks), findings=tuple(findings)) if findings else None


def _nodes(ranks: Sequence[int], by_node: Mapping[int, NodeDevices]) -> str:
    return ("node " if len(ranks) == 1 else "nodes ") + ", ".join(_name(r, by_node[r]) for r in sorted(ranks))


def summary(by_node: Mapping[int, NodeDevices]) -> str:
    """The job's figures in one line, per model (the range over its GPUs), with what was not checked where."""
    models: dict[str, list[Device]] = {}
    for node in by_node.values():
        for device in node.devices:
            models.setdefault(device.name, []).append(device)
    total = sum(len(found) for found in models.values())
    parts = []
    for name, found in sorted(models.items()):
        ranges = []
        for attr, label, unit in FIGURES:
            values = [v for v in (getattr(d, attr) for d in found) if v is not None]
            if values:
                low, high = _figure(min(values)), _figure(max(values))
                ranges.append(f"{label} {low}{'' if low == high else '-' + high} {unit}")
        parts.append(f"{name} x{len(found)}: " + ", ".join(ranges or ["no figure"]))
    devices = [d for found in models.values() for d in found]
    unread = {"ECC": sum(d.ecc_uncorrected is None for d in devices), "Xids": sum(d.xids is None for d in devices),
              "memory retirement": sum(d.retired_pending is None and d.remap_pending is None for d in devices)}
    if any(unread.values()):
        parts.append("not read: " + ", ".join(f"{what} on {n} GPU(s)" for what, n in unread.items() if n))
    notes: dict[str, list[int]] = {}
    for rank, node in by_node.items():
        if node.note:
            notes.setdefault(node.note, []).append(rank)
    for note, ranks in sorted(notes.items(), key=lambda item: min(item[1])):
        note = note if total or not note.startswith(NOTHING) else note[len(NOTHING):]  # said once, by the head
        parts.append(f"{note} on {_nodes(ranks, by_node)}")
    head = f"{total} GPU(s) on {len(by_node)} node(s) checked" if total else "no GPU checked"
    return f"{head}: " + "; ".join(parts) if parts else head


def exchange(store, rank: int, world: int, mine: NodeDevices, wait_s: float = WAIT_S) -> dict[int, NodeDevices]:
    """Publish this node's result in the round's store and read every node's (torch's Store API)."""
    found = round_gather.all_gather(store, KEY_PREFIX, rank, world, mine.to_json(), wait_s)
    return {other: NodeDevices.from_json(text) for other, text in found.items()}


if __name__ == "__main__":
    sys.exit(main())
