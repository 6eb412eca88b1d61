"""The one CLI: `trainpod explain`, `trainpod run`, `trainpod examples`."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Sequence

from trainpod import __version__, environments
from trainpod.errors import EXIT_CONFIG, EXIT_UNAVAILABLE, EXIT_USAGE, ConfigError, TrainpodError, UsageError
from trainpod.examples import EXAMPLES
from trainpod.launch import Target, available_cpus, build_plan
from trainpod.preemption import DEFAULT_GRACE_S, GRACE_VAR
from trainpod.preflight import run_preflight
from trainpod.resolve import BACKENDS, Options, resolve_topology
from trainpod.supervise import Policy, restarts_left, run_supervised, stop_wait_s
from trainpod.topology import Topology

DESCRIPTION = """\
Start distributed PyTorch training in a container on any cluster.

trainpod reads the cluster's variables (OpenPAI's PAI_*, torchrun/Kubeflow's PET_* or
MASTER_ADDR/NNODES/NODE_RANK, or nothing for a single node), works out this node's rank and
the master's address and port, picks the network interface that reaches the master for gloo
and NCCL, checks the setup before it can hang, and runs torchrun. Flags override variables.
"""

EXIT_CODES = f"""\
exit codes:
  0    success
  {EXIT_USAGE}   usage error: bad or conflicting flags
  {EXIT_UNAVAILABLE}   the master was unreachable (or did not resolve) within --connect-timeout
  {EXIT_CONFIG}   configuration error: the cluster's variables are wrong or incomplete
  other  the training's own exit code (128+N: its rank was killed by signal N)
"""


SUPERVISED = "TRAINPOD_SUPERVISED"  # set for the job that supervisord runs: it runs, it does not supervise


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 64, not a usage dump and 2."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}")


def _env_number(var: str, default, kind):
    """A flag's default from a variable; a malformed one is a configuration error that names it."""
    text = os.environ.get(var, "").strip()
    if not text:
        return default
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{var}={text!r}: expected a number") from None


def _topology_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("topology (each overrides what the environment says)")
    group.add_argument("--source", choices=list(environments.REGISTRY),
                       help="cluster environment to read (default: detect; env TRAINPOD_SOURCE)")
    group.add_argument("--nnodes", type=int, help="number of nodes")
    group.add_argument("--node-rank", type=int, help="this node's rank, 0 = master")
    group.add_argument("--nproc-per-node", type=int,
                       help="processes per node (default: TRAINPOD_NPROC_PER_NODE, PET_NPROC_PER_NODE, visible GPUs, else 1)")
    group.add_argument("--master-addr", help="the master's address")
    group.add_argument("--master-port", type=int, help="the master's port")
    group.add_argument("--backend", choices=BACKENDS,
                       help="collective backend (default: nccl with GPUs, else gloo; env TRAINPOD_BACKEND)")
    group.add_argument("--interface",
                       help="network interface for gloo/NCCL (default: GLOO_SOCKET_IFNAME, else the one that reaches the master)")
    pai = parser.add_argument_group("OpenPAI")
    pai.add_argument("--pai-roles", help="ordered, comma-separated trainer task roles; the first one's instance 0 "
                     "is the master (env TRAINPOD_PAI_ROLES; default: the current role)")
    pai.add_argument("--pai-port-label",
                     help="port label of the master port (env TRAINPOD_PAI_PORT_LABEL; default: the one label besides ssh/http)")


