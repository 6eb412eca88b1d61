"""What every cluster environment provides: a static detect() and a discover() of this node."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from trainpod.errors import ConfigError, UsageError

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class Discovery:
    """What a cluster environment says about this node; None where it says nothing.

    `origins` names, for each field that is set, the variable (or flag) it came from, so that
    `trainpod explain` and every error can point at the exact source of a value.
    """

    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nproc_per_node: int | None = None
    origins: Mapping[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    # field -> one-line error, for values the environment lacks; raised only when no flag supplies them
    missing: Mapping[str, str] = field(default_factory=dict)


class ClusterEnvironment(abc.ABC):
    """One cluster type. Subclasses read only the mapping they are given, never os.environ."""

    name: ClassVar[str]
    description: ClassVar[str]

    def __init__(self, env: Mapping[str, str], flags: Mapping[str, str | None] | None = None):
        self.env = env
        self.flags = {k: v for k, v in (flags or {}).items() if v is not None}

    @staticmethod
    @abc.abstractmethod
    def detect(env: Mapping[str, str]) -> bool:
        """True when `env` looks like this cluster type. Reads the mapping only."""

    @abc.abstractmethod
    def discover(self) -> Discovery:
        """This node's place in the job; raises ConfigError on a bad environment."""

    def setting(self, flag: str, variable: str) -> tuple[str | None, str]:
        """A value from a flag (which wins) or else from a variable, with its origin."""
        if flag in self.flags:
            return self.flags[flag], "--" + flag.replace("_", "-")
        return self.env.get(variable), variable


def parse_int(value: str, origin: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    """An integer from a variable or flag, or a one-line error naming where it came from."""
    error = UsageError if origin.startswith("--") else ConfigError
    text = value.strip()
    try:
        number = int(text)
    except ValueError:
        number = None
    if number is None or number < minimum or (maximum is not None and number > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise error(f"{origin}={value!r}: expected an integer >= {minimum}{upper}")
    return number


def parse_port(value: str, origin: str) -> int:
    return parse_int(value, origin, minimum=1, maximum=65535)
