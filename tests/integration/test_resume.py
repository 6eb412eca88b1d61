"""Kill a rank with SIGKILL mid-training: supervision restarts the job, it resumes from the last
checkpoint, and the final weights are bit-identical to an uninterrupted run (host: real torchrun
and supervisord, no Docker)."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.slow]

ENTRYPOINT = str(Path(__file__).resolve().parents[2] / "entrypoint")
ARGS = ["--epochs", "2", "--synthetic-samples", "1024", "--batch-size", "32", "--checkpoint-every", "4", "--log-every", "4"]


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(out: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "PET_", "PAI_"))}
    command = [sys.executable, "-m", "trainpod", "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               "--max-restarts", "2", "--restart-backoff", "0.1", "--example", "cifar10-ddp", "--", *ARGS,
               "--output-dir", str(out / "output"), "--checkpoint-dir", str(out / "ckpt")]
    return subprocess.Popen(command, env={**env, "PYTHONPATH": ENTRYPOINT}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def ranks_of(checkpoint_dir: Path) -> list[psutil.Process]:
    def is_rank(process):
        cmdline = " ".join(process.info["cmdline"] or [])
        return "trainpod.examples.cifar10" in cmdline and str(checkpoint_dir) in cmdline and "trainpod.agent" not in cmdline
    return sorted((p for p in psutil.process_iter(["cmdline"]) if is_rank(p)), key=lambda p: p.pid)


def finish(process: subprocess.Popen, out: Path) -> tuple[str, dict]:
    log, _ = process.communicate(timeout=300)
    assert process.returncode == 0, log[-4000:]
    return log, json.loads((out / "output" / "metrics.json").read_text())


def test_sigkill_of_a_rank_resumes_bit_identical(tmp_path):
    _, reference = finish(start(tmp_path / "a"), tmp_path / "a")

    rng = random.Random(4)  # seeded: which rank dies, and after which checkpoint
    after_step = rng.choice([8, 12, 20])
    out = tmp_path / "b"
    process = start(out)
    deadline = time.monotonic() + 240
    while not (out / "ckpt" / f"ckpt-{after_step:08d}.json").exists():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    victims = ranks_of(out / "ckpt")
    assert len(victims) == 2
    victims[rng.randrange(2)].send_signal(signal.SIGKILL)
    log, resumed = finish(process, out)

    assert "was killed by SIGKILL" in log and "restart 1 of 2 without progress" in log
    assert "resumed from the checkpoint of step" in log
    assert resumed["checksum"] == reference["checksum"]
    assert len(set(resumed["rank_checksums"])) == 1
