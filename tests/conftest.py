"""Settings for every test directory."""

import os
import sys
import threading

import pytest
from hypothesis import settings

# testcontainers' reaper (Ryuk) is an image from Docker Hub, which this project never pulls (images are built
# locally, no registry): every Docker-backed test removes its own containers. Set before testcontainers reads it.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

# The property and fuzz tests (tests/unit/test_fuzz.py, tests/unit/jobs, tests/unit/rendezvous) draw new
# inputs on every run where people work, which is how they find new bugs; under CI=true they draw the same
# inputs each time, so that a red CI run is a change in the code, never a new draw (a failure prints its
# reproducer either way).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI") == "true":
    settings.load_profile("ci")


def pytest_collection_finish(session):
    """One intra-op thread for torch in this process, once the test modules imported it: make test runs a process per
    core or more (pytest-xdist), and torch's default of a thread per core in each oversubscribed the machine, where
    OpenMP's idle threads spin: the in-process torch tests took a third more CPU with it and were no faster, even run
    alone (issue 25). The jobs that tests start set their ranks' own (OMP_NUM_THREADS, or trainpod's launch plan)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _rendezvous_heartbeats_end_with_their_test():
    """Stop the keep-alive heartbeat of every torch rendezvous handler a test left in this process. Such a thread
    outlives its test wherever something still holds its handler (a hook in a module's registry, a thread still in a
    round), and once the test's store server is gone it writes the TCPStore client's warning, C++ frames and all, to
    this worker's stderr each second: a later test that reads its own stderr saw 66 lines it never wrote (CI,
    test_preemption after test_node_order's spare test)."""
    yield
    if "torch.distributed.elastic.rendezvous.utils" not in sys.modules:
        return
    for thread in threading.enumerate():
        # torch's _PeriodicTimer runs its thread with its context, whose stop_event ends it at the next interval;
        # Thread keeps its target's arguments until the target returns
        context = next(iter(getattr(thread, "_args", ())), None)
        if thread.name.startswith("RendezvousKeepAliveTimer_") and hasattr(context, "stop_event"):
            context.stop_event.set()
            thread.join(10)


# The quick layer (make test's first: `-m "not slow"`) stays quick only while every test that takes seconds is marked
# slow; the machines are too noisy for a timed assertion, so its end names the ones that took QUICK_S or more.
QUICK_S = 5.0  # one quick test that took longer on a loaded machine (its first import, a collection) stays unnamed
_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration  # setup, call and teardown


def pytest_terminal_summary(terminalreporter, config):
    if os.environ.get("PYTEST_XDIST_WORKER") or "not slow" not in (config.option.markexpr or ""):
        return
    long = sorted((seconds, nodeid) for nodeid, seconds in _seconds.items() if seconds >= QUICK_S)
    if long:
        terminalreporter.write_sep("=", f"{len(long)} test(s) of the quick layer took {QUICK_S:g} s or more: "
                                        "mark them @pytest.mark.slow (tests/README.md)")
        for seconds, nodeid in reversed(long):
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
