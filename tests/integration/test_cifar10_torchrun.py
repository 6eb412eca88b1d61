"""The CIFAR-10 example under a real torchrun on this host: 1 node x 2 processes, gloo, no Docker."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from fixtures.ports import free_port
from trainpod.examples.reporting import summary  # noqa: E402

# One worker runs the module (make test: pytest-xdist, --dist loadgroup): every test reads the runs of the module
# fixture `runs`, made once.
pytestmark = [pytest.mark.xdist_group("cifar10_torchrun")]

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "entrypoint"
TIMEOUT_S = 180


def torchrun_cifar10(output_dir: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "TORCHELASTIC_"))}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE"):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ENTRYPOINT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"  # one thread per rank on 2 cores, the same in every run
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "trainpod.examples.cifar10",
        "--output-dir", str(output_dir), "--epochs", "2", *args,
    ]  # fmt: skip
    # A session of its own, so that a timeout can end torchrun and its workers together.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun ran past {TIMEOUT_S} s\nstdout:\n{stdout}\nstderr:\n{stderr}")
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same job twice; the second also names a data directory that holds no batches."""
    first_out = tmp_path_factory.mktemp("first")
    second_out = tmp_path_factory.mktemp("second")
    empty = tmp_path_factory.mktemp("no-cifar-here")
    first = torchrun_cifar10(first_out)
    second = torchrun_cifar10(second_out, "--data-dir", str(empty))
    return [
        (result, json.loads((out / "metrics.json").read_text()), out, empty) for result, out in ((first, first_out), (second, second_out))
    ]


def test_metrics_describe_the_job(runs):
    _, metrics, _, _ = runs[0]
    assert metrics["example"] == "cifar10-ddp"
    assert metrics["dataset"] == "synthetic"
    assert metrics["backend"] == "gloo"
    assert metrics["world_size"] == 2
    assert metrics["nnodes"] == 1
    assert metrics["epochs"] == 2
    assert metrics["steps"] == 2 * 4096 // (2 * 64)
    assert metrics["samples_per_sec"] > 0
    assert 0 < metrics["time_to_first_step_s"] < metrics["elapsed_s"]
    assert 0 <= metrics["test_accuracy"] <= 1


def test_loss_falls(runs):
    _, metrics, _, _ = runs[0]
    curve = metrics["loss_curve"]
    assert curve[0][0] == 1 and curve[-1][0] == metrics["steps"]
    assert [step for step, _ in curve] == sorted(step for step, _ in curve)
    assert metrics["final_loss"] == curve[-1][1]
    assert curve[0][1] > 2.0  # about ln(10) before any training
    assert metrics["final_loss"] < 0.5 * curve[0][1], curve
    assert metrics["test_accuracy"] > 0.5  # well above chance (0.1)


def test_ranks_agree_on_the_final_weights(runs):
    _, metrics, _, _ = runs[0]
    assert len(metrics["checksum"]) == 64
    assert metrics["rank_checksums"] == [metrics["checksum"]] * 2


def test_the_same_job_gives_the_same_weights(runs):
    (_, first, _, _), (_, second, _, _) = runs
    assert second["checksum"] == first["checksum"]
    assert second["loss_curve"] == first["loss_curve"]


def test_stdout_carries_the_metrics_once_on_its_last_line(runs):
    result, metrics, _, _ = runs[0]
    lines = result.stdout.splitlines()
    metric_lines = [line for line in lines if line.startswith("trainpod-metrics: ")]
    assert len(metric_lines) == 1 and lines[-1] == metric_lines[0]
    # The line is the summary (a few figures, rounded, and where the rest is); metrics.json has everything.
    out = runs[0][2]
    assert json.loads(metric_lines[0][len("trainpod-metrics: ") :]) == summary(metrics, out / "metrics.json")


def test_only_rank_0_reports(runs):
    result, _, out, _ = runs[0]
    assert sorted(os.listdir(out)) == ["metrics.json"]
    # Without a terminal: periodic lines (no bar), each printed once, not once per rank.
    progress = [line for line in result.stdout.splitlines() if line.startswith("epoch ")]
    assert progress and "\r" not in result.stdout
    assert len(progress) == len(set(progress))
    assert progress[-1].startswith("epoch 2/2 step 64/64 loss ")


def test_a_data_dir_without_batches_is_named_and_synthetic_data_used(runs):
    result, metrics, _, empty = runs[1]
    assert metrics["dataset"] == "synthetic"
    notes = [line for line in result.stdout.splitlines() if "no CIFAR-10 python batches" in line]
    assert len(notes) == 1 and str(empty) in notes[0]
