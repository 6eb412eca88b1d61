"""The hang watch's costs (run by bench/run.py): how soon a hang is reported, and what the progress signal costs.

1. Time from the hang's start to the one-line report, `trainpod run --hang-timeout T` on this host
   (2 processes, no Docker), for each case: a rank asleep before init_process_group and a skipped
   collective (tests/integration/hangs/hang_job.py, which prints when its hang starts), and a SIGSTOP
   of one rank of the CIFAR-10 example (timed from the signal). Goal: T + 5 s or better. And the same SIGSTOP
   under --hang-timeout 120 (sigstop-paced): the example reports its steps, so the job's pace bounds it
   (trainpod.agent.hang.limit). Goal: 10 s or better.
2. The progress signal's cost on steady samples/s, side by side in one run: a 2-rank DDP job (gloo,
   a small CNN on 32x32 images, batches of 64) under bare torchrun alternates blocks of 5 steps
   with trainpod.train.progress.step() after every step and blocks without it; the median over adjacent
   pairs of the ratio of their times (adjacent blocks see the same machine load, which on a shared
   host swings samples/s by tens of percent between runs). Also the cost of one progress.step()
   call against a step.
   Goal: within 1 %.
3. The whole watch (the agent sampling /proc every second, py-spy for idle ranks only): the agent's own
   CPU seconds per second of the CIFAR-10 example under `trainpod run --hang-timeout 120` against
   `--hang-timeout 0`, and the samples/s of those runs (alternating, medians).

    python3 bench/hangs.py [--rounds N] [--timeout T]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import results_page

HERE = Path(__file__).resolve().parent
ENTRYPOINT = HERE.parent / "entrypoint"
sys.path.insert(0, str(HERE.parent / "tests"))

from fixtures.ports import free_port  # noqa: E402

HANG_JOB = HERE.parent / "tests" / "integration" / "hangs" / "hang_job.py"
TIMEOUT_S = 10
MARK = re.compile(r"hang-job: rank \d+ hang starts.* at ([0-9.]+)")
HANG_LINE = re.compile(r"\] trainpod: hang: ")
PACED, PACED_TIMEOUT_S = "sigstop-paced", 120.0  # the SIGSTOP case at the default --hang-timeout: the pace bounds it
# The overhead runs: enough steps that the warm-up and the launch drop out of samples/s.
EXAMPLE = ["--epochs", "100", "--max-steps", "200", "--synthetic-samples", "8192", "--batch-size", "64", "--log-every", "50"]
STOP_ARGS = ["--epochs", "100", "--synthetic-samples", "4096", "--batch-size", "32", "--log-every", "5"]


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "PET_", "PAI_"))}
    return {**env, "PYTHONPATH": str(ENTRYPOINT), "OMP_NUM_THREADS": "1", **extra}


class Run:
    """A command whose output lines are timestamped as they arrive, and its own CPU time (not its children's)."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path):
        self.process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.cpu_s = 0.0
        self.started = time.monotonic()
        self.wall_s = 0.0
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._cpu, daemon=True).start()

    def _cpu(self) -> None:
        try:
            process = psutil.Process(self.process.pid)
            while self.process.poll() is None:
                times = process.cpu_times()
                self.cpu_s, self.wall_s = times.user + times.system, time.monotonic() - self.started
                time.sleep(0.25)
        except psutil.Error:
            pass

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.time(), line))

    def wait_for(self, pattern: re.Pattern, timeout: float) -> tuple[float, str] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, line in list(self.lines):
                if pattern.search(line):
                    return at, line
            if self.process.poll() is not None and not any(pattern.search(line) for _, line in self.lines):
                return None
            time.sleep(0.05)
        return None

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.wait()
        time.sleep(0.2)
        return code, "".join(line for _, line in self.lines)


