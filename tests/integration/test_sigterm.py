"""SIGTERM to `trainpod run` (torchrun's agent): the ranks finish the step, save it and exit 143
within the grace; the next run resumes from that step and ends bit-identical to an uninterrupted
run (host: real torchrun, no supervision, no Docker)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.ports import free_port
from fixtures.processes import wait_logged

# One worker runs the module (make test: pytest-xdist, --dist loadgroup): the uninterrupted run is the module fixture
# `reference`, made once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sigterm")]

torch = pytest.importorskip("torch")

from trainpod.contract import LOCK_FILE  # noqa: E402
from trainpod.train.checkpoint import Checkpointer  # noqa: E402

ENTRYPOINT = str(Path(__file__).resolve().parents[2] / "entrypoint")
ARGS = ["--epochs", "2", "--synthetic-samples", "1024", "--batch-size", "32", "--checkpoint-every", "4", "--log-every", "4"]
STEPS = 32  # 2 epochs of 1024 / (2 ranks x 32)
GRACE_S = 25  # trainpod run's default --term-grace
STOPPED = re.compile(r"cifar10-ddp: stopped by SIGTERM at step (\d+); checkpoint of step (\d+) saved$", re.M)


def start(out: Path, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "PET_", "PAI_", "TORCHELASTIC_"))}
    command = [sys.executable, "-m", "trainpod", "run", "--no-supervise", "--nproc-per-node", "2",
               "--master-port", str(free_port()), "--example", "cifar10-ddp", "--", *ARGS, *extra,
               "--output-dir", str(out / "output"), "--checkpoint-dir", str(out / "ckpt")]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    # A session of its own: if the test fails, the agent and its workers are killed together.
    with open(out / "log", "a") as log:
        return subprocess.Popen(command, env={**env, "PYTHONPATH": ENTRYPOINT}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def wait(process: subprocess.Popen, out: Path, timeout: float) -> str:
    return wait_logged(process, out / "log", timeout)


def finish(out: Path, *extra: str) -> tuple[str, dict]:
    process = start(out, *extra)
    log = wait(process, out, 300)
    assert process.returncode == 0, log[-4000:]
    return log, json.loads((out / "output" / "metrics.json").read_text())


def sigterm_after_a_checkpoint(out: Path, *extra: str) -> int:
    """Start a run, SIGTERM it once checkpoint 8 exists; check the stop; return the step it saved."""
    process = start(out, *extra)
    deadline = time.monotonic() + 240
    while not (out / "ckpt" / "ckpt-00000008.json").exists():
        assert process.poll() is None and time.monotonic() < deadline, (out / "log").read_text()[-4000:]
        time.sleep(0.05)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)  # `trainpod run` became the agent: this pid is torchrun's agent
    log = wait(process, out, GRACE_S + 30)
    elapsed = time.monotonic() - signalled

    assert process.returncode == 143, log[-4000:]
    assert elapsed < GRACE_S, elapsed
    stops = STOPPED.findall(log)
    assert len(stops) == 1 and stops[0][0] == stops[0][1], log[-4000:]
    step = int(stops[0][0])
    assert 8 <= step < STEPS
    assert "did not stop within" not in log
    for rank in (0, 1):
        assert f"trainpod: rank {rank} received SIGTERM: stopping after this step" in log

    names = sorted(os.listdir(out / "ckpt"))
    manifests = [name for name in names if name.endswith(".json")]
    assert manifests[-1] == f"ckpt-{step:08d}.json", names
    # no temporary file left behind; the job's lock (trainpod.supervisor.dirlock) stays, marked ended
    assert not [name for name in names if (name.startswith(".") and name != LOCK_FILE) or name.endswith(".tmp")], names
    assert not (out / "output" / "metrics.json").exists()
    return step


def resume(out: Path, step: int, reference: dict, *extra: str) -> dict:
    log, metrics = finish(out, *extra)
    assert f"cifar10-ddp: resumed from the checkpoint of step {step} " in log
    assert metrics["steps"] == STEPS
    assert metrics["rank_checksums"] == [metrics["checksum"]] * 2
    assert metrics["checksum"] == reference["checksum"]
    assert metrics["loss_curve"][-1] == reference["loss_curve"][-1]
    return metrics


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return finish(tmp_path_factory.mktemp("reference"))[1]


def test_sigterm_saves_the_step_and_the_resumed_run_is_bit_identical(tmp_path, reference):
    step = sigterm_after_a_checkpoint(tmp_path)
    resume(tmp_path, step, reference)


def test_amp_with_dataloader_workers_stops_and_resumes(tmp_path, tmp_path_factory):
    # CPU autocast (bfloat16); a worker process per rank, which torchrun's SIGTERM reaches too.
    amp = ("--amp", "--workers", "1")
    step = sigterm_after_a_checkpoint(tmp_path, *amp)
    _, state = Checkpointer(tmp_path / "ckpt", log=lambda _: None).load_latest()
    assert state["scheduler"]["last_epoch"] == step  # the LR schedule is where the run stopped
    assert state["scaler"] == {}  # the grad scaler is for float16 on CUDA; saved (empty) all the same
    _, amp_reference = finish(tmp_path_factory.mktemp("amp-reference"), *amp)
    assert amp_reference["amp"] is True
    resume(tmp_path, step, amp_reference, *amp)
