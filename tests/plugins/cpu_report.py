"""`pytest -p plugins.cpu_report`: the CPU seconds each test costs the whole machine (/proc/stat: its ranks, agents and
containers too), for deciding where the suite's time goes (make test is CPU-bound on 2 cores). Meaningful with one
test at a time (-n 0) on an otherwise idle host; TP_CPU_REPORT=FILE also writes the table there."""

from __future__ import annotations

import os
import time

import pytest

_rows: list[tuple[float, float, str]] = []


def _busy_s() -> float:
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    busy, started = _busy_s(), time.monotonic()
    yield
    _rows.append((_busy_s() - busy, time.monotonic() - started, item.nodeid))


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        return
    rows = sorted(_rows, reverse=True)
    total = sum(cpu for cpu, _, _ in rows)
    lines = [f"{cpu:8.1f} {wall:8.1f}  {nodeid}" for cpu, wall, nodeid in rows]
    text = "\n".join([f"CPU s    wall s    (total {total:.0f} CPU s, {sum(w for _, w, _ in rows):.0f} s wall)", *lines])
    terminalreporter.write_sep("=", "CPU seconds per test (the whole machine)")
    terminalreporter.write_line(text)
    if os.environ.get("TP_CPU_REPORT"):
        with open(os.environ["TP_CPU_REPORT"], "w") as report:
            report.write(text + "\n")