def trainpod_run(out: Path, timeout: float, *args: str) -> Run:
    command = [sys.executable, "-m", "trainpod", "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               "--hang-timeout", f"{timeout:g}", "--max-restarts", "0", *args]
    return Run(command, environment(TRAINPOD_OUTPUT_DIR=str(out / "output")), out)


def detect_once(case: str, timeout: float) -> float:
    out = Path(tempfile.mkdtemp(prefix=f"trainpod-bench-hang-{case}-"))
    if case.startswith("sigstop"):
        run = trainpod_run(out, timeout, "--example", "cifar10-ddp", "--", *STOP_ARGS, "--output-dir", str(out / "m"))
        if run.wait_for(re.compile(r"step (1[5-9]|[2-9]\d)/"), 180) is None:
            sys.exit(f"bench-hangs: the example did not reach step 15:\n{run.finish()[1][-3000:]}")
        ranks = [p for p in psutil.Process(run.process.pid).children(recursive=True)
                 if "trainpod.examples.cifar10" in " ".join(p.cmdline()) and "trainpod.agent" not in " ".join(p.cmdline())]
        victim = max(ranks, key=lambda p: p.pid)
        if case == PACED:
            time.sleep(8)  # the watch sees every rank advance at several looks (once a second): the pace is known
        victim.send_signal(signal.SIGSTOP)
        started = time.time()
    else:
        args = ["sleep-before-init", "--rank", "1"] if case == "sleep-before-init" else ["skip", "--rank", "1", "--at", "3"]
        run = trainpod_run(out, timeout, "--", sys.executable, str(HANG_JOB), *args)
        mark = run.wait_for(MARK, 120)
        if mark is None:
            sys.exit(f"bench-hangs: {case}: the job never started its hang:\n{run.finish()[1][-3000:]}")
        started = float(MARK.search(mark[1]).group(1))
    reported = run.wait_for(HANG_LINE, timeout + 60)
    code, log = run.finish()
    if reported is None or code != 124:
        sys.exit(f"bench-hangs: {case}: no hang report (exit {code}):\n{log[-3000:]}")
    return reported[0] - started


def watch_run(variant: str) -> tuple[float, float]:
    """(samples/s, the agent's CPU seconds per second) of the example under `trainpod run`, watch on or off."""
    out = Path(tempfile.mkdtemp(prefix=f"trainpod-bench-watch-{variant}-"))
    command = [sys.executable, "-m", "trainpod", "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               "--no-supervise", "--hang-timeout", "120" if variant == "watch" else "0", "--example", "cifar10-ddp", "--",
               *EXAMPLE, "--output-dir", str(out)]
    run = Run(command, environment(), out)  # --no-supervise: the process becomes the agent (exec)
    code, log = run.finish(600)
    if code != 0:
        sys.exit(f"bench-hangs: {variant} failed ({code}):\n{log[-3000:]}")
    return json.loads((out / "metrics.json").read_text())["samples_per_sec"], run.cpu_s / max(run.wall_s, 1e-9)


PAIRS_WORKER = """
import os, sys, time, json, torch, torch.distributed as dist
from torch import nn
from trainpod.train import progress
blocks, block = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
    nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 8 * 8, 10)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
times = {"on": [], "off": []}
n = 0
for b in range(blocks + 2):
    on = b % 2 == 0
    t = time.perf_counter()
    for _ in range(block):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        n += 1
        if on:
            progress.step(n)
    if b >= 2:  # the first two blocks warm up
        times["on" if on else "off"].append(time.perf_counter() - t)
if dist.get_rank() == 0:
    print("bench-pairs: " + json.dumps(times), flush=True)
dist.destroy_process_group()
"""


def paired_blocks(blocks: int = 160, block: int = 5, worker: str = PAIRS_WORKER, bench: str = "bench-hangs") -> dict:
    """Block times "on" and "off", alternating in one 2-rank job under bare torchrun: `worker` (by default, with and
    without progress.step() after each step) prints them on a line `bench-pairs: {"on": [...], "off": [...]}`."""
    out = Path(tempfile.mkdtemp(prefix="trainpod-bench-pairs-"))
    (out / "pairs.py").write_text(worker)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               str(out / "pairs.py"), str(blocks), str(block)]
    run = Run(command, environment(TRAINPOD_PROGRESS_DIR=str(out)), out)
    code, log = run.finish(900)
    lines = [line.split("bench-pairs: ", 1)[1] for line in log.splitlines() if "bench-pairs: " in line]
    if code != 0 or not lines:
        sys.exit(f"{bench}: the paired blocks failed ({code}):\n{log[-3000:]}")
    times = json.loads(lines[-1])
    return {"block_steps": block, "on_s": times["on"], "off_s": times["off"]}


def look_cost(looks: int = 200) -> dict:
    """CPU seconds of one look of the watch at 2 ranks: busy ones (/proc only) and idle ones (py-spy too)."""
    sys.path.insert(0, str(ENTRYPOINT))
    from trainpod.agent import hang, hangwatch

    result = {}
    for kind, code in (("busy", "while True: pass"), ("idle", "import time; time.sleep(600)")):
        ranks = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
        try:
            time.sleep(0.5)
            directory = tempfile.mkdtemp(prefix="trainpod-bench-look-")
            watch = hangwatch.Watch(120.0, "0", lambda line: None, {"TRAINPOD_PROGRESS_DIR": directory})
            watch._workers = [hangwatch.Worker(r, r, p.pid) for r, p in enumerate(ranks)]
            trackers = {r: hang.Tracker(r, "0") for r in range(2)}
            watch._look(trackers, lambda local: None)
            count = looks if kind == "busy" else 5
            started, before = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
            for _ in range(count):
                time.sleep(0.05)
                for tracker in trackers.values():
                    tracker.signature = None  # idle: a stack read at every look (at most every refresh in a job)
                watch._look(trackers, lambda local: None)
            own = time.process_time() - started
            # py-spy runs as a child that has ended (the ranks have not): its CPU counts as the watch's too.
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            spent = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            result[kind] = (own + spent) / count
        finally:
            for process in ranks:
                process.kill()
                process.wait()
    return result


def per_call_cost(calls: int = 200_000) -> float:
    """Seconds per trainpod.train.progress.step() call, reporting into a temporary directory."""
    code = (f"import os, time, tempfile; os.environ['TRAINPOD_PROGRESS_DIR'] = tempfile.mkdtemp()\n"
            f"from trainpod.train import progress\nprogress.step(0)\nt = time.perf_counter()\n"
            f"for n in range({calls}): progress.step(n)\nprint((time.perf_counter() - t) / {calls})")
    done = subprocess.run([sys.executable, "-c", code], env=environment(), capture_output=True, text=True, check=True)
    return float(done.stdout)


