"""The examples' throughput on the CPU image, DDP scaling, and the ImageNet input pipeline's cost.

Run by bench/run.py inside the two idle compose nodes of bench/compose.yaml (`exec` is its
`docker compose exec`), each measurement beside its baseline in one run:
- samples/s of each bundled example (2 processes, or DataParallel's one, in one container);
- DDP scaling efficiency: cifar10-ddp with 2 processes vs 1 on one node, and 1 process on each
  of 2 compose nodes vs 1 on one node: throughput over the ideal (N x the single one). Both
  compose nodes share this host's cores, so the 2-node figure measures the overhead of crossing
  the network namespace more than a real cluster's scaling;
- input pipeline: imagenet-ddp at 64 px from JPEGs on disk (decoded in DataLoader workers) vs the
  synthetic in-memory set: the ratio is what decoding costs.
"""

from __future__ import annotations

import json
from typing import Callable

CIFAR = "--epochs 8 --max-steps 60 --synthetic-samples 8192 --log-every 20"
IMAGENET = "--image-size 64 --batch-size 16 --max-steps 24 --log-every 8 --synthetic-samples 512 --synthetic-classes 10 --workers 1"
EXAMPLES = {  # example -> (its arguments, processes per node)
    "cifar10-ddp": (CIFAR, 2),
    "cifar10-dp": (CIFAR, 1),
    "cifar10-ddp-amp": (CIFAR, 2),
    "imagenet-ddp": (IMAGENET, 2),
    "imagenet-elastic": (IMAGENET, 2),  # beside imagenet-ddp: what the ledger and the elastic sampler cost
}
JPEGS = "/tmp/bench-jpegs"
# Writes a train/ and val/ tree of real JPEGs with the tests' fixture (tests/fixtures is mounted at /fixtures).
MAKE_JPEGS = (
    "python3 -c \"import sys; sys.path.insert(0, '/fixtures'); from jpeg_tree import make_jpeg_tree; "
    f"[make_jpeg_tree('{JPEGS}/' + s, classes=[f'n{{i:02d}}' for i in range(10)], per_class=n, size=(96, 80), seed=i) "
    "for i, (s, n) in enumerate((('train', 52), ('val', 8)))]\""
)

Exec = Callable[[str, str], dict]  # (service, shell command) -> the metrics of the run it starts


def run_example(run: Exec, example: str, args: str, port: int, *, nproc: int, service: str = "node0", topology: str = "") -> dict:
    nproc_flag = f"--nproc-per-node {nproc} " if example != "cifar10-dp" else ""
    return run(service, f"trainpod run {topology}{nproc_flag}--master-port {port} --example {example} -- "
                        f"--output-dir /tmp/bench-{example} {args}")


def measure(run: Exec, run_pair: Callable[[str, str], dict], prepare: Callable[[str], None]) -> dict:
    """All the figures; `run_pair` starts a command on both nodes and returns global rank 0's metrics."""
    results: dict = {"examples": {}}
    for i, (example, (args, nproc)) in enumerate(EXAMPLES.items()):
        metrics = run_example(run, example, args, 29800 + i, nproc=nproc)
        results["examples"][example] = {"samples_per_sec": metrics["samples_per_sec"], "world_size": metrics["world_size"],
                                        "precision": metrics["precision"]}
    one = run_example(run, "cifar10-ddp", CIFAR, 29810, nproc=1)["samples_per_sec"]
    two = results["examples"]["cifar10-ddp"]["samples_per_sec"]
    topology = "--nnodes 2 --node-rank {rank} --master-addr node0 "
    nodes = run_pair(f"trainpod run {topology}--nproc-per-node 1 --master-port 29811 --example cifar10-ddp -- "
                     f"--output-dir /tmp/bench-2node {CIFAR}", "2 nodes")["samples_per_sec"]
    results["scaling"] = {"one_process": one, "two_processes": two, "two_nodes": nodes,
                          "processes_efficiency": two / (2 * one), "nodes_efficiency": nodes / (2 * one)}
    prepare(MAKE_JPEGS)
    synthetic = results["examples"]["imagenet-ddp"]["samples_per_sec"]
    jpeg = run_example(run, "imagenet-ddp", f"{IMAGENET} --data-dir {JPEGS}", 29812, nproc=2)["samples_per_sec"]
    results["input"] = {"synthetic": synthetic, "jpeg": jpeg, "ratio": jpeg / synthetic}
    return results


def report(results: dict) -> str:
    lines = ["examples on the CPU image (one container; 2 processes, cifar10-dp one)",
             f"  {'example':18}{'samples/s':>12}{'world':>7}  precision"]
    for name, r in results["examples"].items():
        lines.append(f"  {name:18}{r['samples_per_sec']:>12.1f}{r['world_size']:>7}  {r['precision']}")
    s = results["scaling"]
    lines += ["", "DDP scaling, cifar10-ddp (efficiency: throughput over N x one process's)",
              f"  1 process {s['one_process']:.1f} samples/s; 2 processes {s['two_processes']:.1f} "
              f"(efficiency {s['processes_efficiency']:.2f}); 2 compose nodes x 1 process {s['two_nodes']:.1f} "
              f"(efficiency {s['nodes_efficiency']:.2f}; the nodes share this host's cores)"]
    i = results["input"]
    lines += ["", "input pipeline, imagenet-ddp at 64 px, 2 processes, 1 loader worker each",
              f"  JPEGs from disk {i['jpeg']:.1f} samples/s vs synthetic in memory {i['synthetic']:.1f}: ratio {i['ratio']:.2f}"]
    return "\n".join(lines)


if __name__ == "__main__":  # the report of a saved result: python3 bench/examples.py < results.json
    import sys

    print(report(json.load(sys.stdin)))
