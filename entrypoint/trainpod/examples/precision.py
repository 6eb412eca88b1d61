"""Which numeric path an example trains on: float32, torch's mixed precision, and NVIDIA Apex where it can run.

    path = choose(amp=True, apex="auto", device=torch.device("cuda", 0))
    path.name              # "torch-fp16+apex-fused"
    with path.autocast(): loss = ...
    scaler = path.grad_scaler()
    optimizer = path.optimizer("adam", params, lr)
    norm = path.layer_norm(64)

- Mixed precision is torch's own: `torch.autocast` (bfloat16 on the CPU; float16 on CUDA, with a
  GradScaler, since float16 gradients underflow where bfloat16's range is float32's).
  `apex.amp` was removed upstream in 2025: nothing here uses it.
- Apex, where it is importable and the device is CUDA, adds its fused kernels: FusedSGD/FusedAdam
  (one kernel for all parameters, via `amp_C`) and FusedLayerNorm. On the CPU Apex cannot run
  (its kernels are CUDA only): the path says "importable, unused without CUDA". Apex missing is
  never an error; asking for it (`--apex on`) where it cannot run is (78).
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass

import torch
from torch import nn

from trainpod.errors import error_for
from trainpod.examples.options import AMP_DTYPES

DTYPES = dict(zip(AMP_DTYPES, (None, torch.bfloat16, torch.float16), strict=True))  # what --amp computes in
MOMENTUM = 0.9


def apex_status() -> str:
    """'importable', or why not (the import error's first line)."""
    try:
        # amp_C holds the fused optimizers' kernels (built with APEX_CUDA_EXT); the order makes a
        # missing Apex say "No module named 'apex'".
        for module in ("apex", "apex.optimizers", "apex.normalization", "amp_C"):
            importlib.import_module(module)
    except Exception as exc:  # ImportError, or an extension built for another torch (OSError, RuntimeError)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"not importable ({type(exc).__name__}: {first})"
    return "importable"


@dataclass(frozen=True)
class Path:
    amp: bool
    dtype: torch.dtype | None  # what autocast computes in; None: float32 throughout
    device: torch.device
    apex: bool  # Apex's fused kernels are used
    apex_note: str  # what became of Apex, for the metrics

    @property
    def name(self) -> str:
        """'fp32', 'torch-bf16', 'torch-fp16', with '+apex-fused' when Apex's kernels run."""
        base = "fp32" if self.dtype is None else f"torch-{'bf16' if self.dtype == torch.bfloat16 else 'fp16'}"
        return base + ("+apex-fused" if self.apex else "")

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """Enabled for float16 only; a disabled scaler is a no-op with the same calls."""
        return torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)

    def optimizer(self, name: str, params, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
        if self.apex:
            from apex.optimizers import FusedAdam, FusedSGD

            if name == "adam":
                return FusedAdam(params, lr=lr, weight_decay=weight_decay)
            return FusedSGD(params, lr=lr, momentum=MOMENTUM, weight_decay=weight_decay)
        if name == "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
        return torch.optim.SGD(params, lr=lr, momentum=MOMENTUM, weight_decay=weight_decay)

    def layer_norm(self, features: int) -> nn.Module:
        if self.apex:
            from apex.normalization import FusedLayerNorm

            return FusedLayerNorm(features)
        return nn.LayerNorm(features)


def choose(
    amp: bool, apex: str | None, device: torch.device, *, dtype: str = "auto", origin: str = "--apex", status: str | None = None
) -> Path:
    """The path for `--amp`, `--amp-dtype` and `--apex auto|on|off` (from `origin`; None: an example
    without the option) on `device`
    (`status`: apex_status(), for tests). dtype "auto" is bfloat16 on the CPU, float16 on CUDA."""
    computes = None if not amp else DTYPES[dtype] or (torch.float16 if device.type == "cuda" else torch.bfloat16)
    if apex is None:
        return Path(amp, computes, device, False, "not used by this example")
    if apex == "off":
        return Path(amp, computes, device, False, "off (--apex off)")
    status = apex_status() if status is None else status
    usable = status == "importable" and device.type == "cuda"
    if apex == "on" and not usable:
        why = status if status != "importable" else "its kernels need CUDA and this rank runs on the CPU"
        raise error_for(origin)(f"{origin}=on: Apex cannot run here: {why}; use auto (Apex where it can run)")
    if usable:
        return Path(amp, computes, device, True, "fused optimizer and layer norm")
    note = "importable, unused without CUDA" if status == "importable" else status
    return Path(amp, computes, device, False, note)
