"""The cifar10-ddp example's pieces: --amp, the LR schedule, the checkpointed state, the SIGTERM stop."""

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from trainpod.checkpoint import Checkpointer  # noqa: E402
from trainpod.examples import cifar10  # noqa: E402
from trainpod.preemption import EXIT_CODE, GRACE_VAR  # noqa: E402
from trainpod.rng import rng_state  # noqa: E402
from trainpod.samplers import ResumableDistributedSampler  # noqa: E402

ENTRYPOINT = str(Path(__file__).resolve().parents[3] / "entrypoint")

# --- options ---


def test_amp_is_off_unless_asked():
    assert cifar10.parse_args([], env={}).amp is False
    assert cifar10.parse_args(["--amp"], env={}).amp is True
    assert cifar10.parse_args([], env={"TRAINPOD_AMP": "1"}).amp is True
    assert cifar10.parse_args(["--no-amp"], env={"TRAINPOD_AMP": "yes"}).amp is False  # the flag wins


def test_a_bad_amp_variable_is_named(capsys):
    with pytest.raises(SystemExit) as info:
        cifar10.parse_args([], env={"TRAINPOD_AMP": "maybe"})
    assert info.value.code == 2
    assert "TRAINPOD_AMP='maybe'" in capsys.readouterr().err


def test_a_bad_grace_ends_the_example_with_one_line_and_78(monkeypatch, capsys):
    monkeypatch.setenv(GRACE_VAR, "later")
    before = signal.getsignal(signal.SIGTERM)
    assert cifar10.main([]) == 78
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"cifar10: {GRACE_VAR}='later': ")
    assert signal.getsignal(signal.SIGTERM) is before


# --- the LR schedule ---


@pytest.mark.parametrize("total", [1, 7, 64, 1000])
def test_the_lr_warms_up_then_decays_to_zero(total):
    factor = cifar10.lr_schedule(total)
    warmup = max(1, round(cifar10.WARMUP_FRACTION * total))
    values = [factor(done) for done in range(total + 1)]
    assert all(0 <= v <= 1 for v in values)
    assert values[warmup - 1] == 1.0 and values[0] > 0  # the first step already moves
    assert values[:warmup] == sorted(values[:warmup])
    assert values[warmup - 1 :] == sorted(values[warmup - 1 :], reverse=True)
    assert math.isclose(values[total], 0.0, abs_tol=1e-12) or total == warmup


# --- the checkpointed state ---


def training_state(seed: int, scaler_enabled: bool):
    torch.manual_seed(seed)
    model = cifar10.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cifar10.lr_schedule(40))
    # A CPU scaler that is enabled, so that its state is not the empty dict of a disabled one.
    scaler = torch.amp.GradScaler("cpu", enabled=scaler_enabled, init_scale=1024.0)
    sampler = ResumableDistributedSampler(range(100), num_replicas=1, rank=0, seed=seed)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}, sampler


def train_steps(stateful, sampler, steps: int) -> None:
    model, optimizer, scheduler, scaler = (stateful[k] for k in ("model", "optimizer", "scheduler", "scaler"))
    sampler.set_epoch(1)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(torch.randn(4, 3, 32, 32)).square().mean()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        sampler.advance(4)


def test_resume_restores_scheduler_scaler_optimizer_and_sampler(tmp_path):
    stateful, sampler = training_state(0, scaler_enabled=True)
    train_steps(stateful, sampler, 6)
    stateful["scaler"].update(new_scale=512.0)  # a scale that differs from a fresh scaler's
    with Checkpointer(tmp_path, log=lambda _: None) as checkpointer:
        state = {name: obj.state_dict() for name, obj in stateful.items()}
        checkpointer.save(6, {**state, "sampler": sampler.state_dict(), "rng": [rng_state()], "loss_curve": [[1, 2.3]]})

    fresh, fresh_sampler = training_state(1, scaler_enabled=True)
    step, curve = cifar10.resume(Checkpointer(tmp_path, log=lambda _: None), fresh, fresh_sampler, 0, lambda _: None)
    assert (step, curve) == (6, [[1, 2.3]])
    assert fresh["scheduler"].last_epoch == stateful["scheduler"].last_epoch == 6
    assert fresh["optimizer"].param_groups[0]["lr"] == stateful["optimizer"].param_groups[0]["lr"]
    assert fresh["scaler"].get_scale() == 512.0
    assert fresh_sampler.state_dict() == sampler.state_dict()
    for a, b in zip(fresh["model"].state_dict().values(), stateful["model"].state_dict().values()):
        assert torch.equal(a, b)
    # The next LR is the uninterrupted schedule's.
    fresh["scheduler"].step()
    stateful["scheduler"].step()
    assert fresh["optimizer"].param_groups[0]["lr"] == stateful["optimizer"].param_groups[0]["lr"]


def test_a_disabled_scalers_empty_state_leaves_an_enabled_one_fresh(tmp_path):
    stateful, sampler = training_state(0, scaler_enabled=False)
    assert stateful["scaler"].state_dict() == {}
    with Checkpointer(tmp_path, log=lambda _: None) as checkpointer:
        state = {name: obj.state_dict() for name, obj in stateful.items()}
        checkpointer.save(3, {**state, "sampler": sampler.state_dict(), "rng": [rng_state()], "loss_curve": []})
    fresh, fresh_sampler = training_state(1, scaler_enabled=True)  # --amp turned on for the resumed run
    assert cifar10.resume(Checkpointer(tmp_path, log=lambda _: None), fresh, fresh_sampler, 0, lambda _: None)[0] == 3
    assert fresh["scaler"].get_scale() == 1024.0


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
