"""The examples' shared harness: options, the LR schedule, the checkpointed state, errors as one line."""

import math
import os
import re
import shutil
import signal
import subprocess

import pytest

torch = pytest.importorskip("torch")

from trainpod.errors import ConfigError  # noqa: E402
from trainpod.examples import cifar10, harness, reporting  # noqa: E402
from trainpod.train.checkpoint import Checkpointer  # noqa: E402
from trainpod.train.preemption import GRACE_VAR  # noqa: E402
from trainpod.train.rng import rng_state  # noqa: E402
from trainpod.train.samplers import ResumableDistributedSampler  # noqa: E402

# --- options ---


def test_amp_is_off_unless_asked():
    assert harness.parse_options(cifar10.RECIPE, [], env={}).amp is False
    assert harness.parse_options(cifar10.RECIPE, ["--amp"], env={}).amp is True
    assert harness.parse_options(cifar10.RECIPE, [], env={"TRAINPOD_AMP": "1"}).amp is True
    assert harness.parse_options(cifar10.RECIPE, ["--no-amp"], env={"TRAINPOD_AMP": "yes"}).amp is False  # the flag wins


def test_a_bad_amp_variable_is_named():
    with pytest.raises(ConfigError) as info:
        harness.parse_options(cifar10.RECIPE, [], env={"TRAINPOD_AMP": "maybe"})
    assert info.value.exit_code == 78
    assert str(info.value).startswith("TRAINPOD_AMP='maybe': expected ")


def test_a_bad_option_ends_the_example_with_one_line(capsys):
    assert cifar10.main(["--max-steps", "-5"]) == 64
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cifar10-ddp: error: --max-steps='-5': expected ")


def test_a_bad_grace_ends_the_example_with_one_line_and_78(monkeypatch, capsys):
    monkeypatch.setenv(GRACE_VAR, "later")
    before = signal.getsignal(signal.SIGTERM)
    assert cifar10.main([]) == 78
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"cifar10-ddp: error: {GRACE_VAR}='later': ")
    assert signal.getsignal(signal.SIGTERM) is before


# --- the LR schedule ---


@pytest.mark.parametrize("total", [1, 7, 64, 1000])
def test_the_lr_warms_up_then_decays_to_zero(total):
    factor = harness.lr_schedule(total)
    warmup = max(1, round(harness.WARMUP_FRACTION * total))
    values = [factor(done) for done in range(total + 1)]
    assert all(0 <= v <= 1 for v in values)
    assert values[warmup - 1] == 1.0 and values[0] > 0  # the first step already moves
    assert values[:warmup] == sorted(values[:warmup])
    assert values[warmup - 1 :] == sorted(values[warmup - 1 :], reverse=True)
    assert math.isclose(values[total], 0.0, abs_tol=1e-12) or total == warmup


# --- the checkpointed state ---


def resume(directory, stateful, sampler):
    checkpointer = Checkpointer(directory, log=lambda _: None)
    return harness.TrainState(cifar10.RECIPE, checkpointer, stateful, sampler, 0).resume()


def training_state(seed: int, scaler_enabled: bool):
    torch.manual_seed(seed)
    model = cifar10.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, harness.lr_schedule(40))
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
    step, curve = resume(tmp_path, fresh, fresh_sampler)
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
    assert resume(tmp_path, fresh, fresh_sampler)[0] == 3
    assert fresh["scaler"].get_scale() == 1024.0


def test_a_checkpoint_of_another_model_is_a_configuration_error(tmp_path):
    stateful, sampler = training_state(0, scaler_enabled=False)
    with Checkpointer(tmp_path, log=lambda _: None) as checkpointer:
        state = {name: obj.state_dict() for name, obj in stateful.items()}
        state["model"] = torch.nn.Linear(3, 4).state_dict()
        checkpointer.save(5, {**state, "sampler": sampler.state_dict(), "rng": [rng_state()], "loss_curve": []})
    fresh, fresh_sampler = training_state(1, scaler_enabled=False)
    with pytest.raises(ConfigError) as info:
        resume(tmp_path, fresh, fresh_sampler)
    message = str(info.value)
    assert "\n" not in message and "step 5" in message and str(tmp_path) in message and "--checkpoint-dir" in message


