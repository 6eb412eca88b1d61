"""What --peer-copies costs and gives, side by side in one run (run by bench/run.py): a checkpoint of SIZE MiB,
saved by a Checkpointer without and with peer copies (two agents' copy servers on this host, trainpod.agent.peercopy),
and loaded back by a rank whose directory has it (from the disk) and by one whose directory is empty (from a
peer's memory, over HTTP on the loopback).

    python3 bench/peer_copies.py [--sizes 64,256] [--rounds 3]

save: from save() to the commit being durable (wait()): with peer copies the file goes to two agents first.
load: load_latest() to the state in memory; from the disk it reads and verifies the file (sha256), from a peer
it fetches and verifies the copy. The loopback is no network: the figures are the copies' own overhead (HTTP,
a second sha256, the copy in memory), a floor for a real link, where the transfer adds size / bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import results_page

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "entrypoint"))

import torch  # noqa: E402

from trainpod.agent import peercopy  # noqa: E402
from trainpod.train.checkpoint import Checkpointer  # noqa: E402
from trainpod.train.checkpoint.peers import Peers  # noqa: E402

JOB = "bench"


def state_of(mib: int) -> dict:
    return {"weights": torch.randn(mib * (1 << 20) // 4), "step": 1}


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def measure(mib: int, rounds: int) -> dict:
    state = state_of(mib)
    figures: dict[str, list[float]] = {"save": [], "save_copies": [], "load_disk": [], "load_peer": []}
    servers = [peercopy.CopyServer("127.0.0.1", JOB) for _ in range(2)]
    try:
        peers = [Peers([s.address for s in servers], node, JOB) for node in range(2)]
        for round_ in range(rounds):
            with tempfile.TemporaryDirectory() as tmp:
                root = Path(tmp)
                plain = Checkpointer(root / "plain", keep=1, log=lambda _: None, peers=False)
                copied = Checkpointer(root / "copied", keep=1, log=lambda _: None, peers=peers[0])
                step = round_ + 1
                for name, ckpt in (("save", plain), ("save_copies", copied)):
                    figures[name].append(timed(lambda ckpt=ckpt, step=step: (ckpt.save(step, state), ckpt.wait())))
                    ckpt.close()
                disk = Checkpointer(root / "copied", log=lambda _: None, peers=peers[1])  # the directory has it
                empty = Checkpointer(root / "empty", log=lambda _: None, peers=peers[1])  # only a peer's memory has it
                figures["load_disk"].append(timed(disk.load_latest))
                figures["load_peer"].append(timed(empty.load_latest))
    finally:
        for server in servers:
            server.close()
    return {name: statistics.median(values) for name, values in figures.items()}


def report(results: dict[int, dict]) -> str:
    lines = ["peer copies: a checkpoint saved without and with --peer-copies (two agents' memory on this host, loopback "
             "HTTP), and loaded from the disk and from a peer's memory (median of the rounds)",
             f"  {'MiB':>6}{'save':>9}{'with copies':>13}{'ratio':>7}{'load: disk':>12}{'peer':>9}{'ratio':>7}"]
    for mib, f in results.items():
        lines.append(f"  {mib:>6}{f['save']:>7.2f} s{f['save_copies']:>11.2f} s{f['save_copies'] / f['save']:>7.2f}"
                     f"{f['load_disk']:>10.2f} s{f['load_peer']:>7.2f} s{f['load_peer'] / f['load_disk']:>7.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256", help="checkpoint sizes in MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    results = {mib: measure(mib, args.rounds) for mib in (int(s) for s in args.sizes.split(",") if s)}
    print(report(results))
    print("bench-peer-copies: " + json.dumps(results), flush=True)
    results_page.record("peer-copies", report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
