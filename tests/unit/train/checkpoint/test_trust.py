"""Loading a checkpoint never runs code: the weights-only unpickler, unless the directory is trusted.

The crafted checkpoint is written by trainpod's own saver, so its manifest, size and sha256 verify:
the digest proves the bytes are those written, not that whoever wrote them meant well.
"""

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fixtures.checkpoints import poisoned  # noqa: E402
from trainpod.examples import EXAMPLES, cifar10  # noqa: E402
from trainpod.examples.elastic import ElasticFeed  # noqa: E402
from trainpod.examples.harness import lr_schedule  # noqa: E402
from trainpod.settings import TRUST_CHECKPOINTS  # noqa: E402
from trainpod.train.checkpoint import Checkpointer, CheckpointError  # noqa: E402
from trainpod.train.rng import rng_state  # noqa: E402
from trainpod.train.samplers import ResumableDistributedSampler  # noqa: E402

TRUST_VAR = TRUST_CHECKPOINTS.var
ENTRYPOINT = str(Path(__file__).resolve().parents[4] / "entrypoint")


@pytest.fixture(autouse=True)
def untrusted(monkeypatch):
    monkeypatch.delenv(TRUST_VAR, raising=False)


def test_a_verified_checkpoint_whose_pickle_calls_os_system_is_refused_in_one_line(tmp_path):
    marker = tmp_path / "MARKER"
    path = poisoned(tmp_path / "ckpt", marker)
    lines = []
    with pytest.raises(CheckpointError) as raised:
        Checkpointer(tmp_path / "ckpt", log=lines.append).load_latest()
    message = str(raised.value)
    assert not marker.exists()
    assert raised.value.exit_code == 78  # deterministic: no layer restarts it
    assert "\n" not in message and message.startswith(f"{path}: not loaded: it holds posix.system"), message
    assert f"--trust-checkpoints ({TRUST_VAR}=1)" in message
    assert raised.value.__cause__ is None and raised.value.__suppress_context__  # no traceback of torch's behind it
    assert lines == []  # neither skipped for the clean step 5 (a silent roll-back) nor "resuming"


def test_the_example_ends_with_78_and_one_line_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "MARKER"
    path = poisoned(tmp_path / "ckpt", marker)
    code = cifar10.main(["--checkpoint-dir", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "out"),
                         "--synthetic-samples", "64", "--batch-size", "16"])
    err = capsys.readouterr().err
    assert not marker.exists()
    assert code == 78, err
    assert err.count("\n") == 1 and err.startswith(f"cifar10-ddp: error: {path}: not loaded: it holds posix.system"), err


def test_a_trusted_directory_is_unpickled_in_full_and_says_so_once(tmp_path, monkeypatch):
    marker = tmp_path / "MARKER"
    path = poisoned(tmp_path / "ckpt", marker)
    monkeypatch.setenv(TRUST_VAR, "1")  # what the launch plan gives the ranks for --trust-checkpoints
    lines = []
    ckpt = Checkpointer(tmp_path / "ckpt", log=lines.append)
    step, state = ckpt.load_latest()
    assert step == 7 and torch.equal(state["model"]["w"], torch.ones(3))
    assert marker.exists()  # the flag really lets the file's code run: that is what trusting means
    marker.unlink()
    assert ckpt.load_latest()[0] == 7 and marker.exists()
    trusting = [line for line in lines if "full unpickler" in line]
    assert trusting == [f"{path}: it holds posix.system, which torch.load(weights_only=True) does not allow; loading it "
                        "with the full unpickler, which runs any code a checkpoint carries, as --trust-checkpoints "
                        f"({TRUST_VAR}) trusts {tmp_path / 'ckpt'}"]
    assert lines.count(f"resuming from step 7 ({path})") == 2


def test_the_constructor_overrides_the_variable_and_a_bad_value_is_named(tmp_path, monkeypatch):
    marker = tmp_path / "MARKER"
    poisoned(tmp_path / "ckpt", marker)
    monkeypatch.setenv(TRUST_VAR, "1")
    with pytest.raises(CheckpointError, match="not loaded"):
        Checkpointer(tmp_path / "ckpt", trusted=False, log=lambda line: None).load_latest()
    assert not marker.exists()
    monkeypatch.setenv(TRUST_VAR, "maybe")
    with pytest.raises(CheckpointError) as raised:
        Checkpointer(tmp_path / "ckpt")
    assert raised.value.exit_code == 78
    assert str(raised.value) == f"{TRUST_VAR}='maybe': expected 1, true, yes, on, or 0, false, no, off"


