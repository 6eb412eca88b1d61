"""Kill a rank with SIGKILL after a checkpoint: torchrun restarts the worker group, it resumes from
the last checkpoint, and the final weights are bit-identical to an uninterrupted run. For every
bundled example (host: real torchrun and supervisord, no Docker)."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fixtures.ports import free_port
from fixtures.processes import communicate
from trainpod.examples import EXAMPLES

pytestmark = [pytest.mark.slow]

ENTRYPOINT = str(Path(__file__).resolve().parents[2] / "entrypoint")
# ResNet-18 at width 8: a step's cost is mostly its parameters (reduced, stepped, saved), 1/130 of ResNet-50's, and a
# resume is the same at any depth and width. 192 samples, 12 steps an epoch at 2 x 8, 24 in all; the kill follows the
# checkpoint of step 8 or 12, mid-epoch.
SMALL_IMAGENET = ["--arch", "resnet18", "--width", "8", "--image-size", "32", "--synthetic-samples", "192", "--synthetic-classes", "10",
                  "--workers", "1"]
# example -> (its own arguments, processes per node)
JOBS = {
    "cifar10-ddp": (["--epochs", "2", "--synthetic-samples", "1024", "--batch-size", "32"], 2),
    "cifar10-dp": (["--epochs", "1", "--synthetic-samples", "1024", "--batch-size", "32"], 1),
    "cifar10-ddp-amp": (["--epochs", "2", "--synthetic-samples", "1024", "--batch-size", "32"], 2),
    "imagenet-ddp": ([*SMALL_IMAGENET, "--epochs", "2", "--batch-size", "8"], 2),
    "imagenet-elastic": ([*SMALL_IMAGENET, "--epochs", "2", "--batch-size", "8"], 2),
}
COMMON = ["--checkpoint-every", "4", "--log-every", "4"]
# The interrupted run's steps are at least this long (the failpoint pace): from the checkpoint the test waits for to
# the end, 12 steps or more, the seconds the test needs to find the ranks and kill one on a loaded machine, whatever
# a step computes. A pace changes when a step runs, not what it computes: the reference runs unpaced.
PACE = "pace@150"


def start(example: str, out: Path, *extra: str, failpoints: str = "") -> subprocess.Popen:
    args, nproc = JOBS[example]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "PET_", "PAI_"))}
    if failpoints:
        env["TRAINPOD_FAILPOINTS"] = failpoints
    command = [sys.executable, "-m", "trainpod", "run", "--master-port", str(free_port()),
               "--max-restarts", "2", "--restart-backoff", "0.1", "--example", example, "--", *args, *COMMON, *extra,
               "--output-dir", str(out / "output"), "--checkpoint-dir", str(out / "ckpt")]
    if EXAMPLES[example].nproc_per_node is None:
        command[4:4] = ["--nproc-per-node", str(nproc)]
    return subprocess.Popen(command, env={**env, "PYTHONPATH": ENTRYPOINT, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def ranks_of(example: str, checkpoint_dir: Path) -> list[psutil.Process]:
    module = EXAMPLES[example].module

    def is_rank(process):
        cmdline = process.info["cmdline"] or []
        return module in cmdline and str(checkpoint_dir) in cmdline and "trainpod.agent" not in cmdline
    # DataLoader workers are forks with the same command line: a rank is one whose parent is not a rank.
    found = [p for p in psutil.process_iter(["cmdline"]) if is_rank(p)]
    pids = {p.pid for p in found}
    return sorted((p for p in found if p.ppid() not in pids), key=lambda p: p.pid)


def finish(process: subprocess.Popen, out: Path) -> tuple[str, dict]:
    log = communicate(process, timeout=600)
    assert process.returncode == 0, log[-4000:]
    return log, json.loads((out / "output" / "metrics.json").read_text())


def check_trained(example: str, metrics: dict) -> None:
    """The loss fell, the ranks agree, and the metrics say which path ran."""
    assert metrics["example"] == example and metrics["steps"] > 12
    assert metrics["loss_curve"][-1][1] < metrics["loss_curve"][0][1], metrics["loss_curve"]
    assert len(set(metrics["rank_checksums"])) == 1
    if example == "cifar10-ddp-amp":  # on the CPU: bfloat16, and Apex (absent or not) unused
        assert metrics["precision"] == "torch-bf16" and metrics["apex"].startswith(("not importable", "importable, unused"))
    if example == "cifar10-dp":
        assert metrics["world_size"] == 1 and metrics["parallel"] == "dp"


@pytest.mark.parametrize("example", list(JOBS))
def test_sigkill_of_a_rank_resumes_bit_identical(example, tmp_path):
    _, reference = finish(start(example, tmp_path / "a"), tmp_path / "a")
    check_trained(example, reference)

    rng = random.Random(4)  # seeded: which rank dies, and after which checkpoint
    after_step = rng.choice([8, 12])
    out = tmp_path / "b"
    process = start(example, out, failpoints=PACE)
    deadline = time.monotonic() + 300
    while not (out / "ckpt" / f"ckpt-{after_step:08d}.json").exists():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    victims = ranks_of(example, out / "ckpt")
    assert len(victims) == JOBS[example][1]
    victims[rng.randrange(len(victims))].send_signal(signal.SIGKILL)
    log, resumed = finish(process, out)

    assert "was killed by SIGKILL" in log and "restart 1 of 2 without progress" in log
    assert "resumed from the checkpoint of step" in log
    assert resumed["checksum"] == reference["checksum"]
    assert len(set(resumed["rank_checksums"])) == 1
    if EXAMPLES[example].min_nodes:  # elastic: the ledger proves every sample trained once despite the restart
        assert resumed["exactly_once"] and resumed["ledger"]["complete"] == [1, 2], resumed["ledger"]


def test_imagenet_reads_real_jpegs_through_its_decode_path(tmp_path):
    from fixtures.jpeg_tree import make_jpeg_tree

    classes = ["n01440764", "n01443537", "n01484850"]
    make_jpeg_tree(tmp_path / "data" / "train", classes=classes, per_class=16, size=(96, 80), seed=1)
    make_jpeg_tree(tmp_path / "data" / "val", classes=classes, per_class=4, size=(96, 80), seed=2)
    process = start("imagenet-ddp", tmp_path, "--data-dir", str(tmp_path / "data"), "--epochs", "3")
    log, metrics = finish(process, tmp_path)
    assert metrics["dataset"] == "imagefolder" and metrics["train_samples"] == 48 and metrics["test_samples"] == 12
    assert metrics["workers"] == 1 and "dataset: ImageFolder" in log
    assert metrics["loss_curve"][-1][1] < metrics["loss_curve"][0][1]
