"""How many GPUs this node can see, which CUDA torch was built for and which driver the host has,
all without importing torch (explain must work without it)."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping


def visible_gpu_count(env: Mapping[str, str], dev_glob: str = "/dev/nvidia[0-9]*") -> int:
    """GPUs granted to this process: CUDA_VISIBLE_DEVICES when set, else the device nodes.

    A container sees only the /dev/nvidiaN nodes it was given, so counting them matches what
    torch.cuda.device_count() will report, at no import cost.
    """
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        # CUDA stops at the first invalid entry; "-1" (or "NoDevFiles") is the usual "none".
        count = 0
        for entry in entries:
            if entry.startswith("-") or entry.lower() == "nodevfiles":
                break
            count += 1
        return count
    return len([p for p in glob.glob(dev_glob) if re.fullmatch(r".*/nvidia\d+", p)])


def visible_gpus_origin(env: Mapping[str, str], dev_glob: str = "/dev/nvidia[0-9]*") -> str:
    """Where visible_gpu_count's answer comes from, for a message: 'CUDA_VISIBLE_DEVICES=0,1' or the device nodes."""
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}"
    return f"the device nodes {dev_glob}"


# The oldest NVIDIA driver each CUDA major version runs on (NVIDIA's CUDA toolkit release notes,
# "minor version compatibility": any driver of that branch or newer).
MIN_DRIVER_FOR_CUDA = {12: (525, 60, 13), 13: (580,)}
DRIVER_VERSION_FILE = "/proc/driver/nvidia/version"


def torch_cuda_version(field: str = "cuda") -> str | None:
    """The CUDA version torch was built for ('13.0'), None for a CPU build or no torch; read from
    torch/version.py, so that it costs no torch import. `field`: 'hip' for a ROCm build's HIP version."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            with open(os.path.join(folder, "version.py"), encoding="utf-8") as file:
                match = re.search(rf"^{field}\b[^=]*=\s*['\"]([0-9.]+)", file.read(), re.M)
        except OSError:
            continue
        return match.group(1) if match else None
    return None


def parse_driver_version(text: str) -> tuple[int, ...] | None:
    """(580, 65, 6) from /proc/driver/nvidia/version ('... Kernel Module  580.65.06  ...', the open
    modules say 'Open Kernel Module for x86_64  580.65.06') or from nvidia-smi's '580.65.06'."""
    match = re.search(r"(?:Kernel Module(?: for \S+)?\s+|^\s*)(\d{3,})\.(\d+)(?:\.(\d+))?", text, re.M)
    return tuple(int(part) for part in match.groups() if part is not None) if match else None


def nvidia_driver_version(version_file: str = DRIVER_VERSION_FILE) -> tuple[tuple[int, ...] | None, str]:
    """(the host driver's version, where it was read), or (None, what was tried). The kernel
    module's file first (a container given GPUs by the NVIDIA container toolkit sees it too), then
    nvidia-smi; neither needs torch."""
    try:
        with open(version_file, encoding="utf-8", errors="replace") as file:
            version = parse_driver_version(file.read())
        if version:
            return version, version_file
    except OSError:
        pass
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        version = parse_driver_version(out)
        if version:
            return version, "nvidia-smi"
    return None, f"no {version_file}, no nvidia-smi answer"