def test_nccl_without_cuda_names_where_it_came_from():
    with pytest.raises(ConfigError, match=r"^TRAINPOD_BACKEND='nccl': expected gloo"):
        harness.parse_options(cifar10.RECIPE, [], env={"TRAINPOD_BACKEND": "nccl"})


def test_recipes_change_common_defaults_only_for_themselves():
    from trainpod.examples import cifar10_amp, cifar10_dp

    assert harness.parse_options(cifar10_amp.RECIPE, [], env={}).amp is True
    assert harness.parse_options(cifar10_dp.RECIPE, [], env={}).batch_size == 128
    assert harness.parse_options(cifar10.RECIPE, [], env={}).batch_size == 64


# --- checkpoints that cannot be used: one line, never a traceback ---


@pytest.mark.parametrize("make,says", [
    (lambda d: d.write_text("x"), "is not a directory"),
    (lambda d: os.symlink(d.name, d), "is a symbolic link loop"),
    (lambda d: (d / "ckpt-00000010.pt").mkdir(parents=True), "is named like a checkpoint file but is a directory"),
])
def test_an_unusable_checkpoint_directory_ends_the_example_with_78_before_training(tmp_path, capsys, make, says):
    directory = tmp_path / "ckpt"
    make(directory)
    assert cifar10.main(["--checkpoint-dir", str(directory), "--output-dir", str(tmp_path)]) == 78
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cifar10-ddp: error: ") and says in err


def test_a_full_disk_stops_the_example_at_once_with_73_and_one_line(tmp_path, capfd):
    if not shutil.which("mount"):
        pytest.skip("no mount(8)")
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(small)], capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        # A checkpoint is about 220 kB: steps 2 and 4 fit, step 6 does not; the run would go on to step 40.
        code = cifar10.main(["--checkpoint-dir", str(small / "ckpt"), "--checkpoint-every", "2", "--max-steps", "40",
                             "--batch-size", "8", "--synthetic-samples", "512", "--log-every", "1", "--output-dir", str(tmp_path)])
        names = sorted(os.listdir(small / "ckpt"))
    finally:
        subprocess.run(["umount", str(small)], check=True)
    out, err = capfd.readouterr()
    assert code == 73, err
    failures = [line for line in err.splitlines() if "could not save" in line]
    assert len(failures) == 1 and "Traceback" not in err, err
    assert "No space left on device; the checkpoint of step 4 is intact (verified): a new run resumes from it" in failures[0]
    steps = [int(m) for m in re.findall(r"step (\d+)/", out + err)]
    assert max(steps) <= 8, steps  # stopped within a step or two of the failed save, not at the next save
    assert names == ["ckpt-00000002.json", "ckpt-00000002.pt", "ckpt-00000004.json", "ckpt-00000004.pt"]


def resume_in_a_world_of_two(rank: int, directory: str, results: str) -> None:
    from pathlib import Path

    import torch.distributed as dist

    from trainpod.train import distributed

    dist.init_process_group("gloo", init_method=f"file://{directory}/pg", rank=rank, world_size=2)
    stateful, sampler = training_state(0, scaler_enabled=False)
    own = Path(directory) / f"rank{rank}"  # each rank a directory of its own: as if not shared
    if rank == 1:
        with Checkpointer(own, log=lambda _: None) as checkpointer:
            state = {name: obj.state_dict() for name, obj in stateful.items()}
            checkpointer.save(8, {**state, "sampler": sampler.state_dict(), "rng": [rng_state()] * 2, "loss_curve": []})
    state = harness.TrainState(cifar10.RECIPE, Checkpointer(own, log=lambda _: None), stateful, sampler, rank)
    try:
        state.resume()
        outcome = "resumed"
    except ConfigError as error:
        outcome = f"{error.exit_code} {error}"
    Path(results, f"{rank}.txt").write_text(outcome)
    # Not destroy_process_group() at once: after all_gather_object gloo may still be freeing on its own
    # thread, and tearing the group down under it aborts the process (trainpod.train.distributed.shutdown).
    distributed.shutdown()


