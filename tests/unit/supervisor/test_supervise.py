"""Supervision: the policy, the generated supervisord configuration, and real supervisord runs."""

import configparser
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.ports import free_port
from trainpod.supervisor.restarts import Failure
from trainpod.supervisor.supervise import Policy, render_config, stop_wait_s

ENTRYPOINT = str(Path(__file__).resolve().parents[3] / "entrypoint")
CLEAN = {k: v for k, v in os.environ.items() if not k.startswith(("PAI_", "PET_", "TRAINPOD_", "MASTER_"))}


def test_the_policy_budget_is_the_one_in_the_supervisors_directory(tmp_path):
    budget = Policy(max_restarts=3, progress_window=5).budget(tmp_path)
    assert (budget.max_restarts, budget.progress_window, budget.path) == (3, 5, tmp_path / "budget.json")
    assert not any(budget.decide(Failure(code)).restart for code in (0, 64, 73, 78, 143))


def test_backoff_doubles_up_to_a_cap():
    policy = Policy(backoff_s=1.5, backoff_max_s=10)
    assert [policy.delay(n) for n in (1, 2, 3, 4, 5)] == [1.5, 3, 6, 10, 10]


def test_config_handles_supervisord_traps(tmp_path):
    text = render_config(["python", "-m", "trainpod", "run", "--", "echo", "100%"], ["python", "-m", "trainpod.supervisor.supervise"],
                         tmp_path, stop_wait_s(25))
    config = configparser.RawConfigParser()
    config.read_string(text)
    job = config["program:job"]
    assert job["autorestart"] == "false"  # supervisord alone would restart a RUNNING program forever
    assert job["stopasgroup"] == job["killasgroup"] == "true"
    assert int(job["stopwaitsecs"]) == 60 > 30  # torchrun's own shutdown takes up to 30 s
    assert job["command"].endswith("echo 100%%")  # supervisord would expand a bare %
    assert config["eventlistener:policy"]["events"] == "PROCESS_STATE_EXITED"
    assert str(tmp_path) in config["unix_http_server"]["file"]


def test_stop_wait_covers_the_grace_and_torchruns_shutdown():
    assert stop_wait_s(10) == 60 and stop_wait_s(45.5) == 76  # 46 s grace + 5 s torchrun margin + the agent's exit


def supervised(*command, restarts="2", env=None, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "trainpod", "run", "--master-port", str(free_port()), "--max-restarts", restarts,
         "--restart-backoff", "0.1", *command],
        env={**CLEAN, "PYTHONPATH": ENTRYPOINT, **(env or {})}, capture_output=True, text=True, timeout=180, **kwargs)


@pytest.mark.slow
def test_a_failing_job_is_restarted_then_exits_with_its_code():
    # A different code each attempt (TORCHELASTIC_RESTART_COUNT: the restarts without progress so far), so
    # that it is never the same failure twice: the budget runs out.
    result = supervised("--", "sh", "-c", "echo attempt; exit $((3 + TORCHELASTIC_RESTART_COUNT))")
    assert result.returncode == 5, result.stderr
    assert result.stdout.count("attempt") == 3
    # A failed rank is restarted by torchrun inside the agent (no backoff), counted against the one budget.
    assert "restarting the worker group: rank 0 exited with 3: restart 1 of 2 without progress" in result.stderr
    assert "restarting the worker group: rank 0 exited with 4: restart 2 of 2 without progress" in result.stderr
    assert "rank 0 exited with 5 after 3 attempt(s), 2 restart(s) without progress (--max-restarts 2): giving up" in result.stderr
    assert "the job exited" not in result.stderr  # the agent decided; the listener only records the code


@pytest.mark.slow
def test_the_same_failure_twice_ends_the_job_after_two_attempts():
    result = supervised("--", "sh", "-c", "echo attempt; exit 3", restarts="5")
    assert result.returncode == 3, result.stderr
    assert result.stdout.count("attempt") == 2
    lines = [line for line in result.stderr.splitlines() if "same failure" in line]
    assert lines == ["[node0] trainpod: the same failure twice without progress (no step reported): not restarting (exit code 3)"]


@pytest.mark.slow
def test_a_configuration_error_is_not_restarted():
    result = supervised("--", "sh", "-c", "echo attempt; exit 78")
    assert result.returncode == 78, result.stderr
    assert result.stdout.count("attempt") == 1
    assert "[node0] trainpod: rank 0 exited with 78 (a configuration error): not restarting" in result.stderr.splitlines()


@pytest.mark.slow
def test_an_unreachable_master_is_retried():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NNODES": "2", "NODE_RANK": "1",
           "TRAINPOD_CONNECT_TIMEOUT": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "trainpod", "run", "--max-restarts", "1", "--restart-backoff", "0.1", "--", "true"],
        env={**CLEAN, "PYTHONPATH": ENTRYPOINT, **env}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 69, result.stderr
    assert result.stderr.count("trainpod: error: master 127.0.0.1") == 2
    assert "the job exited with 69: restart 1 of 1 without progress; starting it again in 0.1s" in result.stderr
    assert "the job exited with 69 after 2 attempt(s), 1 restart(s) without progress (--max-restarts 1): giving up" in result.stderr


@pytest.mark.slow
def test_success_is_zero_and_sigterm_is_143():
    assert supervised("--", "true").returncode == 0
    process = subprocess.Popen(
        [sys.executable, "-m", "trainpod", "run", "--master-port", str(free_port()), "--", "sh", "-c", "echo up; sleep 60"],
        env={**CLEAN, "PYTHONPATH": ENTRYPOINT}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while "up" not in process.stdout.readline():
        assert time.monotonic() < deadline and process.poll() is None
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=90)
    assert process.returncode == 143, stderr
    assert "received SIGTERM" in stderr


@pytest.mark.slow
def test_ctrl_c_in_the_foreground_says_sigint():
    # Issue 24: supervisord stops the job with SIGTERM whatever `trainpod run` was given, and the agent said
    # "received SIGTERM" after a Ctrl-C. A terminal's Ctrl-C signals the foreground process group.
    process = subprocess.Popen(
        [sys.executable, "-m", "trainpod", "run", "--master-port", str(free_port()), "--", "sh", "-c", "echo up; sleep 60"],
        env={**CLEAN, "PYTHONPATH": ENTRYPOINT}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    deadline = time.monotonic() + 60
    while "up" not in process.stdout.readline():
        assert time.monotonic() < deadline and process.poll() is None
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=90)
    assert process.returncode == 130, stderr
    assert "[node0] trainpod: received SIGINT: the workers were stopped" in stderr.splitlines()
    assert "SIGTERM" not in stderr and "death signal" not in stderr  # nor torch's "Received 15 death signal"


@pytest.mark.slow
@pytest.mark.parametrize("bad", [["--max-restarts", "-1"], ["--restart-backoff", "-2"]])
def test_bad_policy_flags(bad):
    result = subprocess.run([sys.executable, "-m", "trainpod", "run", *bad, "--", "true"],
                            env={**CLEAN, "PYTHONPATH": ENTRYPOINT}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 64 and result.stderr.count("\n") == 1
