"""The metrics endpoint's cost (run by bench/run.py): what --metrics-port costs the training, side by side.

The CIFAR-10 example (2 processes on this host, 200 steps) under `trainpod run --no-supervise` with
--metrics-port and a scraper reading /metrics every second (a Prometheus scraping at 1 s, 15 times
its default rate), against the same run without the endpoint; runs alternate, and each pair is
compared (adjacent runs see the same machine load). Reported: the median ratio of samples/s (goal
>= 0.99) and the agent's CPU seconds per second of each variant.

    python3 bench/metrics.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import results_page
from hangs import EXAMPLE, Run, environment, free_port


def one_run(endpoint: bool) -> tuple[float, float, int]:
    """(samples/s, the agent's CPU seconds per second, scrapes served) of one run."""
    out = Path(tempfile.mkdtemp(prefix="trainpod-bench-metrics-"))
    port = free_port()
    command = [sys.executable, "-m", "trainpod", "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               "--no-supervise", *(["--metrics-port", str(port)] if endpoint else []), "--example", "cifar10-ddp", "--",
               *EXAMPLE, "--output-dir", str(out)]
    run = Run(command, environment(), out)  # --no-supervise: the process becomes the agent (exec)
    scrapes = [0]

    def scrape() -> None:
        while run.process.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
                scrapes[0] += 1
            except OSError:
                pass
            time.sleep(1.0)

    if endpoint:
        threading.Thread(target=scrape, daemon=True).start()
    code, log = run.finish(600)
    if code != 0:
        sys.exit(f"bench-metrics: a run {'with' if endpoint else 'without'} the endpoint failed ({code}):\n{log[-3000:]}")
    rate = json.loads((out / "metrics.json").read_text())["samples_per_sec"]
    return rate, run.cpu_s / max(run.wall_s, 1e-9), scrapes[0]


def bench(rounds: int) -> dict:
    runs: dict[str, list] = {"endpoint": [], "none": []}
    for round_ in range(rounds):
        for variant in ("endpoint", "none") if round_ % 2 == 0 else ("none", "endpoint"):
            runs[variant].append(one_run(variant == "endpoint"))
            rate, cpu, scrapes = runs[variant][-1]
            print(f"  round {round_ + 1} {variant:<8} {rate:8.1f} samples/s, agent {cpu * 100:.2f} % CPU, {scrapes} scrapes",
                  file=sys.stderr, flush=True)
    return {"rounds": rounds, "runs": runs}


def report(result: dict) -> str:
    runs = result["runs"]
    ratios = [on[0] / off[0] for on, off in zip(runs["endpoint"], runs["none"])]
    rate = {v: statistics.median(r[0] for r in rs) for v, rs in runs.items()}
    cpu = {v: statistics.median(r[1] for r in rs) for v, rs in runs.items()}
    scrapes = sum(r[2] for r in runs["endpoint"])
    return "\n".join([
        f"metrics endpoint (CIFAR-10 example, trainpod run with --metrics-port and a scrape every second vs without, "
        f"{result['rounds']} alternating pairs, {scrapes} scrapes served)",
        f"  samples/s {rate['endpoint']:.1f} vs {rate['none']:.1f}; each pair's ratio: median {statistics.median(ratios):.3f} "
        f"({', '.join(f'{r:.3f}' for r in ratios)}; goal >= 0.99)",
        f"  the agent's CPU {cpu['endpoint'] * 100:.2f} % vs {cpu['none'] * 100:.2f} % of a core"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    result = bench(args.rounds)
    print(report(result))
    print("bench-metrics: " + json.dumps(result), flush=True)
    results_page.record("metrics", report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
