"""What the consistency check (trainpod.agent.consistency) adds to a launch: this node's fingerprint, once per agent,
and the exchange after each rendezvous round, against the store traffic a round has anyway.

    python3 bench/consistency.py [--rounds 20] [--files 50]

1. fingerprint(): for a bundled example, and for a script that imports --files local modules;
2. the exchange on a real TCPStore for 2, 4 and 8 nodes (threads of this process, as agents on one host): every
   node's set, wait and gets, against one set and one get per node (the least a round's agents do), side by side.
Medians of --rounds; the target is 0.1 s in all at two nodes (issue 26).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoint"))

import results_page  # noqa: E402

from trainpod.agent import consistency  # noqa: E402


def timed(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def script_tree(root: Path, files: int) -> list[str]:
    (root / "lib").mkdir()
    (root / "lib" / "__init__.py").write_text("")
    for i in range(files):
        (root / "lib" / f"m{i}.py").write_text(f"import os\nfrom lib import m{(i + 1) % files}\n" + "X = 1\n" * 200)
    (root / "train.py").write_text("import torch\nimport lib.m0\n")
    return ["python", "train.py"]


def exchange_round(nodes: int, round_no: int, mine: consistency.Fingerprint, baseline: bool) -> float:
    """Seconds until every node of one round has everyone's fingerprint (or, baseline, one set and one get each)."""
    from torch.distributed import PrefixStore, TCPStore

    host = TCPStore("127.0.0.1", 0, nodes, is_master=True, wait_for_workers=False)
    clients = [host] + [TCPStore("127.0.0.1", host.port, nodes, is_master=False) for _ in range(nodes - 1)]
    stores = [PrefixStore(f"round{round_no}", client) for client in clients]
    start = time.perf_counter()

    def member(rank: int) -> None:
        if baseline:
            stores[rank].set(f"k{rank}", mine.to_json())
            stores[rank].get(f"k{rank}")
        else:
            consistency.exchange(stores[rank], rank, nodes, mine, wait_s=30)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(nodes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--files", type=int, default=50)
    args = parser.parse_args()
    lines = []
    example = timed(lambda: consistency.fingerprint("trainpod.examples.cifar10", ()), args.rounds)
    with tempfile.TemporaryDirectory() as scratch:
        command = script_tree(Path(scratch), args.files)
        script = timed(lambda: consistency.fingerprint(None, command, Path(scratch)), args.rounds)
        described = consistency.script_digest(command, Path(scratch))
    lines.append(f"fingerprint, once per agent: {example * 1000:.1f} ms for a bundled example, {script * 1000:.1f} ms for a "
                 f"script that imports {args.files} local modules ({described})")
    mine = consistency.fingerprint("trainpod.examples.cifar10", ())
    at_two = None
    for nodes in (2, 4, 8):
        check = statistics.median(exchange_round(nodes, r, mine, baseline=False) for r in range(args.rounds))
        base = statistics.median(exchange_round(nodes, r, mine, baseline=True) for r in range(args.rounds))
        lines.append(f"exchange, each round, {nodes} nodes: {check * 1000:.1f} ms against {base * 1000:.1f} ms for one set "
                     f"and get per node ({check / base:.1f}x)")
        at_two = at_two or check
    total = example + at_two
    lines.append(f"at two nodes in all: {total * 1000:.1f} ms of the 100 ms target ({total / 0.1:.2f}x)")
    text = "\n".join(lines)
    print(text)
    results_page.record("consistency", text, title="The consistency check: what comparing every node's software costs",
                        about="Written by `bench/consistency.py`: this node's fingerprint (once per agent) and the exchange "
                              "after each rendezvous round on a real TCPStore, against one set and get per node. See "
                              "[Every node the same software](consistency.md).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
