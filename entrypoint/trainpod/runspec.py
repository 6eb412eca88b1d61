"""The run as one typed contract: RunSpec holds every value that leaves the launcher's process.

    trainpod run  --RunSpec.to_env()-->  supervisord -> trainpod.supervisor.job  --(the plan's environment)-->  the agent
                                                                      --RunSpec.rank_env()-->      the ranks

The launcher resolves the topology, the target and the run's settings once (flags, then variables,
then defaults) and writes them here; trainpod.supervisor.job and the agent read them back with
RunSpec.from_env(), typed, instead of parsing variables again. The ranks (the training script and
trainpod's library in it) read the few settings they need through their own declarations
(TERM_GRACE.from_env in trainpod.train.preemption, ...), from the variables rank_env() writes for them.

Adding a run setting: one Setting in trainpod.settings, one field below with `setting=` naming it,
and the code that uses it. The field's default is the setting's; the CLI's flags for the run
(RUN_SETTINGS) and their resolution come from these fields.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from trainpod import settings
from trainpod.contract import CHECKPOINT_DIR_VAR, OUTPUT_DIR_VAR, RUN_SPEC_VAR
from trainpod.errors import ConfigError, UsageError
from trainpod.settings import Setting
from trainpod.topology import Topology


@dataclass(frozen=True)
class Target:
    """What the workers run: a bundled example's module, or the user's own command."""

    module: str | None = None
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()  # what the ranks import besides torch: preflight imports it first
    shm_mib: int | None = None  # the /dev/shm it needs (DataLoader workers); 0: none; None: unknown (a command)
    output_dir: str | None = None  # where an example writes its metrics (None: a command, unknown)
    checkpoint_dir: str | None = None  # where an example checkpoints (None: nowhere, or a command)

    @staticmethod
    def for_example(name: str, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                    warnings: list[str] | None = None) -> Target:
        from trainpod.examples import EXAMPLES

        if name not in EXAMPLES:
            raise UsageError(f"--example={name!r}: expected one of {', '.join(EXAMPLES)}")
        example = EXAMPLES[name]
        args = example.args + tuple(extra_args)
        env = os.environ if env is None else env
        example.check_args(args, env, warnings)
        shm = example.shm_mib if example.uses_loader_workers(args, env) else 0
        output_dir, checkpoint_dir = example.directories(args, env)
        return Target(module=example.module, args=args, needs=example.needs, shm_mib=shm, output_dir=output_dir,
                      checkpoint_dir=checkpoint_dir)

    @staticmethod
    def for_command(command: Sequence[str], env: Mapping[str, str]) -> Target:
        """A command's directories are its own; the ones the job names in trainpod's variables are
        checked and held (trainpod.supervisor.dirlock) as an example's are."""
        return Target(command=tuple(command), output_dir=env.get(OUTPUT_DIR_VAR, "").strip() or None,
                      checkpoint_dir=env.get(CHECKPOINT_DIR_VAR, "").strip() or None)

    @staticmethod
    def from_dict(data: Mapping) -> Target:
        return Target(module=data["module"], command=tuple(data["command"]), args=tuple(data["args"]),
                      needs=tuple(data.get("needs", ())), shm_mib=data.get("shm_mib"), output_dir=data.get("output_dir"),
                      checkpoint_dir=data.get("checkpoint_dir"))

    def directories(self) -> list[tuple[str | None, str]]:
        """(directory, what: its name, flag and variable, with {path}) of the output and checkpoint directories;
        a command's come from the variables alone (it has no such flags)."""
        def named(kind: str, flag: str, var: str) -> str:
            return f"{kind} directory {{path}} ({flag + ', ' if self.module else ''}{var})"

        return [(self.output_dir, named("output", "--output-dir", OUTPUT_DIR_VAR)),
                (self.checkpoint_dir, named("checkpoint", "--checkpoint-dir", CHECKPOINT_DIR_VAR))]

    def torchrun_args(self) -> list[str]:
        if self.module:
            return ["-m", self.module, *self.args]
        # --no-python runs the command as given (`python train.py`, a shell script, a binary),
        # so what the user typed is exactly what each rank runs.
        return ["--no-python", *self.command, *self.args]


def _run(setting: Setting) -> Any:
    """A RunSpec field that carries `setting`: its default is the setting's."""
    return field(default=setting.default, metadata={"setting": setting})


