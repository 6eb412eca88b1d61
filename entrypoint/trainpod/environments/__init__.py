"""Cluster environments: one small class per source, tried in registry order.

A new source is one new module plus its line here; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Mapping

from trainpod.environments.base import ClusterEnvironment, Discovery
from trainpod.environments.pai import PAIEnvironment
from trainpod.environments.single import SingleNodeEnvironment
from trainpod.environments.torchrun import TorchrunEnvironment
from trainpod.errors import UsageError

# Order matters: the first whose detect() is true wins; single node always detects, so it is last.
REGISTRY: dict[str, type[ClusterEnvironment]] = {
    cls.name: cls for cls in (PAIEnvironment, TorchrunEnvironment, SingleNodeEnvironment)
}


def select(env: Mapping[str, str], forced: str | None = None) -> type[ClusterEnvironment]:
    """The environment class named by `forced` (--source), else the first that detects."""
    if forced:
        if forced not in REGISTRY:
            raise UsageError(f"--source={forced!r}: expected one of {', '.join(REGISTRY)}")
        return REGISTRY[forced]
    return next(cls for cls in REGISTRY.values() if cls.detect(env))


__all__ = ["REGISTRY", "ClusterEnvironment", "Discovery", "select"]