def bench(rounds: int, timeout: float) -> dict:
    detection = {}
    for case in ("sleep-before-init", "skip", "sigstop", PACED):
        detection[case] = [detect_once(case, PACED_TIMEOUT_S if case == PACED else timeout) for _ in range(rounds)]
        print(f"  {case}: reported after {', '.join(f'{s:.1f}' for s in detection[case])} s", file=sys.stderr, flush=True)
    pairs = paired_blocks()
    print(f"  paired blocks: median {statistics.median(pairs['on_s']):.4f} s with progress, "
          f"{statistics.median(pairs['off_s']):.4f} s without", file=sys.stderr, flush=True)
    watch: dict[str, list] = {"watch": [], "no-watch": []}
    for round_ in range(rounds):
        for variant in ("watch", "no-watch") if round_ % 2 == 0 else ("no-watch", "watch"):
            watch[variant].append(watch_run(variant))
            print(f"  round {round_ + 1} {variant:<9} {watch[variant][-1][0]:8.1f} samples/s, agent "
                  f"{watch[variant][-1][1] * 100:.2f} % CPU", file=sys.stderr, flush=True)
    cost = per_call_cost()
    step_s = statistics.median(pairs["off_s"]) / pairs["block_steps"]
    return {"timeout_s": timeout, "rounds": rounds, "detection_s": detection, "pairs": pairs, "watch": watch,
            "step_call_s": cost, "step_s": step_s, "look_s": look_cost()}


def neighbour_ratios(on: list[float], off: list[float]) -> list[float]:
    """Blocks ran on0, off0, on1, off1, ...: each on-block's time against the mean of the off-blocks
    around it, which cancels a load that drifts linearly; samples/s with over samples/s without."""
    return [((off[i - 1] + off[i]) / 2) / on[i] for i in range(1, min(len(on), len(off)))]


def report(result: dict) -> str:
    timeout = result["timeout_s"]
    lines = [f"hang reports (this host, 2 processes, --hang-timeout {timeout:g}, {result['rounds']} runs each; "
             f"goal <= {timeout + 5:g} s)",
             f"  {'case':22}{'median':>10}{'max':>10}  runs (s from the hang's start to the one-line report)"]
    for case, runs in result["detection_s"].items():
        if case == PACED:
            case = f"{PACED} (--hang-timeout {PACED_TIMEOUT_S:g}, goal <= 10 s)"
        lines.append(f"  {case:22}{statistics.median(runs):>9.1f}s{max(runs):>9.1f}s  {', '.join(f'{s:.1f}' for s in runs)}")
    pairs = result["pairs"]
    on, off = statistics.median(pairs["on_s"]), statistics.median(pairs["off_s"])
    ratios = neighbour_ratios(pairs["on_s"], pairs["off_s"])
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    lines.append(f"progress signal, one 2-rank DDP job, {len(pairs['on_s'])} blocks of {pairs['block_steps']} steps each way, "
                 f"alternating: median block {on * 1e3:.1f} ms with progress.step(), {off * 1e3:.1f} ms without")
    lines.append(f"  samples/s with/without, each block against the mean of its two neighbours: median {median:.4f} "
                 f"(quartiles {q1:.4f}, {q3:.4f}; goal >= 0.99)")
    share = result["step_call_s"] / result["step_s"]
    lines.append(f"  one progress.step() call: {result['step_call_s'] * 1e6:.2f} us, {share * 100:.4f} % of a "
                 f"{result['step_s'] * 1e3:.1f} ms step")
    look = result["look_s"]
    lines.append(f"hang watch, one look at 2 ranks (every second at --hang-timeout 120): {look['busy'] * 1e3:.2f} ms CPU "
                 f"when they compute ({look['busy'] * 100:.3f} % of a core), {look['idle'] * 1e3:.0f} ms when they are "
                 "idle and py-spy reads their stacks (at most every 24 s per idle rank)")
    watch = result["watch"]
    rate = {v: statistics.median(r[0] for r in runs) for v, runs in watch.items()}
    cpu = {v: statistics.median(r[1] for r in runs) for v, runs in watch.items()}
    lines.append(f"hang watch (CIFAR-10 example, trainpod run --hang-timeout 120 vs 0, median of {len(watch['watch'])} "
                 f"alternating runs): the agent's CPU {cpu['watch'] * 100:.2f} % vs {cpu['no-watch'] * 100:.2f} % of a core; "
                 f"samples/s {rate['watch']:.1f} vs {rate['no-watch']:.1f} (ratio {rate['watch'] / rate['no-watch']:.3f}, "
                 "runs differ by more than that on a shared host)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="--hang-timeout for the detection runs")
    args = parser.parse_args(argv)
    result = bench(args.rounds, args.timeout)
    print(report(result))
    print("bench-hangs: " + json.dumps(result), flush=True)
    results_page.record("hangs", report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
