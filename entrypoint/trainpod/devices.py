"""How many GPUs this node can see, without importing torch (explain must work without it)."""

from __future__ import annotations

import glob
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
