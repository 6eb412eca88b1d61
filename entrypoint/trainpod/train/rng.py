"""Training utilities: the random number generator states a checkpoint needs for an exact resume.

    state["rng"] = rng_state()          # python, torch CPU, CUDA (current device), numpy
    ...
    set_rng_state(state["rng"])         # after loading: the same draws as the uninterrupted run

Everything rng_state() returns loads with torch.load(weights_only=True) (the numpy state is stored
as a tensor for this reason), so trainpod.train.checkpoint's verified load reads it without the full
unpickler. In a DDP job every rank has its own states: gather them into rank 0's checkpoint and
restore each rank's own (see trainpod.train.checkpoint's docstring and examples/cifar10.py).
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:
    import numpy as _np
except ImportError:  # torch runs without numpy; so does this module (rng_state() leaves it out)
    _np = None

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> dict:
    """This process's random number generator states: python, torch CPU, CUDA (current device), numpy.

    CUDA's is included only once CUDA is initialised (reading it would otherwise create a context),
    numpy's only if numpy imports. Everything in it loads with torch.load(weights_only=True).
    """
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    if _np is not None:
        np_state = _np.random.get_state(legacy=False)
        if np_state["bit_generator"] == "MT19937":
            state["numpy"] = {
                "key": torch.from_numpy(np_state["state"]["key"].astype(_np.int64)),
                "pos": int(np_state["state"]["pos"]),
                "has_gauss": int(np_state["has_gauss"]),
                "gauss": float(np_state["gauss"]),
            }
    return state


def set_rng_state(state: dict) -> None:
    """Restore what rng_state() returned; generators it does not name (or cannot here) are left alone."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
    if "numpy" in state and _np is not None:
        s = state["numpy"]
        _np.random.set_state(
            {
                "bit_generator": "MT19937",
                "state": {"key": s["key"].cpu().numpy().astype(_np.uint32), "pos": int(s["pos"])},
                "has_gauss": int(s["has_gauss"]),
                "gauss": float(s["gauss"]),
            }
        )