def _target_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--example", choices=list(EXAMPLES), metavar="NAME",
                        help=f"a bundled example: {', '.join(EXAMPLES)}; flags after -- go to the example")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="trainpod", description=DESCRIPTION, epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"trainpod {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    explain = commands.add_parser(
        "explain",
        help="print the resolved topology and the launch command; runs nothing, sends nothing",
        description="Print what `trainpod run` would do on this node, and where each value came from. "
        "No network I/O: a master given as a DNS name is looked up in /etc/hosts only, unless --resolve.",
        epilog="usage with a command: trainpod explain [flags] [--example NAME | -- CMD ...]\n\n" + EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    explain.add_argument("--json", action="store_true", help="print JSON instead of a table")
    explain.add_argument("--resolve", action="store_true", help="also resolve the master's DNS name to pick the interface")
    _topology_flags(explain)
    _target_flags(explain)

    run = commands.add_parser(
        "run",
        help="check the setup, then run an example or your command on every local rank via torchrun",
        description="Resolve the topology, then, under supervisord (restarted after failures, never after 64 or 78), "
        "run the preflight checks and torchrun. Every output line is prefixed with [nodeN rankR].",
        epilog="usage with a command: trainpod run [flags] -- python train.py --your-args\n"
        "an example with its own flags: trainpod run --example cifar10-ddp -- --epochs 5\n\n" + EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _topology_flags(run)
    _target_flags(run)
    supervision = run.add_argument_group("supervision (supervisord restarts the job; 64 and 78 are never restarted)")
    supervision.add_argument("--max-restarts", type=int, default=_env_number("TRAINPOD_MAX_RESTARTS", 3, int),
                             help="restarts after a failure, one budget for both layers: torchrun restarts the worker group "
                             "at once when a rank fails, supervisord restarts the agent with exponential backoff "
                             "(default 3; env TRAINPOD_MAX_RESTARTS)")
    supervision.add_argument("--restart-backoff", type=float, default=_env_number("TRAINPOD_RESTART_BACKOFF", 1.0, float),
                             help="seconds before the first restart, doubling each time (default 1; env TRAINPOD_RESTART_BACKOFF)")
    supervision.add_argument("--term-grace", type=float, default=_env_number(GRACE_VAR, DEFAULT_GRACE_S, float),
                             help="seconds the ranks get after SIGTERM to finish the step and save a checkpoint before "
                             "they are killed; give the container this plus 30 s to stop "
                             f"(default {DEFAULT_GRACE_S:g}; env {GRACE_VAR})")
    supervision.add_argument("--no-supervise", action="store_true",
                             help="exec torchrun directly, without supervisord: failed ranks are still restarted by torchrun "
                             "(up to --max-restarts), a failed agent is not")
    run.add_argument("--connect-timeout", type=float, default=_env_number("TRAINPOD_CONNECT_TIMEOUT", 300.0, float),
                     help="seconds to wait for the master (DNS and port) before exit 69 (default 300; env TRAINPOD_CONNECT_TIMEOUT)")

    commands.add_parser("examples", help="list the bundled examples")
    return parser


def _split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def _options(args: argparse.Namespace) -> Options:
    return Options(**{name: getattr(args, name) for name in Options.__dataclass_fields__})


def _target(args: argparse.Namespace, command: list[str], required: bool) -> Target | None:
    if args.example:
        return Target.for_example(args.example, command)  # after --: the example's own flags
    if command:
        return Target(command=tuple(command))
    if required:
        raise UsageError(f"trainpod {args.command}: nothing to run: give --example NAME or -- CMD ...")
    return None


def _log(topology: Topology | None = None):
    prefix = f"[node{topology.node_rank}] trainpod" if topology else "trainpod"

    def log(message: str) -> None:
        print(f"{prefix}: {message}", file=sys.stderr, flush=True)

    return log


def _explain_table(topology: Topology, command: str | None) -> str:
    rows = [
        ("source", topology.source, ""),
        ("nnodes", topology.nnodes, topology.origins.get("nnodes", "")),
        ("node_rank", topology.node_rank, topology.origins.get("node_rank", "")),
        ("nproc_per_node", topology.nproc_per_node, topology.origins.get("nproc_per_node", "")),
        ("world_size", topology.world_size, "nnodes x nproc_per_node"),
        ("master_addr", topology.master_addr, topology.origins.get("master_addr", "")),
        ("master_port", topology.master_port, topology.origins.get("master_port", "")),
        ("backend", topology.backend, topology.origins.get("backend", "")),
        ("interface", topology.interface or "(not yet known)", f"{topology.origins.get('interface', '')}: {topology.interface_reason}"),
        ("rendezvous", topology.rendezvous, ""),
    ]
    width = max(len(str(value)) for _, value, _ in rows)
    lines = [f"{name:<15} {str(value):<{width}}  {origin}".rstrip() for name, value, origin in rows]
    lines += [f"warning: {w}" for w in topology.warnings]
    if command:
        lines += ["", "would run:", f"  {command}"]
    return "\n".join(lines)


def cmd_explain(args: argparse.Namespace, command: list[str]) -> int:
    topology = resolve_topology(_options(args), os.environ, resolve_names=args.resolve)
    target = _target(args, command, required=False)
    plan = build_plan(topology, target, os.environ, cpus=available_cpus()) if target else None
    if args.json:
        data = topology.to_dict()
        if plan:
            data["command"] = plan.argv
            data["env"] = plan.env
        print(json.dumps(data, indent=2))
    else:
        print(_explain_table(topology, plan.command_line() if plan else None))
    return 0


def cmd_run(args: argparse.Namespace, command: list[str]) -> int:
    if args.connect_timeout <= 0:
        raise UsageError(f"--connect-timeout={args.connect_timeout:g}: expected a number of seconds > 0")
    if args.max_restarts < 0 or args.restart_backoff < 0:
        raise UsageError(f"--max-restarts={args.max_restarts}, --restart-backoff={args.restart_backoff:g}: expected numbers >= 0")
    if args.term_grace <= 0:
        raise UsageError(f"--term-grace={args.term_grace:g}: expected a number of seconds > 0")
    target = _target(args, command, required=True)
    topology = resolve_topology(_options(args), os.environ, resolve_names=False)
    if not (args.no_supervise or os.environ.get(SUPERVISED) == "1"):
        return _run_supervised(args, topology)
    log = _log(topology)
    for warning in topology.warnings:
        log(f"warning: {warning}")
    topology = run_preflight(topology, os.environ, connect_timeout=args.connect_timeout, log=log)
    plan = build_plan(topology, target, os.environ, cpus=available_cpus(), max_restarts=restarts_left(args.max_restarts),
                      term_grace=args.term_grace, join_timeout=args.connect_timeout)
    log(
        f"{topology.source}: node {topology.node_rank} of {topology.nnodes}, {topology.nproc_per_node} process(es) per node, "
        f"master {topology.master_addr}:{topology.master_port}, {topology.backend} over {topology.interface}"
    )
    sys.stdout.flush()
    os.execvpe(plan.argv[0], plan.argv, {**os.environ, **plan.env})
    return 0  # not reached


def _run_supervised(args: argparse.Namespace, topology: Topology) -> int:
    """The outer run: the environment checked out (64/78 end here), the job itself under supervisord."""
    if importlib.util.find_spec("supervisor") is None:
        raise ConfigError("supervisor is not installed in this Python: pip install supervisor, or run with --no-supervise")
    policy = Policy(max_restarts=args.max_restarts, backoff_s=args.restart_backoff)
    job = [sys.executable, "-m", "trainpod", *args.argv]
    return run_supervised(job, {**os.environ, SUPERVISED: "1"}, policy, f"[node{topology.node_rank}] trainpod",
                          stop_wait=stop_wait_s(args.term_grace))


def cmd_examples(args: argparse.Namespace, command: list[str]) -> int:
    for example in EXAMPLES.values():
        print(f"{example.name:<16} {example.description}")
    return 0


COMMANDS = {"explain": cmd_explain, "run": cmd_run, "examples": cmd_examples}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, command = _split_command(argv)
    try:
        parser = build_parser()
        args = parser.parse_args(own)
        args.argv = argv  # the supervised job runs `trainpod` again with exactly these
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        if command and args.command not in ("run", "explain"):
            raise UsageError(f"trainpod {args.command}: takes no command after --")
        return COMMANDS[args.command](args, command)
    except TrainpodError as error:
        print(f"trainpod: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        return 130
