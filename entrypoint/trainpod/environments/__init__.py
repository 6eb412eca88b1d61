"""Cluster environments: one small class per source, tried in registry order.

A new source is one new module plus its line here: the CLI builds `--source` and the source's
own flags (its `settings`) from this registry.
"""

from __future__ import annotations

from collections.abc import Mapping

from trainpod.environments.base import ClusterEnvironment, Discovery
from trainpod.environments.etcd import EtcdEnvironment
from trainpod.environments.pai import PAIEnvironment
from trainpod.environments.single import SingleNodeEnvironment
from trainpod.environments.slurm import SlurmEnvironment
from trainpod.environments.torchrun import TorchrunEnvironment
from trainpod.settings import Choice, Setting

# Order matters: the first whose detect() is true wins; single node always detects, so it is last.
REGISTRY: dict[str, type[ClusterEnvironment]] = {
    cls.name: cls for cls in (PAIEnvironment, SlurmEnvironment, TorchrunEnvironment, EtcdEnvironment, SingleNodeEnvironment)
}

SOURCE = Setting(
    "source",
    "cluster environment to read; default: the first that detects, in this order: "
    + "; ".join(f"{cls.name}: {cls.description}" for cls in REGISTRY.values()),
    Choice(tuple(REGISTRY)),
    var="TRAINPOD_SOURCE",
)


def select(env: Mapping[str, str], forced: str | None = None) -> type[ClusterEnvironment]:
    """The environment class named by `forced` (already checked against SOURCE), else the first that detects."""
    if forced:
        return REGISTRY[forced]
    return next(cls for cls in REGISTRY.values() if cls.detect(env))


def ignored_sources(env: Mapping[str, str], chosen: type[ClusterEnvironment]) -> list[str]:
    """'torchrun: MASTER_ADDR, NNODES' for each other source whose variables are set too."""
    ignored = []
    for cls in REGISTRY.values():
        names = cls.present(env) if cls is not chosen else []
        if names:
            ignored.append(f"{cls.name}'s {', '.join(names)}")
    return ignored


def unused_settings(chosen: type[ClusterEnvironment], flags: Mapping[str, object], env: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(flags, variables) of other sources' own settings that are given here, where `chosen` reads: a flag is
    a mistake in the command (--pai-roles outside OpenPAI), a variable may be an image's default."""
    given_flags, given_vars = [], []
    for cls in REGISTRY.values():
        for setting in cls.settings if cls is not chosen else ():
            if flags.get(setting.name) is not None:
                given_flags.append(f"{setting.flag} (the {cls.name} source's)")
            elif setting.var and env.get(setting.var, "").strip():
                given_vars.append(setting.var)
    return given_flags, given_vars


def settings() -> list:
    """Every source's own settings, in registry order."""
    return [setting for cls in REGISTRY.values() for setting in cls.settings]


__all__ = ["REGISTRY", "SOURCE", "ClusterEnvironment", "Discovery", "ignored_sources", "select", "settings", "unused_settings"]
