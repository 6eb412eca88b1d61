"""The snapshot save() takes: a copy of the state that shares no memory with it, on the CPU.

Tensors are copied (recursively through dicts, lists and tuples; other values with copy.deepcopy)
into CPU buffers that the next snapshot reuses whenever a tensor has the same shape, dtype and
strides, so a save costs a memcpy, not a fresh allocation and its page faults. GPU tensors go into
pinned buffers, copied without blocking; take() returns once every copy has landed.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

# Values that deepcopy would return unchanged anyway: skip its bookkeeping.
_IMMUTABLE = (int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class Snapshot:
    """A copy of a state that shares no memory with it; tensors on the CPU, in reusable buffers."""

    def __init__(self, spare_state: Any = None):
        self._spare_state = spare_state
        self._memo: dict[int, Any] = {}
        self._filled: set[int] = set()  # spare tensors already used in this snapshot: never fill one twice
        self._pending_devices: set[torch.device] = set()

    def take(self, state: Any) -> Any:
        with torch.no_grad():
            copied = self._copy(state, self._spare_state)
        for device in self._pending_devices:
            torch.cuda.synchronize(device)  # the non-blocking copies must land before save() returns
        return copied

    def _copy(self, obj: Any, spare: Any) -> Any:
        if isinstance(obj, _IMMUTABLE):
            return obj
        key = id(obj)
        if key in self._memo:  # the same object twice (tied weights): one copy, as torch.save would
            return self._memo[key]
        if isinstance(obj, torch.Tensor):
            new = self._tensor(obj, spare)
        elif isinstance(obj, dict):
            # copy.copy keeps the type, order, a defaultdict's factory and attributes such as the
            # _metadata of a state_dict (load_state_dict reads versions from it); values replaced below.
            new = copy.copy(obj)
            self._memo[key] = new
            spare_is_dict = isinstance(spare, dict)
            for k, v in obj.items():
                new[k] = self._copy(v, spare.get(k) if spare_is_dict else None)
            for name, value in getattr(obj, "__dict__", {}).items():
                setattr(new, name, self._copy(value, None))
            return new
        elif type(obj) is list:
            new = []
            self._memo[key] = new
            new.extend(self._copy(v, _item(spare, i)) for i, v in enumerate(obj))
            return new
        elif type(obj) is tuple:
            new = tuple(self._copy(v, _item(spare, i)) for i, v in enumerate(obj))
        elif isinstance(obj, tuple) and hasattr(type(obj), "_make"):  # a namedtuple
            new = type(obj)._make(self._copy(v, _item(spare, i)) for i, v in enumerate(obj))
        else:
            return copy.deepcopy(obj, self._memo)
        self._memo[key] = new
        return new

    def _tensor(self, tensor: torch.Tensor, spare: Any) -> torch.Tensor:
        t = tensor.detach()
        if t.device.type == "meta":
            return t.clone()
        if t.layout != torch.strided or t.is_quantized or type(t) is not torch.Tensor:
            return t.to("cpu", copy=True)  # rare kinds: plain copy, no buffer reuse
        if (
            isinstance(spare, torch.Tensor)
            and id(spare) not in self._filled
            and spare.device.type == "cpu"
            and spare.dtype == t.dtype
            and spare.shape == t.shape
            and spare.stride() == t.stride()
        ):
            dst = spare
        else:
            dst = _empty_cpu_like(t)
        self._filled.add(id(dst))
        non_blocking = t.is_cuda and dst.is_pinned()
        dst.copy_(t, non_blocking=non_blocking)
        if non_blocking:
            self._pending_devices.add(t.device)
        return dst


def _item(spare: Any, i: int) -> Any:
    return spare[i] if isinstance(spare, (list, tuple)) and i < len(spare) else None


def _empty_cpu_like(t: torch.Tensor) -> torch.Tensor:
    if t.is_cuda:
        # Pinned memory makes the device-to-host copy fast and lets it run without blocking.
        with contextlib.suppress(RuntimeError):
            return torch.empty_like(t, device="cpu", pin_memory=True)
    return torch.empty_like(t, device="cpu")
