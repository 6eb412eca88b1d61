"""Elastic recovery (run by bench/run.py): from a lost node to the survivor's first step at the smaller world.

On this host with a real etcd (Debian's etcd-server; started here on free ports) and real torchrun:
two nodes with --nnodes 1:2 train the cifar10-ddp example (synthetic, 512 samples, 2 epochs,
checkpoints every 2 steps in a shared directory); once rank 0 has printed a step at world 2 after
a checkpoint could exist, every process of rank 0's node gets SIGKILL (a lost container or host).
Recovery is the time from the kill to the survivor's first completed step at world 1. Per backend:

- `trainpod run --rdzv-backend B` (trainpod's elastic rendezvous settings, trainpod.resolve.ELASTIC_CONF),
- bare torchrun with the same rendezvous (`python -m trainpod.rendezvous.torchrun`, so etcd-v3 is known),
  with torch's defaults, and with the same --rdzv-conf as trainpod (what the settings alone do).

    python3 bench/elastic.py [--rounds N] [--backends etcd-v3,etcd]

Prints one `bench-elastic: {json}` line, then the table (medians over the rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent / "entrypoint")]

from fixtures.elastic_host import clean_env, scale_down, torchrun_argv, trainpod_argv  # noqa: E402
from fixtures.etcd import EtcdProcess  # noqa: E402
from trainpod.resolve import ELASTIC_CONF, ETCD_V2_CONF  # noqa: E402

TIMEOUT_S = 300


def variants(backend: str, endpoint: str):
    conf = ",".join(f"{k}={v}" for k, v in (ETCD_V2_CONF if backend == "etcd" else ELASTIC_CONF).items())

    def bare(workdir: Path, with_conf: bool):
        argv = torchrun_argv(backend, endpoint, workdir, f"bare-{workdir.name}")  # the same on both nodes
        if with_conf:
            at = argv.index("--max-restarts")
            argv[at:at] = ["--rdzv-conf", conf]
        return argv

    return {
        "trainpod run": lambda workdir: trainpod_argv(backend, endpoint, workdir),
        "bare torchrun": lambda workdir: bare(workdir, False),
        "bare torchrun, same conf": lambda workdir: bare(workdir, True),
    }


def measure(backends: list[str], rounds: int) -> dict:
    figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
        for backend in backends:
            with EtcdProcess(Path(tmp, f"etcd-{backend}"), enable_v2=backend == "etcd") as etcd:
                runs: dict[str, list[float]] = {}
                for round_ in range(rounds):
                    for name, make in variants(backend, etcd.endpoint).items():  # alternating, round by round
                        workdir = Path(tmp, f"{backend}-{round_}-{name.replace(' ', '-').replace(',', '')}")
                        try:
                            result = scale_down(lambda make=make, workdir=workdir: make(workdir), clean_env(), workdir,
                                                TIMEOUT_S)
                        except AssertionError as error:  # never formed world 2: reported, not measured
                            print(f"bench-elastic: {backend} {name}: {str(error)[-3000:]}", file=sys.stderr)
                            result = {"survivor_code": None, "recovery_s": None, "survivor": None}
                        ok = result["survivor_code"] == 0 and result["recovery_s"] is not None
                        if not ok and result["survivor"] is not None:
                            print(f"bench-elastic: {backend} {name}: no recovery (exit {result['survivor_code']}):\n"
                                  + result["survivor"].text()[-3000:], file=sys.stderr)
                        runs.setdefault(name, []).append(result["recovery_s"] if ok else float("nan"))
                figures[backend] = {name: statistics.median(values) for name, values in runs.items()}
                figures[backend]["runs"] = runs
    return figures


def report(figures: dict) -> str:
    lines = ["elastic recovery: lost node (SIGKILL of its every process) to the survivor's first step at world 1, "
             "2 nodes --nnodes 1:2, cifar10-ddp (median)",
             f"  {'backend':10}{'trainpod run':>14}{'bare torchrun':>15}{'ratio':>8}{'bare, same conf':>17}{'ratio':>8}"]
    for backend, f in figures.items():
        t, b, s = f["trainpod run"], f["bare torchrun"], f["bare torchrun, same conf"]
        lines.append(f"  {backend:10}{t:>12.1f} s{b:>13.1f} s{t / b:>8.2f}{s:>15.1f} s{t / s:>8.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--backends", default="etcd-v3,etcd")
    args = parser.parse_args()
    figures = measure([b for b in args.backends.split(",") if b], args.rounds)
    print("bench-elastic: " + json.dumps(figures))
    print(report(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
