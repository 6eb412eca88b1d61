"""The rendezvous round after a failure in a multi-node job, trainpod's agent vs torch's (run by bench/run.py).

Two agents on this host form a 2-node c10d job, one process each, running a script that does no
work: in its first attempt each rank exits 3 at the same wall-clock instant (a deadline the bench
gives both); each agent then restarts its worker group, and the two meet again in a new round of
torch's dynamic rendezvous before the second attempt's ranks start. Measured from the later exit to
the first line of Python of the second attempt's first rank, and of its last one (both up again).
What differs is the agent only, with identical arguments and environment:
`python -m trainpod.agent` (its restart policy, and the rendezvous polled every 0.1 s rather than
torch's second: trainpod.agent.policy._poll_rendezvous_faster) against `python -m torch.distributed.run`.
Variants alternate; medians are reported.

    python3 bench/restart_round.py [--rounds N]

Prints one `bench-restart-round: {json}` line, then the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_page

ENTRYPOINT = str(Path(__file__).resolve().parents[1] / "entrypoint")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fixtures.ports import free_port  # noqa: E402

SCRIPT = """
import os, sys, time
attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
print(f"bench-round: attempt {attempt} rank {rank} up {time.time():.6f}", flush=True)
if attempt == "0":
    time.sleep(max(0.0, float(os.environ["BENCH_FAIL_AT"]) - time.time()))
    print(f"bench-round: attempt 0 rank {rank} exit {time.time():.6f}", flush=True)
    sys.exit(3)
"""
AGENTS = {"trainpod agent": ["-m", "trainpod.agent"], "torch's agent": ["-m", "torch.distributed.run"]}
LINE = re.compile(r"bench-round: attempt (\d) rank (\d) (up|exit) ([0-9.]+)")
START_S = 15.0  # both agents up, met and their first ranks running by then, on a busy 2-core host
TIMEOUT_S = 120


def run_once(variant: str, script: Path) -> dict[str, float]:
    port, fail_at = free_port(), time.time() + START_S
    env = {**os.environ, "PYTHONPATH": ENTRYPOINT, "BENCH_FAIL_AT": f"{fail_at:.6f}",
           "TRAINPOD_MAX_RESTARTS": "2"}
    agents = [
        subprocess.Popen([sys.executable, *AGENTS[variant], "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                          "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"round-{port}",
                          "--max-restarts", "2", str(script)],
                         env={**env, "TRAINPOD_NODE": f"node{node}"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)
    ]  # fmt: skip
    output = "".join(agent.communicate(timeout=TIMEOUT_S)[0] for agent in agents)
    seen = {(int(a), int(r), what): float(t) for a, r, what, t in LINE.findall(output)}
    exits = [seen.get((0, rank, "exit")) for rank in (0, 1)]
    ups = [seen.get((1, rank, "up")) for rank in (0, 1)]
    if [a.returncode for a in agents] != [0, 0] or None in exits + ups or min(exits) < fail_at - 0.5:
        sys.exit(f"bench: {variant}: no clean restart (codes {[a.returncode for a in agents]}):\n{output[-3000:]}")
    return {"first_up_s": min(ups) - max(exits), "both_up_s": max(ups) - max(exits)}


def bench(rounds: int) -> dict:
    runs: dict[str, list[dict[str, float]]] = {variant: [] for variant in AGENTS}
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch, "round.py")
        script.write_text(SCRIPT)
        for _ in range(rounds):
            for variant in AGENTS:
                runs[variant].append(run_once(variant, script))
    return {variant: {key: statistics.median(run[key] for run in each) for key in each[0]} | {"runs": each}
            for variant, each in runs.items()}  # fmt: skip


def report(result: dict) -> str:
    ours, torchs = result["trainpod agent"], result["torch's agent"]
    lines = [f"restart round of a 2-node c10d job (this host; from both ranks' exit, median of {len(ours['runs'])} alternating runs)",
             f"  {'':26}{'trainpod agent':>16}{'torch agent':>13}{'ratio':>8}"]  # fmt: skip
    for key, what in (("first_up_s", "first rank up again (s)"), ("both_up_s", "both ranks up again (s)")):
        lines.append(f"  {what:26}{ours[key]:>16.2f}{torchs[key]:>13.2f}{ours[key] / torchs[key]:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    result = bench(parser.parse_args(argv).rounds)
    print("bench-restart-round: " + json.dumps(result))
    print(report(result))
    results_page.record("restart-round", report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