def test_a_type_of_ones_own_is_allowed_for_that_load_only(tmp_path):
    with Checkpointer(tmp_path, log=lambda line: None) as ckpt:
        ckpt.save(1, {"args": argparse.Namespace(lr=0.1), "w": torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"ckpt-00000001\.pt: not loaded: it holds argparse\.Namespace, ") as raised:
        Checkpointer(tmp_path, log=lambda line: None).load_latest()
    assert raised.value.exit_code == 78

    class Registered:  # one the script registered with torch itself: still registered after our scoped load
        pass

    before = set(torch.serialization.get_safe_globals())  # torch registers some of its own types too
    with torch.serialization.safe_globals([Registered]):
        ckpt = Checkpointer(tmp_path, log=lambda line: None, safe_globals=[argparse.Namespace, Registered])
        assert ckpt.load_latest()[1]["args"] == argparse.Namespace(lr=0.1)
        assert set(torch.serialization.get_safe_globals()) == before | {Registered}  # the allowlist as it was
    assert set(torch.serialization.get_safe_globals()) == before


@pytest.mark.slow
@pytest.mark.parametrize("flags,env,expected", [
    ([], {}, "0"),
    (["--trust-checkpoints"], {}, "1"),
    ([], {TRUST_VAR: "yes"}, "1"),
    (["--no-trust-checkpoints"], {TRUST_VAR: "1"}, "0"),  # the flag wins over a variable the ranks would inherit
])
def test_the_launch_plan_gives_the_ranks_the_trust_setting(flags, env, expected):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "PET_", "PAI_", "SLURM_"))}
    result = subprocess.run([sys.executable, "-m", "trainpod", "explain", "--json", *flags, "--", sys.executable, "train.py"],
                            env={**clean, "PYTHONPATH": ENTRYPOINT, **env}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["env"][TRUST_VAR] == expected


@pytest.mark.slow
def test_a_bad_trust_variable_is_one_line_and_78_before_anything_runs():
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "PET_", "PAI_", "SLURM_"))}
    result = subprocess.run([sys.executable, "-m", "trainpod", "run", "--", sys.executable, "train.py"],
                            env={**clean, "PYTHONPATH": ENTRYPOINT, TRUST_VAR: "maybe"}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 78, result.stderr
    assert result.stderr.count("\n") == 1 and f"{TRUST_VAR}='maybe': expected 1, true" in result.stderr, result.stderr


# --- what trainpod itself saves loads without trust ---


def test_every_kind_of_state_trainpod_saves_loads_weights_only(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    states = {}
    for name, optimizer in (("sgd", torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)),
                            ("adam", torch.optim.Adam(model.parameters(), lr=0.01))):
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(20))
        scaler = torch.amp.GradScaler("cpu", enabled=True, init_scale=1024.0)  # an enabled one: not the empty {}
        scaler.scale(model(torch.randn(4, 4)).square().mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        states[name] = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict()}
    sampler = ResumableDistributedSampler(range(100), num_replicas=2, rank=0, seed=3)
    sampler.set_epoch(1)
    sampler.advance(10)
    feed = ElasticFeed(range(100), 2, 0, seed=3)
    feed.started(0)
    feed.ledger.record(1, torch.arange(10))
    feed.commit([feed.ledger.take_pending()])
    state = {"model": model.state_dict(), **states, "sampler": sampler.state_dict(), "elastic": feed.state_dict(),
             "rng": [rng_state(), rng_state()], "loss_curve": [[1, 2.3], [2, 2.1]]}
    assert "numpy" in state["rng"][0]  # the numpy state is in it, as tensors
    with Checkpointer(tmp_path, log=lambda line: None) as ckpt:
        ckpt.save(3, state)
    step, loaded = Checkpointer(tmp_path, log=lambda line: None, trusted=False).load_latest()
    assert step == 3 and loaded["loss_curve"] == state["loss_curve"] and loaded["sampler"] == state["sampler"]
    assert loaded["elastic"] == state["elastic"] and loaded["adam"]["scaler"] == state["adam"]["scaler"]


# ResNet-18 at width 8: what is checked is the checkpoint's loading, the same at any depth and width.
SMALL_IMAGENET = ["--arch", "resnet18", "--width", "8", "--image-size", "32", "--synthetic-samples", "32", "--synthetic-classes", "4",
                  "--workers", "0", "--batch-size", "8"]
EXAMPLE_ARGS = {
    "cifar10-ddp": ["--synthetic-samples", "64", "--batch-size", "16", "--optimizer", "adam"],
    "cifar10-dp": ["--synthetic-samples", "64", "--batch-size", "16"],
    "cifar10-ddp-amp": ["--synthetic-samples", "64", "--batch-size", "16"],
    "imagenet-ddp": SMALL_IMAGENET,
    "imagenet-elastic": SMALL_IMAGENET,
}


def test_every_bundled_example_is_covered():
    assert set(EXAMPLE_ARGS) == set(EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXAMPLE_ARGS))
def test_every_bundled_examples_checkpoint_resumes_without_trust(name, tmp_path, capsys):
    main = importlib.import_module(EXAMPLES[name].module).main
    common = [*EXAMPLE_ARGS[name], "--checkpoint-dir", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "out"),
              "--checkpoint-every", "2", "--log-every", "1"]
    assert main([*common, "--max-steps", "2"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main([*common, "--max-steps", "3"]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert f"{name}: resumed from the checkpoint of step 2" in out + err
    assert "full unpickler" not in out + err