@dataclass(frozen=True)
class RunSpec:
    """Where this node stands (topology), what it runs (target), and the run's settings."""

    topology: Topology
    target: Target
    connect_timeout: float = _run(settings.CONNECT_TIMEOUT)
    max_restarts: int = _run(settings.MAX_RESTARTS)
    restart_backoff: float = _run(settings.RESTART_BACKOFF)
    progress_window: float = _run(settings.PROGRESS_WINDOW)
    rejoin_timeout: float = _run(settings.REJOIN_TIMEOUT)
    term_grace: float = _run(settings.TERM_GRACE)
    lock_timeout: float = _run(settings.LOCK_TIMEOUT)
    hang_timeout: float = _run(settings.HANG_TIMEOUT)
    straggler_window: float = _run(settings.STRAGGLER_WINDOW)
    replace_stragglers: bool = _run(settings.REPLACE_STRAGGLERS)
    metrics_port: int = _run(settings.METRICS_PORT)
    warm_start: str = _run(settings.WARM_START)
    recovery: str = _run(settings.RECOVERY)
    peer_copies: bool = _run(settings.PEER_COPIES)
    trust_checkpoints: bool = _run(settings.TRUST_CHECKPOINTS)
    consistency: str = _run(settings.CONSISTENCY)
    netcheck: str = _run(settings.NETCHECK)
    min_bandwidth: float = _run(settings.MIN_BANDWIDTH)
    devcheck: str = _run(settings.DEVCHECK)

    def node_checks(self) -> str:
        """The checks this node runs with the others at each rendezvous, in the words of their flags: every node must
        run the same (trainpod.agent.consistency compares them). A --min-bandwidth asks for the network check. Peer
        copies are exchanged at each rendezvous too: a node without them would leave the others waiting for its address."""
        netcheck = "on" if self.netcheck != "off" or self.min_bandwidth else "off"
        bound = f" --min-bandwidth {self.min_bandwidth:g}" if self.min_bandwidth else ""
        return f"--netcheck {netcheck}{bound} --devcheck {self.devcheck}" + (" --peer-copies" if self.peer_copies else "")

    @staticmethod
    def from_values(topology: Topology, target: Target, values: settings.Values) -> RunSpec:
        """From the CLI's resolved settings. A restart budget the cluster declares (OpenPAI's retry
        count: Topology.max_restarts) stands in for the default, never for a flag or variable."""
        given = {f.name: getattr(values, f.name) for f in fields(RunSpec) if "setting" in f.metadata}
        if topology.max_restarts is not None and values.origins.get("max_restarts") == "default":
            given["max_restarts"] = topology.max_restarts
        return RunSpec(topology=topology, target=target, **given)

    def to_json(self) -> str:
        data: dict[str, Any] = asdict(self)
        data["topology"] = self.topology.to_dict()
        return json.dumps(data)

    @staticmethod
    def from_json(text: str) -> RunSpec:
        data = json.loads(text)
        known = {f.name: data[f.name] for f in fields(RunSpec) if "setting" in f.metadata and f.name in data}
        return RunSpec(topology=Topology.from_dict(data["topology"]), target=Target.from_dict(data["target"]), **known)

    def to_env(self) -> dict[str, str]:
        """The one variable that carries the spec to trainpod.supervisor.job and the agent."""
        return {RUN_SPEC_VAR: self.to_json()}

    @staticmethod
    def from_env(env: Mapping[str, str] = os.environ) -> RunSpec | None:
        """The spec the launcher wrote; None where nothing did (the agent started by hand). A spec
        that does not parse is a ConfigError naming the variable."""
        text = env.get(RUN_SPEC_VAR, "")
        if not text.strip():
            return None
        try:
            return RunSpec.from_json(text)
        except (ValueError, KeyError, TypeError) as bad:
            raise ConfigError(f"{RUN_SPEC_VAR}: expected the run's spec as `trainpod run` writes it ({bad})") from None

    def rank_env(self) -> dict[str, str]:
        """The settings the ranks read through their own declarations: the spec's values, set either way,
        so that the launcher's flag wins over a variable the job inherited."""
        return {
            settings.BACKEND.var: self.topology.backend,  # the bundled examples' --backend
            settings.TERM_GRACE.var: f"{self.term_grace:g}",  # trainpod.train.preemption
            settings.RECOVERY.var: self.recovery,  # the warm ranks: each runs under a keeper (trainpod.agent.keeper)
            settings.TRUST_CHECKPOINTS.var: "1" if self.trust_checkpoints else "0",  # trainpod.train.checkpoint
        }

    def with_topology(self, topology: Topology) -> RunSpec:
        return replace(self, topology=topology)


# The settings a run carries, in the CLI's order: `trainpod run` and `explain` take them as flags.
RUN_SETTINGS: tuple[Setting, ...] = tuple(f.metadata["setting"] for f in fields(RunSpec) if "setting" in f.metadata)
