"""docs/results.md, the one page of measured figures: each benchmark writes its own section of it.

    import results_page
    results_page.record("recovery", report_text)              # the figures as the benchmark printed them

A section lies between `<!-- results: NAME -->` and `<!-- /results: NAME -->`: a heading and a line on
what is measured (written once, by hand or by the first record), then its records, newest first. Each
record says when (the date, UTC), where (the CPU model and its cores, and the GPU where there is one)
and how (the command that produced it), then the figures. record() puts the new one on top and keeps
the KEEP newest; git keeps the rest.

BENCH_RESULTS=0 writes nothing (a trial run); BENCH_RESULTS=PATH writes that file instead of docs/results.md.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "results.md"
KEEP = 5
RECORD = "<!-- record -->"


def target() -> Path | None:
    """The file to write, or None (BENCH_RESULTS=0)."""
    setting = os.environ.get("BENCH_RESULTS", "").strip()
    if setting == "0":
        return None
    return Path(setting) if setting else PAGE


def cpu() -> str:
    """'Intel(R) Xeon(R) Processor, 2 cores': the CPU model as the kernel names it, and the cores this process may use."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores"


def gpus() -> str:
    """'1 x NVIDIA H100 80GB HBM3 (driver 580.159)', or '' without nvidia-smi or a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    rows = [line.split(",") for line in out.splitlines() if line.strip()]
    if not rows:
        return ""
    names = sorted({row[0].strip() for row in rows})
    return f"{len(rows)} x {' + '.join(names)} (driver {rows[0][-1].strip()})"


def machine() -> str:
    gpu = gpus()
    return cpu() + (f"; {gpu}" if gpu else "")


def command() -> str:
    """This process's command line as run from the repository: `python3 bench/recovery.py --rounds 3`."""
    script = Path(sys.argv[0]).resolve()
    shown = str(script.relative_to(REPO)) if script.is_relative_to(REPO) else sys.argv[0]
    return shlex.join(["python3", shown, *sys.argv[1:]])


def render(body: str, *, command_line: str | None = None, date: str | None = None, where: str | None = None) -> str:
    """One record: a line saying when, where and how, then the figures (a benchmark's report, kept as printed)."""
    when = date or time.strftime("%Y-%m-%d", time.gmtime())
    how = command_line or command()
    return (f"{RECORD}\n**{when}**, {where or machine()}: `{how}`\n\n```text\n{body.strip(chr(10))}\n```\n")


def update(page: str, name: str, record_text: str, title: str, about: str) -> str:
    """The page with `record_text` on top of section NAME's records (the section is added at the end if new)."""
    start, end = f"<!-- results: {name} -->\n", f"<!-- /results: {name} -->"
    found = re.search(re.escape(start) + r"(.*?)" + re.escape(end), page, re.DOTALL)
    if not found:
        section = f"{start}## {title}\n\n{about}\n\n{record_text}\n{end}\n"
        return page.rstrip("\n") + "\n\n" + section
    header, *records = found.group(1).split(RECORD)
    kept = [RECORD + "\n" + r.strip("\n") + "\n" for r in records[:KEEP - 1]]
    section = start + header.rstrip("\n") + "\n\n" + "\n".join([record_text, *kept]) + "\n" + end
    return page[:found.start()] + section + page[found.end():]


def record(name: str, body: str, *, title: str = "", about: str = "", command_line: str | None = None) -> None:
    """Write the figures `body` (plain text, as printed) on top of section NAME of docs/results.md."""
    path = target()
    if path is None:
        return
    page = path.read_text() if path.exists() else "# Results\n"
    path.write_text(update(page, name, render(body, command_line=command_line), title or name, about))
    print(f"results: {name} recorded in {path.relative_to(REPO) if path.is_relative_to(REPO) else path}", file=sys.stderr)
