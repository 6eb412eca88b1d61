"""`make bench`, images: each flavour's size and layers, and its cold and warm build times. Cheap: it
builds nothing. Sizes come from `docker image inspect`/`history`; build times from the record every
build step adds to build/logs/steps.tsv (scripts/step.sh), grouped by make run; the Apex build's own
figures from the report its stage keeps (trainpod-extensions:<flavour>).

    python3 bench/images.py [FLAVOUR...]      (default: the Makefile's FLAVORS)

Cold: the slowest recorded build of the flavour; warm: the fastest recorded build that rebuilt
something (e.g. after a change to trainpod's code). Each line says how many of its docker steps came
from the cache, so a "cold" build that found a shared stage in the cache says so. The Apex line
gives CPU time and the load average beside the wall time: on a shared machine the wall time says
little, and CPU time / cores is what an idle machine would take at best.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = REPO / "build" / "logs" / "steps.tsv"


def flavours() -> list[str]:
    text = (REPO / "Makefile").read_text()
    return re.search(r"^FLAVORS := (.*)$", text, re.M).group(1).split()


def inspect(image: str) -> dict | None:
    out = subprocess.run(["docker", "image", "inspect", image], capture_output=True, text=True)
    return json.loads(out.stdout)[0] if out.returncode == 0 else None


def layers(image: str) -> list[tuple[int, str]]:
    """(size, what) of each layer, oldest first."""
    out = subprocess.run(["docker", "history", "--no-trunc", "--human=false", "--format", "{{json .}}", image],
                         capture_output=True, text=True, check=True).stdout
    found = []
    for entry in reversed([json.loads(line) for line in out.splitlines()]):
        found.append((int(entry["Size"]), describe(entry["CreatedBy"])))
    return found


def describe(created: str) -> str:
    """The Dockerfile instruction of a layer, without the shell and the build arguments in front."""
    if not created:
        return "the OS base image"
    created = re.sub(r"^(\|\d+ \S+ )?/bin/\S+ (-o pipefail )?-c (#\(nop\)\s+)?", "", created)
    return re.sub(r"\s+", " ", created.replace(" # buildkit", "")).strip()


def short(text: str, width: int = 90) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def venv_layer_names(sizes: list[tuple[int, str]]) -> list[str]:
    """Names for the image's layers: the four COPYs of the venv to / are, in order, NVIDIA's CUDA
    wheels, torch, the rest of the venv and the compiled extensions (images/Dockerfile)."""
    names, copies = [], iter(("CUDA wheels (nvidia-*, cuda-*)", "torch + triton", "the rest of the venv",
                              "extensions compiled from source"))
    for _, what in sizes:
        if re.match(r"COPY (dir:\S+ in|\S+/layers/\S+) /$", what):
            names.append(next(copies, what))
        elif "/tmp/trainpod" in what:
            names.append("trainpod's wheel (copied)" if what.startswith("COPY") else "trainpod (pip install)")
        else:
            names.append(short(what))
    return names


def build_runs(flavour: str) -> list[dict]:
    """Each make run that built trainpod:<flavour>: its docker steps' seconds and cache counts."""
    if not STEPS.exists():
        return []
    runs: dict[str, dict] = defaultdict(lambda: {"seconds": 0, "cached": 0, "steps": 0, "parts": {}, "ok": True})
    for line in STEPS.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) < 8:
            continue
        end, run, seconds, code, what, _log, cached, steps = fields[:8]
        ours = (f"the {flavour} builder stage" in what or f"the {flavour} extensions stage" in what
                or what.startswith(f"the {flavour} torch image")
                or what == f"the image trainpod:{flavour}" or what.startswith(f"the {flavour} wheelhouse")
                or what.startswith(f"the {flavour} compilers' wheels"))
        if not ours:
            continue
        record = runs[run or end]
        record["seconds"] += int(seconds)
        record["cached"] += int(cached)
        record["steps"] += int(steps)
        record["parts"][what.split(" (")[0]] = int(seconds)
        record["ok"] = record["ok"] and code == "0"
        record["end"] = int(end)
    # A run counts once its image was built (a run that only made the wheelhouse is no build).
    return [r for r in runs.values() if r["ok"] and any(p.startswith("the image") for p in r["parts"])]


def extension_report(flavour: str) -> dict:
    out = subprocess.run(["docker", "run", "--rm", "--entrypoint", "cat", f"trainpod-extensions:{flavour}",
                          "/opt/trainpod/extensions-report.json"], capture_output=True, text=True)
    try:
        return json.loads(out.stdout) if out.returncode == 0 else {}
    except json.JSONDecodeError:
        return {}


def minutes(seconds: int) -> str:
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def report(names: list[str] | None = None) -> str:
    lines = ["images: size, layers, build times (build/logs/steps.tsv; cold = slowest recorded build, warm = fastest)"]
    for flavour in names or flavours():
        info = inspect(f"trainpod:{flavour}")
        if info is None:
            lines.append(f"\n  trainpod:{flavour}: not built (make image-{flavour})")
            continue
        lines.append(f"\n  trainpod:{flavour}: {info['Size'] / 1e9:.2f} GB ({info['Id'][7:19]})")
        sizes = layers(f"trainpod:{flavour}")
        for (size, _), name in zip(sizes, venv_layer_names(sizes)):
            if size:
                lines.append(f"    {size / 1e6:>9.1f} MB  {name}")
        runs = build_runs(flavour)
        if runs:
            cold = max(runs, key=lambda r: r["seconds"])
            warm = min(runs, key=lambda r: r["seconds"])
            for label, run in (("cold", cold), ("warm", warm)):
                parts = ", ".join(f"{what.removeprefix('the ')} {minutes(s)}" for what, s in run["parts"].items())
                when = time.strftime("%Y-%m-%d %H:%M", time.localtime(run["end"]))
                lines.append(f"    {label} build: {minutes(run['seconds'])} ({parts}; {run['cached']} of {run['steps']} docker "
                             f"steps from the cache; {when})")
        else:
            lines.append("    build times: none recorded in build/logs/steps.tsv yet")
        ext = extension_report(flavour)
        if ext.get("what") == "apex":
            lines.append(f"    Apex: {len(ext['extensions'])} extensions for {ext['torch_cuda_arch_list']} in "
                         f"{minutes(ext['build_seconds'])} on {ext['cpus']} CPUs (MAX_JOBS={ext['max_jobs']}; "
                         f"{minutes(ext.get('cpu_seconds', 0))} of CPU time, load average {ext.get('load_average', 0):.1f} "
                         f"at the end), peak memory "
                         f"{ext['peak_memory_bytes'] / 2**30:.1f} GiB, wheel {ext['wheel_bytes'] / 1e6:.1f} MB "
                         f"({ext['extensions_installed_bytes'] / 1e6:.1f} MB of extensions, no debug info)")
    return "\n".join(lines)


if __name__ == "__main__":
    import results_page

    text = report(sys.argv[1:])
    print(text)
    results_page.record("images", text)
