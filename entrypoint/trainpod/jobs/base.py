"""What every job renderer gets (a JobRequest) and provides (render, and submit where it can).

The write-side mirror of environments/: an environment reads a scheduler's variables on a node;
a renderer writes the job file that makes the scheduler set them. Both are one small class per
scheduler with its own settings, in a registry.
"""

from __future__ import annotations

import abc
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trainpod.errors import UsageError, error_for
from trainpod.examples import Example
from trainpod.jobs.values import printable, shell_line
from trainpod.settings import TERM_GRACE, Setting, Values, resolve
from trainpod.supervisor.supervise import stop_wait_s
from trainpod.text import number

MASTER_PORT_VAR = "TRAINPOD_JOB_MASTER_PORT"  # the schedulers that choose the master's port (kubeflow, ssh)


@dataclass(frozen=True)
class JobRequest:
    """One job of a bundled example, as `trainpod job` was asked for it; every renderer writes this."""

    example: Example
    nodes: int
    gpus: int  # per node; 0: CPU
    nproc_per_node: int | None  # None: decided on the node (one per visible GPU)
    backend: str | None  # None: decided on the node (nccl with GPUs, else gloo)
    image: str
    name: str
    cpus: int  # per node
    memory_mb: int  # per node
    shm_mb: int
    term_grace: float
    rdzv_endpoint: str | None = None  # an elastic example's etcd endpoints (host:port[,...]); None: the scheduler's way
    spares: int = 0  # an elastic example's nodes started beyond `nodes`, each a hot spare (trainpod run --spares)
    args: tuple[str, ...] = ()  # the example's own flags (after --)
    command_line: tuple[str, ...] = ()  # the `trainpod job ...` argv that asked for it, for the file's header
    origins: Mapping[str, str] = field(default_factory=dict)

    @property
    def processes_per_node(self) -> int:
        """How many ranks each node will run: what `trainpod run` resolves on the node."""
        if self.example.nproc_per_node:
            return self.example.nproc_per_node
        if self.nproc_per_node:
            return self.nproc_per_node
        return self.gpus or 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def elastic(self) -> bool:
        """An elastic example: its nodes may leave and join while it trains."""
        return self.example.min_nodes is not None

    @property
    def started(self) -> int:
        """How many nodes the scheduler starts: the job's and its spares."""
        return self.nodes + self.spares

    @property
    def node_range(self) -> tuple[int, int]:
        """(fewest, most) nodes it trains on: the example's range, widened to take in --nodes. With spares the most is
        --nodes: a node started beyond it waits as a spare instead of training."""
        if not self.elastic:
            return self.nodes, self.nodes
        if self.spares:
            return min(self.example.min_nodes, self.nodes), self.nodes
        return min(self.example.min_nodes, self.nodes), max(self.example.max_nodes or self.nodes, self.nodes)

    @property
    def effective_backend(self) -> str:
        return self.backend or ("nccl" if self.gpus else "gloo")

    @property
    def stop_grace_s(self) -> int:
        """Seconds a node needs to stop after SIGTERM: the ranks' grace plus torchrun's and supervisord's
        margin, as long as supervisord waits before it kills (at least 60)."""
        return stop_wait_s(self.term_grace)

    def run_flags(self) -> list[str]:
        """`trainpod run`'s flags for this job: only what the node cannot decide itself."""
        flags = ["--example", self.example.name]
        if self.backend:
            flags += ["--backend", self.backend]
        if self.nproc_per_node and not self.example.nproc_per_node:
            flags += ["--nproc-per-node", str(self.nproc_per_node)]
        if self.term_grace != TERM_GRACE.default:
            flags += ["--term-grace", number(self.term_grace)]
        if self.elastic and (self.rdzv_endpoint or self.spares):
            # The range as a flag, which wins over a scheduler's variable (the operator's PET_NNODES counts the spares).
            flags += ["--nnodes", "{}:{}".format(*self.node_range)]
        if self.elastic and self.rdzv_endpoint:
            # The nodes meet in etcd over its v3 API (any etcd from 3.4 on): no node is the rendezvous.
            flags += ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", self.rdzv_endpoint]
        if self.spares:
            flags += ["--spares", str(self.spares)]
        return flags

    def run_argv(self, *extra: str) -> list[str]:
        """`trainpod run ...` as an argv: the flags, then `extra`, then -- and the example's own flags."""
        argv = ["trainpod", "run", *self.run_flags(), *extra]
        if self.args:
            argv += ["--", *self.args]
        return argv

    def run_command(self, *extra: str) -> str:
        return shlex.join(self.run_argv(*extra))

    def summary(self) -> str:
        """'cifar10-ddp, 2 node(s) x 2 process(es), CPU, gloo' for comments and messages."""
        gpus = f"{self.gpus} GPU(s) per node" if self.gpus else "CPU"
        nodes = f"{self.nodes} node(s)" + (" ({} to {} as they leave and join)".format(*self.node_range) if self.elastic else "")
        nodes += f" and {self.spares} spare(s)" if self.spares else ""
        return f"{self.example.name}, {nodes} x {self.processes_per_node} process(es), {gpus}, {self.effective_backend}"

    def generated_by(self) -> str:
        """The command line that renders this file, as bash reads it back, in printable ASCII (a header line)."""
        return shell_line(self.command_line) if self.command_line else f"trainpod job ... {self.example.name}"