@pytest.mark.slow
def test_ranks_that_found_different_newest_checkpoints_all_stop_with_78(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(resume_in_a_world_of_two, args=(str(tmp_path), str(tmp_path)), nprocs=2, join=True)
    outcomes = [(tmp_path / f"{rank}.txt").read_text() for rank in (0, 1)]
    for outcome in outcomes:
        assert outcome.startswith("78 the ranks found different newest checkpoints"), outcome
        assert "rank 0: none, rank 1: 8" in outcome and "--checkpoint-dir must be one directory shared" in outcome


def weights_of_a_reformed_group(rank: int, directory: str, results: str) -> None:
    from pathlib import Path

    import torch.distributed as dist

    from trainpod.train import distributed

    dist.init_process_group("gloo", init_method=f"file://{directory}/pg", rank=rank, world_size=2)
    torch.manual_seed(rank)  # each rank's own weights, as a script that seeds per rank would make
    model = harness.wrap(cifar10.make_model(), cifar10.RECIPE, torch.device("cpu"), init_sync=False)
    made = reporting.state_dict_checksum(harness.unwrap(model).state_dict())
    harness.broadcast_weights(harness.unwrap(model))
    Path(results, f"{rank}.txt").write_text(f"{made} {reporting.state_dict_checksum(harness.unwrap(model).state_dict())}")
    distributed.shutdown()


@pytest.mark.slow
def test_a_reformed_group_with_no_checkpoint_to_restore_trains_from_rank_0s_weights(tmp_path):
    # A group re-formed in-process makes its DDP model without DDP's broadcast (init_sync=False); where no
    # checkpoint is restored after, the harness broadcasts rank 0's weights itself.
    import torch.multiprocessing as mp

    mp.spawn(weights_of_a_reformed_group, args=(str(tmp_path), str(tmp_path)), nprocs=2, join=True)
    (made0, after0), (made1, after1) = ((tmp_path / f"{rank}.txt").read_text().split() for rank in (0, 1))
    assert made0 != made1  # DDP left each rank's own weights
    assert after0 == after1 == made0  # rank 0's, everywhere


def resume_a_survivor_and_a_replacement(rank: int, directory: str, results: str) -> None:
    from pathlib import Path

    import torch.distributed as dist

    from trainpod.train import distributed, inprocess
    from trainpod.train.checkpoint import files

    dist.init_process_group("gloo", init_method=f"file://{directory}/pg", rank=rank, world_size=2)
    stateful, sampler = training_state(0, scaler_enabled=False)
    shared = Path(directory) / "ckpt"
    copy = inprocess.HostCopy()  # the replacement's (rank 1) is empty, as a new process's
    if rank == 0:  # the survivor saved steps 4 and 8 and kept 8 in memory; 8 went bad on the disk since
        with Checkpointer(shared, log=lambda _: None) as checkpointer:
            for step in (4, 8):
                state = {name: obj.state_dict() for name, obj in stateful.items()}
                state = {**state, "sampler": sampler.state_dict(), "rng": [rng_state()] * 2, "loss_curve": [[step, 1.0]]}
                checkpointer.save(step, state)
        copy.keep(8, state)
        data = shared / files.data_name(8)
        data.write_bytes(b"x" + data.read_bytes()[1:])
    dist.barrier()
    state = harness.TrainState(cifar10.RECIPE, Checkpointer(shared, log=lambda _: None), stateful, sampler, rank,
                               host_copy=copy)
    step, curve = state.resume()
    Path(results, f"{rank}.txt").write_text(f"{step} {curve} {state.resumed}")
    distributed.shutdown()


@pytest.mark.slow
def test_a_survivor_whose_copy_the_replacement_could_not_load_resumes_with_it_from_the_disk(tmp_path):
    # In-process recovery: the survivor's copy in memory is of step 8, the newest manifest, but the replacement
    # found step 8 corrupt and loaded 4: the ranks' steps differ, and the survivor goes to the disk too.
    import torch.multiprocessing as mp

    mp.spawn(resume_a_survivor_and_a_replacement, args=(str(tmp_path), str(tmp_path)), nprocs=2, join=True)
    outcomes = [(tmp_path / f"{rank}.txt").read_text() for rank in (0, 1)]
    assert outcomes[0] == outcomes[1] == "4 [[4, 1.0]] cifar10-ddp: resumed from the checkpoint of step 4 (epoch 0)", outcomes


def test_a_rank_the_checkpoint_had_no_rng_state_for_takes_rank_0s(tmp_path):
    # Scale-up: a world of 1 saved one RNG state; rank 1 of the bigger world resumes from it.
    stateful, sampler = training_state(0, scaler_enabled=False)
    torch.manual_seed(1234)
    saved = rng_state()
    with Checkpointer(tmp_path, log=lambda _: None) as checkpointer:
        state = {name: obj.state_dict() for name, obj in stateful.items()}
        checkpointer.save(4, {**state, "sampler": sampler.state_dict(), "rng": [saved], "loss_curve": []})
    fresh, fresh_sampler = training_state(1, scaler_enabled=False)
    state = harness.TrainState(cifar10.RECIPE, Checkpointer(tmp_path, log=lambda _: None), fresh, fresh_sampler, 1)
    assert state.resume()[0] == 4
    expected = torch.random.get_rng_state()
    torch.manual_seed(1234)
    assert torch.equal(expected, torch.random.get_rng_state())  # rank 0's state, as saved


class _ZeroGradWithoutKeywords(torch.optim.SGD):
    """Apex's FusedSGD and FusedAdam declare `zero_grad(self)`: no set_to_none (found on a GPU host)."""

    def zero_grad(self):
        super().zero_grad()


@pytest.mark.slow
def test_the_harness_steps_an_optimizer_whose_zero_grad_takes_no_keyword(tmp_path, monkeypatch):
    monkeypatch.setattr(harness.precision.Path, "optimizer",
                        lambda self, name, params, lr, weight_decay=0.0: _ZeroGradWithoutKeywords(params, lr=lr))
    assert cifar10.main(["--max-steps", "2", "--batch-size", "8", "--synthetic-samples", "64",
                         "--output-dir", str(tmp_path)]) == 0


# --- a peer that went away: one line, never a traceback ---


@pytest.mark.slow
def test_a_rank_whose_peer_went_away_says_so_in_one_line_and_exits_1(tmp_path):
    # Rank 1 fails at step 3 (its own traceback: its error); rank 0's next collective fails on the closed connection.
    # The agent names the rank that ended and why; rank 0's traceback said nothing more (a 30-line wall at every lost
    # peer, or OOM-killed rank, in the job's output). Its line still tells the agent's policy that it only lost a peer.
    import sys

    from fixtures.ports import free_port
    from trainpod.agent import policy

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "trainpod.examples.cifar10", "--synthetic-samples", "256", "--batch-size", "8",
               "--epochs", "1", "--output-dir", str(tmp_path)]
    ranks = [subprocess.Popen(command, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                            **({"TRAINPOD_FAILPOINTS": "crash@3"} if rank else {})},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    (_, err0), (_, err1) = (rank.communicate(timeout=120) for rank in ranks)
    assert [rank.returncode for rank in ranks] == [1, 1], err0 + err1
    assert "Traceback" in err1 and "failpoint crash@3" in err1  # its own error, in full
    assert "Traceback" not in err0, err0
    lines = err0.strip().splitlines()
    assert re.fullmatch(r"cifar10-ddp: rank 0: .*Connection (closed|reset) by peer.*: a peer rank went away \(its agent "
                        r"says why\)", lines[-1]), err0
    assert policy.PEER_LOST.search(lines[-1])
