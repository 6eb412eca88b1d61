"""What every cluster environment provides: a static detect() and a discover() of this node."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trainpod.errors import invalid
from trainpod.settings import MAX_NODES, MAX_NPROC, Integer, Invalid, Setting, Values, resolve

DEFAULT_MASTER_PORT = 29500

__all__ = ["DEFAULT_MASTER_PORT", "MAX_NODES", "MAX_NPROC", "ClusterEnvironment", "Discovery", "parse_int", "parse_port"]


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
    min_nodes: int | None = None  # an elastic range's MIN (nnodes is its MAX); None: a fixed size
    # The rendezvous the cluster asks for (torchrun's PET_RDZV_*), and the job's identity, from which
    # the rendezvous id is made when none is given (trainpod.rendezvous.ids).
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    job_id: str | None = None
    max_restarts: int | None = None  # a restart budget the cluster sets (PET_MAX_RESTARTS)
    origins: Mapping[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    # field -> one-line error, for values the environment lacks; raised only when no flag supplies them
    missing: Mapping[str, str] = field(default_factory=dict)


class ClusterEnvironment(abc.ABC):
    """One cluster type. Subclasses read only the mapping they are given, never os.environ.

    `settings` declares the flags and variables this source reads besides the cluster's own
    (OpenPAI: --pai-roles/TRAINPOD_PAI_ROLES, ...): the CLI adds them as a group of their own,
    headed by `description`, and resolves them before discover() runs.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    settings: ClassVar[tuple[Setting, ...]] = ()

    def __init__(self, env: Mapping[str, str], flags: Mapping[str, Any] | None = None):
        """`flags`: the command line's values by setting name (None or absent: not given)."""
        self.env = env
        self._flags = dict(flags or {})
        self.options: Values = resolve(self.settings, flags or {}, env)

    @staticmethod
    @abc.abstractmethod
    def detect(env: Mapping[str, str]) -> bool:
        """True when `env` looks like this cluster type. Reads the mapping only."""

    @staticmethod
    def present(env: Mapping[str, str]) -> list[str]:
        """The variables of this source that are set in `env` (for the warning when another source wins)."""
        return []

    @abc.abstractmethod
    def discover(self) -> Discovery:
        """This node's place in the job; raises ConfigError on a bad environment."""

    def setting(self, name: str) -> tuple[Any, str]:
        """One of this source's own settings: (value or None, the flag or variable it came from)."""
        return getattr(self.options, name), self.options.origins[name]



def parse_int(value: str, origin: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    """An integer from a variable or flag, or a one-line error naming where it came from."""
    try:
        return Integer(minimum, maximum)(value)
    except Invalid as bad:
        raise invalid(origin, value, str(bad)) from None


def parse_port(value: str, origin: str) -> int:
    return parse_int(value, origin, minimum=1, maximum=65535)
