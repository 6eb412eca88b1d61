"""Elastic recovery (run by bench/run.py): from a lost node to the survivor's first step at the smaller world.

On this host with a real etcd (Debian's etcd-server; started here on free ports) or c10d, and real
torchrun: two nodes with --nnodes 1:2 train the cifar10-ddp example (synthetic, 512 samples, 2 epochs,
checkpoints every 2 steps in a shared directory); once rank 0 has printed a step at world 2 after
a checkpoint could exist, every process of a node gets SIGKILL (a lost container or host): rank 0's
with etcd, with c10d the node that does not host the store (losing the store's host ends the job
with 69 by design: tests/integration/test_elastic_host.py).
Recovery is the time from the kill to the survivor's first completed step at world 1; with a spare (a third
node started beyond the maximum before the loss: etcd-v3 and c10d), to the first step at world 2 again. Scale-up is
the other way: one node trains at world 1 (a run long enough to outlast it), a second one starts, and the
time from its start to the first step at world 2. Per backend, both:

- `trainpod run --rdzv-backend B` (trainpod's elastic rendezvous settings, trainpod.launcher.resolve.ELASTIC_CONF),
- bare torchrun with the same rendezvous (`python -m trainpod.rendezvous.torchrun`, so etcd-v3 is known),
  with torch's defaults, and with the same --rdzv-conf as trainpod (what the settings alone do).

    python3 bench/elastic.py [--rounds N] [--backends etcd-v3,etcd,c10d]

Prints one `bench-elastic: {json}` line, then the tables (medians over the rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

import results_page

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent / "entrypoint")]

from fixtures.elastic_host import STEPS, clean_env, scale_down, scale_up, torchrun_argv, trainpod_argv  # noqa: E402
from fixtures.etcd import EtcdProcess  # noqa: E402
from fixtures.ports import free_port  # noqa: E402
from trainpod.launcher.resolve import ELASTIC_CONF, ETCD_V2_CONF  # noqa: E402

TIMEOUT_S = 300


VARIANTS = ("trainpod run", "bare torchrun", "bare torchrun, same conf")


def variants(backend: str, endpoint: str):
    conf = ",".join(f"{k}={v}" for k, v in (ETCD_V2_CONF if backend == "etcd" else ELASTIC_CONF).items())

    def bare(workdir: Path, with_conf: bool):
        argv = torchrun_argv(backend, endpoint, workdir, f"bare-{workdir.name}")  # the same on both nodes
        if with_conf:
            at = argv.index("--max-restarts")
            argv[at:at] = ["--rdzv-conf", conf]
        return argv

    return {  # VARIANTS
        "trainpod run": lambda workdir: trainpod_argv(backend, endpoint, workdir),
        "bare torchrun": lambda workdir: bare(workdir, False),
        "bare torchrun, same conf": lambda workdir: bare(workdir, True),
    }


def rendezvous(backend: str, tmp: Path):
    """(a context that runs the rendezvous's server, a function that gives each job its endpoint and how
    it picks the node to lose: None for rank 0's). etcd: one server for every job. c10d: a fresh port on
    this host per job, hosted by whichever node's agent binds it first; the other node is lost."""
    if backend != "c10d":
        etcd = EtcdProcess(tmp / f"etcd-{backend}", enable_v2=backend == "etcd")
        return etcd, lambda: (etcd.endpoint, None)

    def endpoint():
        port = free_port()
        return f"127.0.0.1:{port}", lambda nodes: next(node for node in nodes if not node.listens_on(port))

    return contextlib.nullcontext(), endpoint


def measure(backends: list[str], rounds: int) -> dict:
    figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
        for backend in backends:
            server, job_endpoint = rendezvous(backend, Path(tmp))
            with server:
                runs: dict[str, list[float]] = {}
                for round_ in range(rounds):
                    for name in VARIANTS:  # alternating, round by round
                        endpoint, lose = job_endpoint()
                        make = variants(backend, endpoint)[name]
                        workdir = Path(tmp, f"{backend}-{round_}-{name.replace(' ', '-').replace(',', '')}")
                        try:
                            result = scale_down(lambda make=make, workdir=workdir: make(workdir), clean_env(), workdir,
                                                TIMEOUT_S, lose=lose)
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
                figures[backend]["scale_up"] = measure_scale_up(backend, job_endpoint, rounds, Path(tmp))
                if backend != "etcd":  # torch's etcd backend has no redundancy list: no spares (trainpod refuses --spares)
                    figures[backend]["spare"] = measure_spare(backend, job_endpoint, rounds, Path(tmp))
    return figures


SPARE_EPOCHS = ["--epochs", "40"]  # 20 times EXAMPLE_ARGS' 2: time for the spare to start and wait before the loss


def measure_spare(backend: str, job_endpoint, rounds: int, tmp: Path) -> dict:
    """A lost node with a spare waiting (a third node beyond --nnodes 1:2's maximum): from the kill to the first step
    at world 2 again, the survivor and the spare; trainpod run against bare torchrun with the same conf."""
    runs: dict[str, list[float]] = {}
    for round_ in range(rounds):
        for name in ("trainpod run", "bare torchrun, same conf"):
            endpoint, lose = job_endpoint()
            make = variants(backend, endpoint)[name]
            workdir = tmp / f"spare-{backend}-{round_}-{name.replace(' ', '-').replace(',', '')}"
            try:
                result = scale_down(lambda make=make, workdir=workdir: make(workdir) + SPARE_EPOCHS, clean_env(), workdir,
                                    TIMEOUT_S, lose=lose, spare=True, steps=STEPS * 20, spare_says=name == "trainpod run")
            except AssertionError as error:
                print(f"bench-elastic: spare {backend} {name}: {str(error)[-3000:]}", file=sys.stderr)
                result = {"survivor_code": None, "recovery_s": None}
            ok = result["survivor_code"] == 0 and result["recovery_s"] is not None
            runs.setdefault(name, []).append(result["recovery_s"] if ok else float("nan"))
    return {**{name: statistics.median(values) for name, values in runs.items()}, "runs": runs}


LONGER = ["--epochs", "400"]  # outlasts the join (then both nodes are stopped); the last --epochs wins


# torch shares the first round's bootstrap store info across rounds (the default): in the round a new
# node joins, rank 0 publishes no MASTER_ADDR and the new node waits for it until the store's timeout.
# trainpod's launch turns the sharing off (launch.py, pytorch#135712); bare torchrun is measured both ways.
NO_SHARED_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def measure_scale_up(backend: str, job_endpoint, rounds: int, tmp: Path) -> dict:
    runs: dict[str, list[float]] = {}
    # torch's default 30 s last call would dominate the bare run with torch's defaults: the same conf compares.
    cases = {"trainpod run": ("trainpod run", {}),
             "bare torchrun, same conf": ("bare torchrun, same conf", {}),
             "bare torchrun, same conf, no shared store": ("bare torchrun, same conf", NO_SHARED_STORE)}
    for round_ in range(rounds):
        for name, (variant, env) in cases.items():
            make = variants(backend, job_endpoint()[0])[variant]
            workdir = tmp / f"up-{backend}-{round_}-{name.replace(' ', '-').replace(',', '')}"
            try:
                result = scale_up(lambda make=make, workdir=workdir: make(workdir) + LONGER, clean_env(**env), workdir,
                                  TIMEOUT_S)
            except AssertionError as error:
                print(f"bench-elastic: scale-up {backend} {name}: {str(error)[-3000:]}", file=sys.stderr)
                result = {"joined_s": None, "running": False}
            ok = result["joined_s"] is not None and result["running"]
            if not ok and "nodes" in result:
                print(f"bench-elastic: scale-up {backend} {name}: no join at world 2 while both ran:\n"
                      + "\n---\n".join(n.text()[-2000:] for n in result["nodes"]), file=sys.stderr)
            runs.setdefault(name, []).append(result["joined_s"] if ok else float("nan"))
    return {**{name: statistics.median(values) for name, values in runs.items()}, "runs": runs}


def report(figures: dict) -> str:
    lines = ["elastic recovery: lost node (SIGKILL of its every process) to the survivor's first step at world 1, "
             "2 nodes --nnodes 1:2, cifar10-ddp (median)",
             f"  {'backend':10}{'trainpod run':>14}{'bare torchrun':>15}{'ratio':>8}{'bare, same conf':>17}{'ratio':>8}"]
    for backend, f in figures.items():
        t, b, s = f["trainpod run"], f["bare torchrun"], f["bare torchrun, same conf"]
        lines.append(f"  {backend:10}{t:>12.1f} s{b:>13.1f} s{t / b:>8.2f}{s:>15.1f} s{t / s:>8.2f}")
    lines += ["elastic scale-up: a second node's start to the first step at world 2, --nnodes 1:2 (median; nan: no join)",
              f"  {'backend':10}{'trainpod run':>14}{'bare, same conf':>17}{'bare, same conf, no shared store':>34}{'ratio':>8}"]
    for backend, f in figures.items():
        up = f["scale_up"]
        t, s, n = up["trainpod run"], up["bare torchrun, same conf"], up["bare torchrun, same conf, no shared store"]
        lines.append(f"  {backend:10}{t:>12.1f} s{s:>15.1f} s{n:>32.1f} s{t / n:>8.2f}")
    spares = {backend: f["spare"] for backend, f in figures.items() if "spare" in f}
    if spares:
        lines += ["elastic recovery with a spare: lost node to the first step at world 2 again (the survivor and a third "
                  "node that waited beyond --nnodes 1:2's maximum; median; nan: the spare never trained)",
                  f"  {'backend':10}{'trainpod run':>14}{'bare, same conf':>17}"]
        for backend, f in spares.items():
            lines.append(f"  {backend:10}{f['trainpod run']:>12.1f} s{f['bare torchrun, same conf']:>15.1f} s")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--backends", default="etcd-v3,etcd,c10d")
    args = parser.parse_args()
    figures = measure([b for b in args.backends.split(",") if b], args.rounds)
    print("bench-elastic: " + json.dumps(figures))
    print(report(figures))
    results_page.record("elastic", report(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
