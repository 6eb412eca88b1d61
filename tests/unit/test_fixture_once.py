"""fixtures.once: a value computed once for the whole run, whichever xdist worker asks first; the others wait and read
it; a computation that fails leaves it to the next one."""

import os
import subprocess
import sys
import textwrap

import pytest

from fixtures.docker_env import REPO
from fixtures.once import once


class Factory:
    def __init__(self, base):
        self.base = base

    def getbasetemp(self):
        return self.base


def test_workers_of_one_run_compute_the_value_once_and_all_read_it(tmp_path, monkeypatch):
    (tmp_path / "popen-gw0").mkdir()
    (tmp_path / "popen-gw1").mkdir()
    calls = []
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    assert once(Factory(tmp_path / "popen-gw0"), "ref", lambda: calls.append(1) or "abc") == "abc"
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert once(Factory(tmp_path / "popen-gw1"), "ref", lambda: calls.append(1) or "other") == "abc"
    assert calls == [1]


def test_a_failed_computation_writes_nothing_and_the_next_one_computes(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)

    def fails():
        raise AssertionError("the reference run failed")

    with pytest.raises(AssertionError):
        once(Factory(tmp_path), "ref", fails)
    assert once(Factory(tmp_path), "ref", lambda: {"checksum": "x"}) == {"checksum": "x"}


def test_a_worker_that_asks_while_another_computes_waits_for_its_value(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO / "tests")!r})
        from pathlib import Path
        from fixtures.once import once
        class F:
            def getbasetemp(self):
                return Path({str(tmp_path)!r})
        def slow():
            print("computing", flush=True)
            time.sleep(1)
            return sys.argv[1]
        print(once(F(), "ref", slow), flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}  # tmp_path itself is the run's base
    first = subprocess.Popen([sys.executable, "-c", script, "first"], stdout=subprocess.PIPE, text=True, env=env)
    assert first.stdout.readline() == "computing\n"  # it holds the lock now
    second = subprocess.run([sys.executable, "-c", script, "second"], capture_output=True, text=True, timeout=30, env=env)
    assert second.stdout == "first\n"  # waited, then read the first one's value, computing nothing
    assert first.communicate(timeout=30)[0] == "first\n"
