"""What the network check (trainpod.agent.netcheck, --netcheck) adds to a launch: its wall time after a rendezvous
round, for 2 and 3 nodes on this host (threads of this process as the agents, over loopback: real sockets, a real
TCPStore, each node's real child process and gloo all-reduce), side by side with the part of it that is starting a
Python process that imports torch, which the child pays first.

    python3 bench/netcheck.py [--rounds 3]

Medians of --rounds; the target is 3 s at two nodes (issue 26). Loopback is faster than any network, so the
figure is the check's fixed cost: on a real link the measuring windows are the same length (bounded).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoint"))

import results_page  # noqa: E402

from trainpod.agent import netcheck  # noqa: E402


def check_round(nodes: int) -> tuple[float, str]:
    """Seconds until every node has the verdict, and node 0's line."""
    from torch.distributed import TCPStore

    round_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    found: dict[int, netcheck.Verdict] = {}

    def node(rank: int) -> None:
        store = round_store if rank == 0 else TCPStore("127.0.0.1", round_store.port, is_master=False, wait_for_workers=False)
        found[rank] = netcheck.check(store, rank, nodes, "lo")

    start = time.perf_counter()
    threads = [threading.Thread(target=node, args=(rank,)) for rank in range(nodes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(verdict.ok for verdict in found.values()), found
    return time.perf_counter() - start, found[0].line


def torch_start() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch.distributed"], check=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    lines = []
    start = statistics.median(torch_start() for _ in range(args.rounds))
    at_two = None
    for nodes in (2, 3):
        runs = [check_round(nodes) for _ in range(args.rounds)]
        seconds = statistics.median(run[0] for run in runs)
        lines.append(f"{nodes} nodes: {seconds:.2f} s, of which {start:.2f} s is a Python process importing "
                     f"torch.distributed ({start / seconds:.0%}); node 0 said: {runs[-1][1]}")
        at_two = at_two or seconds
    lines.append(f"at two nodes: {at_two:.2f} s of the 3 s target ({at_two / 3:.2f}x)")
    text = "\n".join(lines)
    print(text)
    results_page.record("netcheck", text, title="The network check: what --netcheck adds to a launch",
                        about="Written by `bench/netcheck.py`: the check's wall time after a rendezvous round, nodes as "
                              "threads of one process over loopback (each with its real child process and gloo "
                              "all-reduce), beside a Python process's start with torch. See "
                              "[The network check](netcheck.md).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