class Scheduler(abc.ABC):
    """One scheduler's job file. `settings` declares its own flags (and their TRAINPOD_* twins)."""

    name: ClassVar[str]
    description: ClassVar[str]
    settings: ClassVar[tuple[Setting, ...]] = ()
    submits: ClassVar[str | None] = None  # what --submit does, for the help; None: it cannot
    no_spares: ClassVar[str | None] = None  # why this scheduler's job cannot keep spares; None: it can

    def __init__(self, request: JobRequest, flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None):
        self.request = request
        self.env: Mapping[str, str] = env or {}  # what --submit may read besides the settings (ssh: SSH_AUTH_SOCK)
        self.options: Values = resolve(self.settings, flags or {}, self.env)
        if request.spares and self.no_spares:
            origin = request.origins.get("spares", "--spares")
            raise error_for(origin)(f"{origin}={request.spares}: trainpod job {self.name}: {self.no_spares}")
        self.check()

    def check(self) -> None:
        """Refuse what this scheduler cannot express (a UsageError or ConfigError naming the flag)."""
        return None

    @abc.abstractmethod
    def render(self) -> str:
        """The job file (or, for ssh, the commands per host), as printed by `trainpod job`."""

    def submit(self) -> int:
        raise UsageError(f"trainpod job {self.name}: --submit is not supported: submit the printed file yourself")


# A string written without quotes only where every reader takes it for a string: PyYAML quotes what YAML 1.1 would
# resolve otherwise, but Kubernetes (Go's YAML: y and n are booleans, 0o17 an integer) and OpenPAI (js-yaml: 1e-3 a
# number) read more plain scalars as numbers or booleans, and a learning rate 1e-3 would reach the job as 0.001.
_PLAIN = re.compile(r"(?:--?)?[A-Za-z_/](?:[A-Za-z0-9_./:=, -]*[A-Za-z0-9_./-])?")  # and no ": " (a mapping's)
_NOT_STRINGS = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null", "nan", "inf"})


def to_yaml(data: Any) -> str:
    """YAML for a person to read: keys in the order given, no anchors or aliases for repeated parts, and every
    string that any of the platforms' YAML readers could take for something else quoted."""
    import yaml  # only `trainpod job` needs PyYAML

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    def string(dumper: yaml.SafeDumper, value: str) -> Any:
        plain = _PLAIN.fullmatch(value) and ": " not in value and value.lower().lstrip("-") not in _NOT_STRINGS
        if plain or "\n" in value:  # (a block of lines keeps PyYAML's own style)
            return dumper.represent_str(value)
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="'")

    Dumper.add_representer(str, string)
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=200)


def comment(lines: Sequence[str], mark: str = "#") -> str:
    """Comment lines, each of them one line of printable ASCII whatever it quotes: a line break or any
    other character outside printable ASCII is written as an escape (the values are checked before
    they get here; this keeps a comment a comment regardless)."""
    return "".join(f"{mark} {printable(line)}".rstrip() + "\n" for line in lines)
