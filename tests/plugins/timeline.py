"""`pytest -p plugins.timeline` with TP_TIMELINE=FILE: when each test ran and on which worker, for seeing where a
parallel run (pytest-xdist) waits: the workers a test kept busy, and the stretches where fewer than all of them had a
test, at the end above all (a long test that started last). Each worker appends one line per test to FILE (tab-
separated: the worker, the start and end as Unix times, the test's id, including its fixtures' setup and teardown);
the run's end prints a summary of FILE: the seconds with 1, 2, ... workers busy, and the tests that ran last.

    make test PYTEST_ARGS="-p plugins.timeline" TP_TIMELINE=/tmp/timeline.tsv

With TP_DURATIONS=FILE too, the end of the run of the slow layer (the one with the integration tests) also writes each
of its tests' seconds to FILE as JSON (its id without xdist's `@group`): tests/integration/durations.json, from which
that layer starts its longest work first (tests/integration/conftest.py). Refresh it from a whole `make test` run when
tests come or go, or change length.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

_SESSION_START = time.time()  # the summary shows this run's tests only (make test's two layers share FILE)


def without_group(nodeid: str) -> str:
    """A test's id without the `@group` that pytest-xdist's --dist loadgroup appends (durations.json's keys)."""
    return re.sub(r"@[^@\]]*$", "", nodeid)


def _path() -> str | None:
    return os.environ.get("TP_TIMELINE") or None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started = time.time()
    yield
    path = _path()
    if path:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(path, "a") as out:  # one short line per write: appends from several workers stay whole
            out.write(f"{worker}\t{started:.3f}\t{time.time():.3f}\t{item.nodeid}\n")


def pytest_terminal_summary(terminalreporter):
    path = _path()
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or not os.path.exists(path):
        return
    rows = []
    with open(path) as source:
        for line in source:
            worker, start, end, nodeid = line.rstrip("\n").split("\t", 3)
            if float(start) >= _SESSION_START:
                rows.append((float(start), float(end), worker, nodeid))
    if not rows:
        return
    first, last = min(r[0] for r in rows), max(r[1] for r in rows)
    busy: dict[int, int] = {}
    for second in range(int(first), int(last) + 1):
        count = sum(1 for start, end, _, _ in rows if start <= second + 0.5 < end)
        busy[count] = busy.get(count, 0) + 1
    terminalreporter.write_sep("=", f"timeline ({path})")
    terminalreporter.write_line("seconds with N workers busy: " + ", ".join(f"{n}: {s}" for n, s in sorted(busy.items())))
    for start, end, worker, nodeid in sorted(rows, key=lambda r: r[1])[-8:]:
        terminalreporter.write_line(f"{worker:>5} {start - first:7.0f} s to {end - first:7.0f} s  {nodeid}")
    durations = os.environ.get("TP_DURATIONS")
    slow = {without_group(nodeid): round(end - start, 1) for start, end, _, nodeid in rows}
    if durations and any(nodeid.startswith("tests/integration/") for nodeid in slow):  # the slow layer's run
        with open(durations, "w") as out:
            json.dump(dict(sorted(slow.items())), out, indent=0)
            out.write("\n")
        terminalreporter.write_line(f"durations of the slow layer's {len(slow)} tests: {durations}")
