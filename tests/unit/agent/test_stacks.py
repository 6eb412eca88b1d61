"""trainpod.agent.stacks and the ranks' side of it in trainpod.train.progress: reading stacks, with and without ptrace."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainpod.agent import stacks
from trainpod.agent.hang import Frame
from trainpod.contract import AGENT_PID_VAR, PROGRESS_DIR_VAR
from trainpod.train import progress

ENTRYPOINT = str(Path(__file__).resolve().parents[3] / "entrypoint")

PYSPY_JSON = json.dumps([
    {"pid": 41, "thread_id": 7, "thread_name": "trainpod-progress-dumps", "os_thread_id": 45,
     "frames": [{"name": "_serve_dumps", "filename": "/app/trainpod/train/progress.py", "line": 111}]},
    {"pid": 41, "thread_id": 9, "thread_name": "MainThread", "os_thread_id": 41,
     "frames": [{"name": "all_reduce", "filename": "/v/torch/distributed/distributed_c10d.py", "line": 3252},
                {"name": "main", "filename": "/app/train.py", "line": 40}]},
])

FAULTHANDLER = """main thread 0x00007f25a63cdb80
Current thread 0x00007f257dda96c0 (most recent call first):
  File "/app/trainpod/train/progress.py", line 129 in dump
  File "/usr/lib/python3.11/threading.py", line 982 in run

Thread 0x00007f25a63cdb80 (most recent call first):
  File "/app/train.py", line 30 in load
  File "/app/train.py", line 52 in main
"""


def test_py_spy_json_names_the_main_thread_and_renders_it_first():
    stack = stacks.parse_pyspy(PYSPY_JSON, pid=41)
    assert stack.main == (Frame("all_reduce", "/v/torch/distributed/distributed_c10d.py", 3252), Frame("main", "/app/train.py", 40))
    assert stack.render().splitlines()[:2] == ['Thread 41 "MainThread" (main):',
                                               "    all_reduce (/v/torch/distributed/distributed_c10d.py:3252)"]


def test_faulthandler_text_names_the_main_thread_by_the_first_line():
    stack = stacks.parse_faulthandler(FAULTHANDLER)
    assert stack.main == (Frame("load", "/app/train.py", 30), Frame("main", "/app/train.py", 52))
    assert len(stack.threads) == 2 and stack.source == "faulthandler"


def test_no_py_spy_is_said_and_a_refusal_is_told_apart(tmp_path):
    assert stacks.pyspy(os.getpid(), None).error == "py-spy is not installed"
    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\necho 'Error: Permission denied (os error 13)' >&2\nexit 1\n")
    fake.chmod(0o755)
    stack = stacks.pyspy(os.getpid(), str(fake))
    assert stack.refused and "Permission denied" in stack.error


RANK = textwrap.dedent("""
    import time
    from trainpod.train import progress
    progress.step(3)
    def wait_for_data():
        print("ready", flush=True)
        time.sleep(60)
    wait_for_data()
""")
# "ready" is said from inside wait_for_data, where the tests look for the main thread: said before the call, it
# reached a test that then read the stack while the main thread was still at the module's level (a loaded machine).


@pytest.fixture
def rank(tmp_path):
    """A Python 'rank' that reported a step and now sleeps: it serves dump requests."""
    env = {**os.environ, "PYTHONPATH": ENTRYPOINT, PROGRESS_DIR_VAR: str(tmp_path), "LOCAL_RANK": "0", "RANK": "5"}
    process = subprocess.Popen([sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"
    yield process
    process.kill()
    process.wait()


def test_a_rank_that_uses_progress_dumps_its_own_stack_without_ptrace(rank, tmp_path):
    assert progress.read(tmp_path)[0].step == 3
    # Its dump thread starts with its first progress.step(): on a busy machine it may not be serving
    # yet when "ready" arrives (the agent asks only after a long stall). Ask until it serves, up to 20 s.
    deadline = time.monotonic() + 20
    while "serves no dump requests" in (stack := stacks.own_dump(tmp_path, 0, tmp_path / "stack.txt")).error:
        assert time.monotonic() < deadline, stack
        time.sleep(0.05)
    assert stack.source == "faulthandler" and stack.main[0].function == "wait_for_data", stack
    assert stack.main[0].file == "<string>"


def test_py_spy_reads_a_sibling_process_without_stopping_it(rank):
    executable = stacks.pyspy_path()
    if not executable:
        pytest.skip("py-spy is not installed (requirements-dev.txt)")
    stack = stacks.pyspy(rank.pid, executable)
    assert stack.main and stack.main[0].function == "wait_for_data", stack
    assert rank.poll() is None


def test_a_request_to_a_rank_without_the_thread_is_refused_at_once(tmp_path):
    started = time.monotonic()
    assert not stacks.request(tmp_path, 3, stack=tmp_path / "x")
    assert "does not use trainpod.train.progress" in stacks.own_dump(tmp_path, 3, tmp_path / "x").error
    assert time.monotonic() - started < 1.9  # refused at once, not after own_dump's 2 s


def test_yama_at_1_names_the_agent_as_tracer_and_nothing_else_does(tmp_path, monkeypatch):
    calls = []

    class Libc:
        def prctl(self, *args):
            calls.append(args)
            return 0

    monkeypatch.setattr("ctypes.CDLL", lambda *a, **k: Libc())
    monkeypatch.setenv(AGENT_PID_VAR, "4242")
    scope = tmp_path / "ptrace_scope"
    for value, expected in (("0", False), ("2", False), ("1", True)):
        scope.write_text(value + "\n")
        assert progress.allow_agent_to_trace(str(scope)) is expected
    assert calls == [(progress.PR_SET_PTRACER, 4242, 0, 0, 0)]
    assert progress.allow_agent_to_trace(str(tmp_path / "missing")) is False
