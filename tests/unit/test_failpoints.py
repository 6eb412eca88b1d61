"""Failpoints: a real SIGKILL at the named point, once per checkpoint directory."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainpod import failpoints
from trainpod.contract import FAILPOINTS_VAR
from trainpod.errors import ConfigError
from trainpod.train.checkpoint import Checkpointer

ENTRYPOINT = str(Path(__file__).resolve().parents[2] / "entrypoint")
SAVE = """
import sys, torch
from trainpod.train.checkpoint import Checkpointer
with Checkpointer(sys.argv[1]) as ckpt:
    for step in (1, 2, 3):
        ckpt.save(step, {"w": torch.full((1000,), float(step))})
        ckpt.wait()
print("done")
"""


def save_three(directory: Path, spec: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ENTRYPOINT, FAILPOINTS_VAR: spec}
    return subprocess.run([sys.executable, "-c", SAVE, str(directory)], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_checkpoint_write_kills_mid_write_once_and_the_previous_checkpoint_stays(tmp_path):
    first = save_three(tmp_path, "checkpoint-write@2")
    assert first.returncode == -signal.SIGKILL, first.stderr
    assert "failpoint checkpoint-write@2: SIGKILL" in first.stderr
    assert any(name.endswith(".tmp") for name in os.listdir(tmp_path))  # killed between bytes and rename
    step, state = Checkpointer(tmp_path).load_latest()
    assert step == 1 and state["w"][0].item() == 1.0

    second = save_three(tmp_path, "checkpoint-write@2")  # the restarted job runs past it
    assert second.returncode == 0 and "done" in second.stdout, second.stderr
    assert Checkpointer(tmp_path).load_latest()[0] == 3
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path))


@pytest.mark.parametrize("spec", ["checkpoint-write", "checkpoint-write@x", "nope@3"])
def test_a_malformed_variable_is_one_line_naming_it(spec, monkeypatch, tmp_path):
    monkeypatch.setenv(FAILPOINTS_VAR, spec)
    with pytest.raises(ConfigError, match=r"TRAINPOD_FAILPOINTS=.*expected POINT@STEP"):
        Checkpointer(tmp_path)


def test_unset_means_off(monkeypatch):
    monkeypatch.delenv(FAILPOINTS_VAR, raising=False)
    assert failpoints.armed() == {}


def test_crash_raises_at_its_step_every_time_and_nowhere_else(monkeypatch):
    monkeypatch.setenv(FAILPOINTS_VAR, "crash@6")
    failpoints.crash(5)
    for _ in range(2):  # no marker: a node whose ranks always fail there
        with pytest.raises(failpoints.Crash, match="failpoint crash@6"):
            failpoints.crash(6)


def test_pace_makes_each_step_last_at_least_its_milliseconds_and_nothing_unarmed(monkeypatch):
    monkeypatch.setattr(failpoints, "_paced", [0.0])
    monkeypatch.delenv(FAILPOINTS_VAR, raising=False)
    started = time.monotonic()
    for _ in range(3):
        failpoints.pace()
    assert time.monotonic() - started < 0.05
    monkeypatch.setenv(FAILPOINTS_VAR, "pace@100,checkpoint-write@12")
    started = time.monotonic()
    for _ in range(4):  # the first step begins at once; each later one 0.1 s after the one before
        failpoints.pace()
    assert time.monotonic() - started >= 0.3
