"""The cifar10-ddp example: its model and data, and the SIGTERM stop of a real run (as a world of one)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from trainpod.errors import ConfigError  # noqa: E402
from trainpod.examples import cifar10, harness  # noqa: E402
from trainpod.train.preemption import EXIT_CODE  # noqa: E402

ENTRYPOINT = str(Path(__file__).resolve().parents[3] / "entrypoint")

# --- the model and the data ---


def test_the_model_takes_cifar_batches_and_an_optional_head_norm():
    assert cifar10.make_model()(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    with_norm = cifar10.make_model(head_norm=torch.nn.LayerNorm(64))
    assert any(isinstance(m, torch.nn.LayerNorm) for m in with_norm.modules())
    assert with_norm(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_synthetic_data_without_a_data_dir():
    args = harness.parse_options(cifar10.RECIPE, ["--synthetic-samples", "64"], env={})
    data = cifar10.load_data(args, lambda _: None)
    assert (data.name, len(data.train), data.num_classes) == ("synthetic", 64, 10)


def test_broken_cifar_batches_are_a_configuration_error(tmp_path):
    from trainpod.examples.cifar_data import TEST_FILE, TRAIN_FILES

    for name in (*TRAIN_FILES, TEST_FILE):
        (tmp_path / name).write_bytes(b"not a pickle")
    args = harness.parse_options(cifar10.RECIPE, ["--data-dir", str(tmp_path)], env={})
    with pytest.raises(ConfigError) as info:
        cifar10.load_data(args, lambda _: None)
    assert "\n" not in str(info.value)


# --- SIGTERM, as a world of one ---


def run_example(tmp_path: Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env.update(PYTHONPATH=ENTRYPOINT, OMP_NUM_THREADS="1", TRAINPOD_PROGRESS="lines")
    command = [sys.executable, "-m", "trainpod.examples.cifar10", "--synthetic-samples", "256", "--batch-size", "8",
               "--epochs", "50", "--log-every", "1", "--output-dir", str(tmp_path / "out"), *args]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop_after_some_steps(process: subprocess.Popen) -> tuple[str, str]:
    try:
        for line in process.stdout:
            if line.startswith("epoch 1/50 step 3/"):
                process.send_signal(signal.SIGTERM)
                break
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == EXIT_CODE, err
    return out, err


@pytest.mark.slow
def test_sigterm_without_a_checkpoint_dir_stops_and_says_nothing_was_saved(tmp_path):
    out, err = stop_after_some_steps(run_example(tmp_path))
    stopped = [line for line in out.splitlines() if "stopped by SIGTERM" in line]
    assert len(stopped) == 1 and stopped[0].endswith("; no --checkpoint-dir: nothing saved"), out
    assert "received SIGTERM: stopping after this step" in err
    assert not (tmp_path / "out").exists()  # no metrics for a run that did not finish
