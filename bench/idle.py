"""What a node costs while its ranks train: `trainpod run` against bare torchrun, the CPU of everything but the ranks.

Two nodes on this host (--nnodes 1:2, 2 ranks each, cifar10-ddp on the CPU, batch 8), with a real etcd (Debian's
etcd-server, started here) or c10d. Every step lasts at least 500 ms (the failpoint pace@500, which the example
honours under bare torchrun too), so the ranks mostly wait, as in a job whose steps are long: what the launch layers
do meanwhile is what a node pays for them. Once both nodes train, the CPU of each process of the two nodes is read
from /proc over --seconds, and summed by kind:

- the ranks (the example's processes: trainpod's warm ranks, bare torchrun's workers);
- the launch layers (everything else of the node: torchrun's agent; with trainpod also its launcher, supervisord and
  its listener, the fork server and the agent's watches);
- etcd (the rendezvous server both nodes use; none with c10d, whose store an agent hosts).

    python3 bench/idle.py [--seconds 20] [--backends etcd-v3,c10d]

Prints one `bench-idle: {json}` line, then the table: percent of one core, and trainpod's launch layers and etcd
against bare torchrun's (the ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_page

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent / "entrypoint")]

from fixtures.elastic_host import clean_env  # noqa: E402
from fixtures.etcd import EtcdProcess  # noqa: E402
from fixtures.ports import free_port  # noqa: E402

JOB = ["--synthetic-samples", "100000", "--epochs", "1", "--batch-size", "8", "--log-every", "1", "--checkpoint-every", "1000"]
STARTED = re.compile(r"step [5-9]/")  # rank 0's fifth step: both nodes train
TICK = os.sysconf("SC_CLK_TCK")
LAUNCHERS = ("trainpod run", "bare torchrun")


def argv(launcher: str, backend: str, endpoint: str, workdir: Path) -> list[str]:
    rendezvous = ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint]
    paths = ["--checkpoint-dir", str(workdir / "ckpt"), "--output-dir", str(workdir / "out")]
    if launcher == "trainpod run":
        return [sys.executable, "-m", "trainpod", "run", *rendezvous, "--example", "cifar10-ddp", "--", *JOB, *paths]
    return [sys.executable, "-m", "trainpod.rendezvous.torchrun", *rendezvous, "--rdzv-id", f"bare-{workdir.name}",
            "--max-restarts", "3", "--local-addr", "127.0.0.1", "-m", "trainpod.examples.cifar10", *JOB, *paths]


def tree(roots: list[int]) -> dict[int, tuple[str, int]]:
    """pid -> (kind, CPU ticks so far) of `roots` and their descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = {}, list(roots)
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()
        program = os.path.basename(command.split(" ", 1)[0])
        worker = re.fullmatch(r"rank\d+", name) or ("trainpod.examples" in command and "trainpod.rendezvous.torchrun" not in command)
        kind = "etcd" if program.startswith("etcd") else "ranks" if worker else "launch layers"
        found[pid] = (kind, int(fields[11]) + int(fields[12]))
    return found


def measure_one(launcher: str, backend: str, seconds: float, tmp: Path) -> dict[str, float]:
    etcd = None
    if backend == "c10d":
        endpoint = f"127.0.0.1:{free_port()}"
    else:
        etcd = EtcdProcess(tmp / f"etcd-{backend}-{launcher.split()[0]}").start()
        endpoint = etcd.endpoint
    workdir = Path(tempfile.mkdtemp(dir=tmp, prefix=launcher.split()[0] + "-"))
    env = clean_env(TRAINPOD_FAILPOINTS="pace@500")
    logs = [workdir / f"node{n}.log" for n in (0, 1)]
    nodes = [subprocess.Popen(argv(launcher, backend, endpoint, workdir), env=env, stdout=log.open("w"),
                              stderr=subprocess.STDOUT, start_new_session=True) for log in logs]
    try:
        deadline = time.monotonic() + 180
        while not any(STARTED.search(log.read_text()) for log in logs):
            if time.monotonic() > deadline or any(node.poll() is not None for node in nodes):
                sys.exit(f"bench-idle: {launcher} ({backend}) did not train:\n" + "\n".join(log.read_text()[-2000:] for log in logs))
            time.sleep(0.5)
        time.sleep(3)  # past the first steps' own costs
        roots = [node.pid for node in nodes] + ([etcd.proc.pid] if etcd else [])
        before, started = tree(roots), time.monotonic()
        time.sleep(seconds)
        after, took = tree(roots), time.monotonic() - started
        if any(node.poll() is not None for node in nodes):
            sys.exit(f"bench-idle: {launcher} ({backend}) ended while measured:\n" + logs[0].read_text()[-2000:])
        used = {"ranks": 0.0, "launch layers": 0.0, "etcd": 0.0}
        for pid, (kind, ticks) in after.items():
            if pid in before:  # alive through the whole window
                used[kind] += (ticks - before[pid][1]) / TICK
        return {kind: 100 * cpu / took for kind, cpu in used.items()}
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGTERM)
        for node in nodes:
            try:
                node.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
        if etcd:
            etcd.stop()


def report(figures: dict, seconds: float) -> str:
    lines = [f"a 2-node job's processes while its ranks train (this host, 2 ranks per node, steps paced at 500 ms, "
             f"{seconds:g} s; percent of one core)",
             f"  {'backend':9}{'launcher':>15}{'ranks':>8}{'launch layers':>15}{'etcd':>7}{'layers and etcd':>17}{'ratio':>7}"]
    for backend, each in figures.items():
        bare = each["bare torchrun"]["launch layers"] + each["bare torchrun"]["etcd"]
        for launcher in LAUNCHERS:
            f = each[launcher]
            overhead = f["launch layers"] + f["etcd"]
            lines.append(f"  {backend:9}{launcher:>15}{f['ranks']:>7.1f}%{f['launch layers']:>14.1f}%{f['etcd']:>6.1f}%"
                         f"{overhead:>16.1f}%{overhead / bare if bare else float('nan'):>7.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--backends", default="etcd-v3,c10d")
    args = parser.parse_args()
    figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-idle-") as tmp:
        for backend in [b for b in args.backends.split(",") if b]:
            figures[backend] = {launcher: measure_one(launcher, backend, args.seconds, Path(tmp)) for launcher in LAUNCHERS}
    print("bench-idle: " + json.dumps(figures))
    print(report(figures, args.seconds))
    results_page.record("idle", report(figures, args.seconds), title="A node while its ranks train",
                        about="Written by `bench/idle.py`: a 2-node job on one host whose steps are paced at 500 ms, "
                              "`trainpod run` against bare torchrun; the CPU of everything but the ranks.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
