"""make bench, launchers: from `trainpod job ... --submit` to the job's first training step, on the SLURM
cluster of compose/slurm and the SSH hosts of compose/ssh, vs `make demo`'s start (`docker compose up`
of compose/pai-2node) to its first step. The same job each time: cifar10-ddp, 2 nodes x 2 processes,
1 epoch of the synthetic set. The clusters are up before the clock starts (a cluster's own start is
not a launch); every container shares this machine's clock, so the first step's wall-clock time in
the job's metrics line is comparable with the time taken here.

    python3 bench/launchers.py          (alone: about 8 minutes)
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROUNDS = 2
JOB = ["cifar10-ddp", "--nodes", "2", "--nproc-per-node", "2"]
EXAMPLE_ARGS = ["--epochs", "1"]
SSH_PREFIX = "10.151.52"


def compose(file: str, *args: str, env: dict | None = None, check: bool = True, timeout: float = 900) -> str:
    done = subprocess.run(["docker", "compose", "-f", str(REPO / "compose" / file / "compose.yaml"), "-p", f"tp-bench-{file}", *args],
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout)
    if check and done.returncode != 0:
        sys.exit(f"bench: docker compose {' '.join(args)} ({file}) failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def first_step(log: str) -> float:
    lines = [line.split("trainpod-metrics: ", 1)[1] for line in log.splitlines() if "trainpod-metrics: " in line]
    if not lines:
        sys.exit(f"bench: no metrics line in:\n{log[-3000:]}")
    return json.loads(lines[-1])["first_step_unix"]


def compose_demo() -> float:
    env = {"TRAINPOD_EPOCHS": "1", "TRAINPOD_SUBNET_PREFIX": "10.151.53"}
    compose("pai-2node", "down", "-v", "-t", "2", env=env, check=False)
    started = time.time()
    compose("pai-2node", "up", "-d", "--no-build", env=env)
    for service in ("node0", "node1"):
        container = compose("pai-2node", "ps", "-a", "-q", service, env=env).strip()
        subprocess.run(["docker", "wait", container], capture_output=True, timeout=900)
    logs = compose("pai-2node", "logs", "--no-color", "--no-log-prefix", env=env)
    compose("pai-2node", "down", "-v", "-t", "2", env=env, check=False)
    return first_step(logs) - started


def slurm_up() -> None:
    compose("slurm", "up", "-d", "--build", "--wait")
    for _ in range(60):
        if compose("slurm", "exec", "-T", "slurmctld", "sinfo", "-h", "-t", "idle", "-o", "%D").strip() == "2":
            return
        time.sleep(1)
    sys.exit("bench: the SLURM nodes never became idle")


def slurm_once(round_: int) -> float:
    output = f"/shared/bench{round_}"
    started = time.time()
    submitted = compose("slurm", "exec", "-T", "-u", "trainpod", "slurmctld", "trainpod", "job", "slurm", *JOB, "--cpus", "2",
                        "--submit", "--", *EXAMPLE_ARGS, "--output-dir", output)
    job = re.search(r"Submitted batch job (\d+)", submitted)[1]
    while True:
        state = re.search(r"JobState=(\w+)", compose("slurm", "exec", "-T", "slurmctld", "scontrol", "show", "job", job, "-o"))[1]
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            break
        time.sleep(1)
    log = compose("slurm", "exec", "-T", "slurmctld", "cat", f"/shared/trainpod-cifar10-ddp-{job}.out")
    if state != "COMPLETED":
        sys.exit(f"bench: SLURM job {job} {state}:\n{log[-3000:]}")
    return first_step(log) - started


def ssh_up(keys: Path) -> list[str]:
    import asyncssh

    key = asyncssh.generate_private_key("ssh-ed25519")
    key.write_private_key(str(keys / "key"))
    os.chmod(keys / "key", 0o600)
    env = {"SSH_AUTHORIZED_KEY": key.export_public_key().decode().strip(), "TRAINPOD_SUBNET_PREFIX": SSH_PREFIX}
    compose("ssh", "up", "-d", "--build", "--wait", env=env)
    hosts, known = [f"{SSH_PREFIX}.11", f"{SSH_PREFIX}.12"], []
    for service, address in zip(("host1", "host2"), hosts):
        for _ in range(60):
            found = subprocess.run(["docker", "compose", "-f", str(REPO / "compose/ssh/compose.yaml"), "-p", "tp-bench-ssh", "exec", "-T",
                                    service, "cat", "/etc/ssh/ssh_host_ed25519_key.pub"],
                                   capture_output=True, text=True, env={**os.environ, **env})
            if found.returncode == 0:
                break
            time.sleep(0.5)
        known.append(f"{address} {' '.join(found.stdout.split()[:2])}")
    (keys / "known_hosts").write_text("\n".join(known) + "\n")
    return hosts


def ssh_once(keys: Path, hosts: list[str], round_: int) -> float:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINPOD_")}, "PYTHONPATH": str(REPO / "entrypoint")}
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "trainpod", "job", "ssh", *JOB, "--hosts", ",".join(f"trainpod@{h}" for h in hosts),
                           "--no-docker", "--identity", str(keys / "key"), "--known-hosts", str(keys / "known_hosts"),
                           "--log-dir", str(keys / f"logs{round_}"), "--submit", "--", *EXAMPLE_ARGS, "--output-dir", "/tmp/bench"],
                          capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        sys.exit(f"bench: trainpod job ssh failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return first_step(done.stdout) - started


def measure() -> dict:
    results: dict[str, list[float]] = {"compose": [], "slurm": [], "ssh": []}
    slurm_up()
    try:
        for round_ in range(ROUNDS):
            results["slurm"].append(slurm_once(round_))
    finally:
        compose("slurm", "down", "-v", "-t", "5", check=False)
    with tempfile.TemporaryDirectory() as keys:
        hosts = ssh_up(Path(keys))
        try:
            for round_ in range(ROUNDS):
                results["ssh"].append(ssh_once(Path(keys), hosts, round_))
        finally:
            compose("ssh", "down", "-v", "-t", "2", env={"TRAINPOD_SUBNET_PREFIX": SSH_PREFIX}, check=False)
    for _ in range(ROUNDS):
        results["compose"].append(compose_demo())
    return results


def report(results: dict) -> str:
    lines = [f"launch to the first training step (cifar10-ddp, 2 nodes x 2 processes; median of {ROUNDS} runs, the clusters already up)"]
    names = {"compose": "docker compose up (make demo)", "slurm": "trainpod job slurm --submit", "ssh": "trainpod job ssh --submit"}
    base = statistics.median(results["compose"])
    for key, name in names.items():
        median = statistics.median(results[key])
        runs = ", ".join(f"{r:.1f}" for r in results[key])
        lines.append(f"  {name:34}{median:>7.1f} s  (runs: {runs}; vs compose {median - base:+.1f} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    import results_page

    figures = measure()
    print("bench-launchers: " + json.dumps(figures))
    print(report(figures))
    results_page.record("launchers", report(figures))
