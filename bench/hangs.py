"""The hang watch's costs (run by bench/run.py): how soon a hang is reported, and what the progress signal costs.

1. Time from the hang's start to the one-line report, `trainpod run --hang-timeout T` on this host
   (2 processes, no Docker), for each case: a rank asleep before init_process_group and a skipped
   collective (tests/integration/hangs/hang_job.py, which prints when its hang starts), and a SIGSTOP
   of one rank of the CIFAR-10 example (timed from the signal). Goal: T + 5 s or better.
2. The progress signal's cost on steady samples/s: the CIFAR-10 example under bare torchrun with
   TRAINPOD_PROGRESS_DIR set (one pwrite per step) and without it (trainpod.progress is a no-op),
   alternating, medians side by side; plus the cost of one progress.step() call against the length
   of a step, which no machine's noise blurs. Goal: within 1 %.
3. The whole watch (the agent sampling /proc, the stacks of idle ranks) on samples/s: `trainpod run`
   with --hang-timeout 120 against 0, alternating, medians.

    python3 bench/hangs.py [--rounds N] [--timeout T]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ENTRYPOINT = HERE.parent / "entrypoint"
HANG_JOB = HERE.parent / "tests" / "integration" / "hangs" / "hang_job.py"
TIMEOUT_S = 10
MARK = re.compile(r"hang-job: rank \d+ hang starts.* at ([0-9.]+)")
HANG_LINE = re.compile(r"\] trainpod: hang: ")
# The overhead runs: enough steps that the warm-up and the launch drop out of samples/s.
EXAMPLE = ["--epochs", "100", "--max-steps", "200", "--synthetic-samples", "8192", "--batch-size", "64", "--log-every", "50"]
STOP_ARGS = ["--epochs", "100", "--synthetic-samples", "4096", "--batch-size", "32", "--log-every", "5"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "PET_", "PAI_"))}
    return {**env, "PYTHONPATH": str(ENTRYPOINT), "OMP_NUM_THREADS": "1", **extra}


class Run:
    """A command whose output lines are timestamped as they arrive."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path):
        self.process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

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
    if case == "sigstop":
        run = trainpod_run(out, timeout, "--example", "cifar10-ddp", "--", *STOP_ARGS, "--output-dir", str(out / "m"))
        if run.wait_for(re.compile(r"step (1[5-9]|[2-9]\d)/"), 180) is None:
            sys.exit(f"bench-hangs: the example did not reach step 15:\n{run.finish()[1][-3000:]}")
        ranks = [p for p in psutil.Process(run.process.pid).children(recursive=True)
                 if "trainpod.examples.cifar10" in " ".join(p.cmdline()) and "trainpod.agent" not in " ".join(p.cmdline())]
        victim = max(ranks, key=lambda p: p.pid)
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


def samples_per_s(variant: str) -> float:
    out = Path(tempfile.mkdtemp(prefix=f"trainpod-bench-progress-{variant}-"))
    port = str(free_port())
    example = ["-m", "trainpod.examples.cifar10", *EXAMPLE, "--output-dir", str(out)]
    if variant in ("progress", "no-progress"):
        extra = {"TRAINPOD_PROGRESS_DIR": str(out)} if variant == "progress" else {}
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port, *example]
        run = Run(command, environment(**extra), out)
    else:
        command = [sys.executable, "-m", "trainpod", "run", "--nproc-per-node", "2", "--master-port", port, "--no-supervise",
                   "--hang-timeout", "120" if variant == "watch" else "0", "--example", "cifar10-ddp", "--", *EXAMPLE,
                   "--output-dir", str(out)]
        run = Run(command, environment(), out)
    code, log = run.finish(600)
    if code != 0:
        sys.exit(f"bench-hangs: {variant} failed ({code}):\n{log[-3000:]}")
    return json.loads((out / "metrics.json").read_text())["samples_per_sec"]


def per_call_cost(calls: int = 200_000) -> float:
    """Seconds per trainpod.progress.step() call, reporting into a temporary directory."""
    code = (f"import os, time, tempfile; os.environ['TRAINPOD_PROGRESS_DIR'] = tempfile.mkdtemp()\n"
            f"from trainpod import progress\nprogress.step(0)\nt = time.perf_counter()\n"
            f"for n in range({calls}): progress.step(n)\nprint((time.perf_counter() - t) / {calls})")
    done = subprocess.run([sys.executable, "-c", code], env=environment(), capture_output=True, text=True, check=True)
    return float(done.stdout)


def alternate(variants: tuple[str, str], rounds: int) -> dict[str, list[float]]:
    runs: dict[str, list[float]] = {v: [] for v in variants}
    for round_ in range(rounds):
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            runs[variant].append(samples_per_s(variant))
            print(f"  round {round_ + 1} {variant:<12} {runs[variant][-1]:8.1f} samples/s", file=sys.stderr, flush=True)
    return runs


def bench(rounds: int, timeout: float) -> dict:
    detection = {}
    for case in ("sleep-before-init", "skip", "sigstop"):
        detection[case] = [detect_once(case, timeout) for _ in range(rounds)]
        print(f"  {case}: reported after {', '.join(f'{s:.1f}' for s in detection[case])} s", file=sys.stderr, flush=True)
    progress = alternate(("progress", "no-progress"), rounds)
    watch = alternate(("watch", "no-watch"), rounds)
    cost = per_call_cost()
    # A step of the overhead runs, from their samples/s: 2 processes x 64 samples per step.
    step_s = 2 * 64 / statistics.median(progress["no-progress"])
    return {"timeout_s": timeout, "rounds": rounds, "detection_s": detection,
            "progress": progress, "watch": watch, "step_call_s": cost, "step_s": step_s}


def report(result: dict) -> str:
    timeout = result["timeout_s"]
    lines = [f"hang reports (this host, 2 processes, --hang-timeout {timeout:g}, {result['rounds']} runs each; "
             f"goal <= {timeout + 5:g} s)",
             f"  {'case':22}{'median':>10}{'max':>10}  runs (s from the hang's start to the one-line report)"]
    for case, runs in result["detection_s"].items():
        lines.append(f"  {case:22}{statistics.median(runs):>9.1f}s{max(runs):>9.1f}s  {', '.join(f'{s:.1f}' for s in runs)}")
    for key, (on, off), what in (("progress", ("progress", "no-progress"), "progress signal (bare torchrun, CIFAR-10 example)"),
                                 ("watch", ("watch", "no-watch"), "hang watch (trainpod run --hang-timeout 120 vs 0)")):
        runs = result[key]
        a, b = statistics.median(runs[on]), statistics.median(runs[off])
        lines.append(f"{what}, steady samples/s, median of {len(runs[on])} alternating runs: "
                     f"on {a:.1f}, off {b:.1f}, ratio {a / b:.3f} (goal >= 0.99)")
    share = result["step_call_s"] / result["step_s"]
    lines.append(f"  one progress.step() call: {result['step_call_s'] * 1e6:.2f} us, {share * 100:.4f} % of a "
                 f"{result['step_s'] * 1e3:.1f} ms step")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="--hang-timeout for the detection runs")
    args = parser.parse_args(argv)
    result = bench(args.rounds, args.timeout)
    print(report(result))
    print("bench-hangs: " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
