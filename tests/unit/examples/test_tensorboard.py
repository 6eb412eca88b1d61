"""trainpod.examples.tensorboard: the scalars a real run of cifar10-ddp (a world of one) writes with --tensorboard, read
back by TensorBoard's own reader; a restarted run's curves show each step once; an unusable directory is one line, 78."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("tensorboardX")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

ENTRYPOINT = str(Path(__file__).resolve().parents[3] / "entrypoint")


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env.update(PYTHONPATH=ENTRYPOINT, OMP_NUM_THREADS="1", TRAINPOD_PROGRESS="lines")
    command = [sys.executable, "-m", "trainpod.examples.cifar10", "--synthetic-samples", "128", "--batch-size", "8",
               "--epochs", "1", "--log-every", "2", "--output-dir", str(tmp_path / "out"), *args]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard shows them (its reader, which applies each file's purge step)."""
    found = event_accumulator.EventAccumulator(str(directory), size_guidance={event_accumulator.SCALARS: 0})
    found.Reload()
    return {tag: [(event.step, event.value) for event in found.Scalars(tag)] for tag in found.Tags()["scalars"]}


@pytest.mark.slow
def test_a_run_writes_loss_throughput_lr_world_and_accuracy_at_its_log_points(tmp_path):
    done = run(tmp_path, "--max-steps", "6", "--tensorboard", str(tmp_path / "tb"))
    assert done.returncode == 0, done.stderr[-3000:]
    found = scalars(tmp_path / "tb")
    assert set(found) == {"train/loss", "train/samples_per_sec", "train/lr", "train/world_size", "test/accuracy"}, found
    assert [step for step, _ in found["train/loss"]] == [1, 2, 4, 6]  # step 1, every --log-every, the last
    assert [value for _, value in found["train/world_size"]] == [1.0] * 4
    assert all(value > 0 for _, value in found["train/loss"] + found["train/lr"])
    assert [step for step, _ in found["test/accuracy"]] == [6] and 0 <= found["test/accuracy"][0][1] <= 1


@pytest.mark.slow
def test_a_resumed_run_shows_each_step_once_as_the_run_that_went_on_trained_it(tmp_path):
    tb, ckpt = tmp_path / "tb", tmp_path / "ckpt"
    first = run(tmp_path, "--max-steps", "6", "--tensorboard", str(tb), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    (ckpt / "ckpt-00000006.json").unlink()  # as if the run died after logging step 6, before its checkpoint committed
    second = run(tmp_path, "--max-steps", "6", "--tensorboard", str(tb), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3")
    assert second.returncode == 0 and "resuming from step 3" in second.stdout + second.stderr, second.stderr[-3000:]
    assert len(list(tb.iterdir())) == 2  # one event file per run
    found = scalars(tb)
    for tag in ("train/loss", "train/lr", "train/world_size"):
        assert [step for step, _ in found[tag]] == [1, 2, 4, 6], found[tag]  # 4 and 6 once: the first run's were purged
    assert [step for step, _ in found["test/accuracy"]] == [6]


@pytest.mark.slow
def test_a_directory_that_cannot_be_written_is_one_line_and_78_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    done = run(tmp_path, "--max-steps", "2", "--tensorboard", str(tmp_path / "file" / "tb"))
    assert done.returncode == 78, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert errors == [f"cifar10-ddp: error: --tensorboard {tmp_path / 'file' / 'tb'}: cannot write there (Not a directory): "
                      "give a writable directory (a volume, in a container with a read-only root)"], done.stderr
    assert "step 1/" not in done.stdout
