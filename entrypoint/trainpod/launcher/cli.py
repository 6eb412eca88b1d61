"""The one CLI: `trainpod explain`, `trainpod run`, `trainpod examples`, `trainpod job`, `trainpod report`.

Flags come from the settings table (trainpod.settings, plus each cluster source's own settings
in environments/): every flag has its variable twin, and a bad value is one line naming the flag
(64) or the variable (78). `run` resolves everything here, then hands the job to supervisord as
a RunSpec (trainpod.runspec; trainpod.supervisor.job runs it: preflight, then torchrun's agent); `explain` stops before
running and prints what `run` would do. `job` writes (prints) the job file of an example for a
scheduler (trainpod.jobs), or launches it with --submit. `report` draws a run's records and metrics.json into
one HTML file (trainpod.launcher.report: files only, never torch).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import replace

from trainpod import __version__, contract, environments, jobs, log, settings
from trainpod.agent import consistency, warm
from trainpod.errors import EXIT_USAGE, ConfigError, TrainpodError, UsageError, error_for
from trainpod.examples import EXAMPLES
from trainpod.launcher import left_out, report
from trainpod.launcher.command import check_command
from trainpod.launcher.launch import available_cpus, build_plan
from trainpod.launcher.resolve import Options, resolve_topology
from trainpod.rendezvous import ids
from trainpod.runspec import RUN_SETTINGS, RunSpec, Target
from trainpod.settings import ArgumentParser, Choice, Setting, Switch
from trainpod.supervisor import job
from trainpod.supervisor.supervise import Policy, run_supervised, stop_wait_s
from trainpod.topology import RDZV_NOTES, Topology

DESCRIPTION = """\
Start distributed PyTorch training in a container on any cluster.

trainpod reads the cluster's variables (OpenPAI's PAI_*, torchrun/Kubeflow's PET_* or
MASTER_ADDR/NNODES/NODE_RANK, SLURM's SLURM_*, an etcd rendezvous, or nothing for a single
node), works out this node's rank and the master's address and port, picks the network
interface that reaches the master for gloo and NCCL, checks the setup before it can hang, and
runs torchrun under supervisord, restarting from checkpoints. Flags override variables.
"""

def _exit_codes() -> str:
    """The epilog's exit codes, from the one table (trainpod.contract.EXIT_CODES)."""
    width = max(len(row.code) for row in contract.EXIT_CODES) + 2
    lines = ["exit codes:"]
    for row in contract.EXIT_CODES:
        wrapped = textwrap.wrap(row.meaning + (f" [retried: {row.retried}]" if row.retried else ""), 100 - width)
        lines += [f"  {row.code:<{width}}{wrapped[0]}", *(" " * (width + 2) + more for more in wrapped[1:])]
    return "\n".join(lines) + "\n"


EXIT_CODES = _exit_codes()

EXAMPLE = Setting("example", f"a bundled example: {', '.join(EXAMPLES)}; flags after -- go to the example "
                  "(trainpod run --example NAME -- --help lists them)", Choice(tuple(EXAMPLES)), var="TRAINPOD_EXAMPLE",
                  metavar="NAME")
JSON = Setting("json", "print JSON instead of a table", Switch(), default=False)
RESOLVE = Setting("resolve", "also resolve the master's DNS name to pick the interface", Switch(), default=False)
LEFT_OUT_WAIT_S = 10.0  # --left-out waits at most this (or --connect-timeout, if shorter) for the rendezvous' store
LEFT_OUT = Setting("left_out", "also read the nodes an elastic job's run keeps out (that left it), from its rendezvous: "
                   f"etcd, or the c10d endpoint's store; read only, waiting at most {LEFT_OUT_WAIT_S:g} s", Switch(),
                   default=False)
EXPLAIN = (JSON, RESOLVE, LEFT_OUT)  # `explain`'s own flags
# Shape the command `run` would exec, so `explain` takes them too and shows that command exactly: the
# RunSpec's settings, and how `run` runs it.
RUN = (*RUN_SETTINGS, settings.NO_SUPERVISE)


def _job_flags(parser: argparse.ArgumentParser) -> None:
    """The flags `explain` and `run` share: topology, each source's own, the target, the run's settings."""
    settings.add_arguments(parser, (environments.SOURCE, *settings.TOPOLOGY), "topology (each overrides what the environment says)")
    for cls in environments.REGISTRY.values():
        if cls.settings:
            settings.add_arguments(parser, cls.settings, f"source {cls.name}: {cls.description}")
    settings.add_arguments(parser, (EXAMPLE,), "what to run (or -- CMD ...)")
    settings.add_arguments(parser, RUN, "running (restarted after a failure without progress up to --max-restarts; "
                                        "64, 73, 78 and 143 never; the same failure twice ends the job)")


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = ArgumentParser(prog="trainpod", description=DESCRIPTION, epilog=EXIT_CODES, formatter_class=formatter,
                            named=False)  # its errors are said as `trainpod: error: ...` (main)
    parser.add_argument("--version", action="version", version=f"trainpod {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)

    explain = commands.add_parser(
        "explain",
        help="print the resolved topology and the launch command; runs nothing, writes nothing",
        description="Print what `trainpod run` would do on this node, and where each value came from. "
        "No network I/O: a master given as a DNS name is looked up in /etc/hosts only, unless --resolve; the nodes "
        "a run keeps out are read with --left-out.",
        epilog="usage with a command: trainpod explain [flags] [--example NAME | -- CMD ...]\n\n" + EXIT_CODES,
        formatter_class=formatter,
    )
    settings.add_arguments(explain, EXPLAIN)
    _job_flags(explain)

    run_parser = commands.add_parser(
        "run",
        help="check the setup, then run an example or your command on every local rank via torchrun",
        description="Resolve the topology, then, under supervisord (restarted after a failure within a budget of restarts "
        "without progress; never after 64, 73, 78 or 143, never twice for the same failure), run the preflight checks "
        "and torchrun. Every output line is prefixed with [nodeN rankR].",
        epilog="usage with a command: trainpod run [flags] -- python train.py --your-args\n"
        "an example with its own flags: trainpod run --example cifar10-ddp -- --epochs 5\n\n" + EXIT_CODES,
        formatter_class=formatter,
    )
    _job_flags(run_parser)

    commands.add_parser("examples", help="list the bundled examples")
    _job_parser(commands, formatter)
    _report_parser(commands, formatter)
    return parser


def _report_parser(commands, formatter) -> None:
    """`trainpod report OUTPUT_DIR [--out FILE]`: the run's records and metrics.json, drawn (trainpod.launcher.report)."""
    report_parser = commands.add_parser(
        "report", help="draw a run (its records and metrics.json) into one self-contained HTML file",
        description="Draw the run in a job's output directory: loss, throughput, each rank's step time, world size, "
        "checkpoints and events (failures, recoveries, membership changes, hangs, stragglers) on one time axis, from "
        f"every node's {contract.RECORDS_DIR}/<host>.jsonl and rank 0's metrics.json. One HTML file that opens offline "
        "(plotly.js inside); prints its path. Needs plotly: pip install 'trainpod[report]'.",
        epilog="usage: trainpod report OUTPUT_DIR [--out FILE]\n\n" + EXIT_CODES, formatter_class=formatter)
    report_parser.add_argument("output_dir", metavar="OUTPUT_DIR",
                               help="the job's output directory (--output-dir, TRAINPOD_OUTPUT_DIR)")
    report_parser.add_argument("--out", metavar="FILE", default=None,
                               help=f"where to write the report (default: OUTPUT_DIR/{contract.REPORT_FILE})")


def _job_parser(commands, formatter) -> None:
    """`trainpod job SCHEDULER NAME [flags] [-- ARGS]`: one subcommand per scheduler in trainpod.jobs' registry."""
    job_parser = commands.add_parser(
        "job", help="print an example's job file for a scheduler (openpai, kubeflow, slurm, ssh), or --submit it",
        description="Print the job file that runs a bundled example on a scheduler, generated from the example registry; "
        "nothing is written. --submit launches it where trainpod can (slurm: sbatch; ssh: runs it on every host).",
        epilog="usage: trainpod job SCHEDULER NAME [flags] [-- the example's own flags]\n\n" + EXIT_CODES,
        formatter_class=formatter)
    schedulers = job_parser.add_subparsers(dest="scheduler", metavar="SCHEDULER", parser_class=ArgumentParser, required=True)
    for cls in jobs.REGISTRY.values():
        sub = schedulers.add_parser(
            cls.name, help=cls.description, formatter_class=formatter,
            description=f"trainpod job {cls.name}: {cls.description}. --submit: {cls.submits or 'not supported'}.",
            epilog=f"usage: trainpod job {cls.name} NAME [flags] [-- the example's own flags]\n\n" + EXIT_CODES)
        sub.add_argument("job_example", metavar="NAME", help=f"a bundled example: {', '.join(EXAMPLES)}")
        settings.add_arguments(sub, jobs.SETTINGS, "the job")
        if cls.settings:
            settings.add_arguments(sub, cls.settings, cls.name)


def _split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def _target(name: str | None, command: list[str], subcommand: str, required: bool, origin: str = "--example",
            warnings: list[str] | None = None) -> Target | None:
    if name:
        if command and not command[0].startswith("-"):
            # A command where the example's flags go: TRAINPOD_EXAMPLE left in an image would run the example
            # instead, and its ranks would refuse the words only after the job started.
            raise error_for(origin)(f"{origin}={name} takes the example's own flags after --, and {command[0]!r} is not "
                                    f"one: run the example or your command, not both ({'drop' if origin.startswith('--') else 'unset'} "
                                    f"{origin} to run the command)")
        return Target.for_example(name, command, os.environ, warnings)  # after --: the example's own flags
    if command:
        return Target.for_command(command, os.environ)
    if required:
        raise UsageError(f"trainpod {subcommand}: nothing to run: give --example NAME or -- CMD ...")
    return None


def _check_recovery(values, topology: Topology, target: Target | None) -> None:
    """--recovery in-process needs warm ranks (a keeper forks them) and gloo; one line by its origin otherwise."""
    if values.recovery != settings.IN_PROCESS or target is None:
        return
    origin = values.origins["recovery"]
    runs = target.command or (sys.executable, "-u", "-m", target.module or "")
    if not warm.wanted(values.warm_start, warm.python_target(list(runs))):
        raise error_for(origin)(f"{origin}=in-process: a keeper forks the ranks, so they must start warm: expected "
                                "--warm-start on (or auto for a bundled example) and a `python SCRIPT` or "
                                f"`python -m MODULE` command, got --warm-start {values.warm_start}")
    if topology.backend == "nccl":
        # A dead peer does not make NCCL's collectives fail (they wait for the watchdog's timeout), so the
        # other ranks would never reach their recovery; not built (nor testable on one GPU) yet.
        raise error_for(origin)(f"{origin}=in-process: expected the gloo backend (NCCL's collectives do not fail "
                                "when a peer dies: the others would wait for the watchdog), got nccl; use restart")


def _check_replace_stragglers(values, topology: Topology) -> None:
    """--replace-stragglers swaps a straggler's node for a spare: an elastic job's, with the straggler watch on."""
    if not values.replace_stragglers:
        return
    origin = values.origins["replace_stragglers"]
    if not topology.rdzv.elastic:
        raise error_for(origin)(f"{origin}: a straggler's node is replaced by a spare of an elastic job (--nnodes MIN:MAX "
                                f"with --spares); this job has a fixed size of {topology.nnodes} node(s)")
    if not values.straggler_window:
        window = values.origins.get("straggler_window", "--straggler-window")
        raise error_for(origin)(f"{origin}: no straggler is ever named with {window}=0: give the watch a window")


def _check_netcheck(values) -> None:
    """--min-bandwidth above 0 turns the network check on: with the check turned off in so many words, one line."""
    origin = values.origins["netcheck"]
    if values.netcheck == "off" and values.min_bandwidth and origin != "default":
        bound = values.origins["min_bandwidth"]
        culprit = origin if origin.startswith("--") or not bound.startswith("--") else bound
        raise error_for(culprit)(f"{origin}=off and {bound}={values.min_bandwidth:g}: a bound turns the network check on; "
                                 "give one or the other")


def _check_metrics_port(values, topology: Topology) -> None:
    """The metrics endpoint and c10d's store would both listen on node 0's master port: one line naming both."""
    if values.metrics_port and topology.rdzv.backend == "c10d" and values.metrics_port == topology.master_port:
        origin = values.origins["metrics_port"]
        raise error_for(origin)(f"{origin}={values.metrics_port}: node 0's c10d store listens on that port "
                                f"({topology.origins['master_port']}): give the metrics another port")


def _job(args: argparse.Namespace, command: list[str], env: Mapping[str, str], *, required: bool, resolve_names: bool):
    """(topology, run settings, target): everything `run` needs and `explain` shows, from flags and env."""
    flags = vars(args)
    values = settings.resolve((EXAMPLE, *RUN), flags, env)
    example = EXAMPLES.get(values.example)
    fixed = (example.nproc_per_node, f"the example {example.name}") if example and example.nproc_per_node else None
    topology = resolve_topology(Options(**flags), env, resolve_names=resolve_names, nproc_per_node=fixed)
    try:
        return _checked_job(args, command, values, example, topology, required)
    except TrainpodError as error:
        error.node = error.node or topology.node_label  # like every other line of this node's
        raise


def _checked_job(args: argparse.Namespace, command: list[str], values, example, topology: Topology, required: bool):
    if example:
        example.check_nodes(topology.nnodes, topology.origins["nnodes"])
    warnings = settings.repeated(args)
    target = _target(values.example, command, args.command, required, values.origins.get("example", "--example"), warnings)
    if warnings:  # said where the topology's warnings are: explain's table, and once per run
        topology = replace(topology, warnings=(*warnings, *topology.warnings))
    if values.warm_start == "on" and target is not None and target.command and warm.python_target(target.command) is None:
        origin = values.origins["warm_start"]
        raise error_for(origin)(f"{origin}=on: expected a command that this Python ({sys.executable}) runs as "
                                f"`python SCRIPT ...` or `python -m MODULE ...`, got {target.command[0]!r}; use auto or off")
    _check_recovery(values, topology, target)
    _check_replace_stragglers(values, topology)
    _check_metrics_port(values, topology)
    _check_netcheck(values)
    rdzv = topology.rdzv
    if not rdzv.id:
        # Nothing names the job: the same job on every node has the same shape and runs the same thing.
        shape = [rdzv.backend, rdzv.endpoint, rdzv.nnodes, str(topology.nproc_per_node)]
        what = [target.module or "", *target.command, *target.args] if target else []
        made = ids.digest_id([*shape, *what])
        topology = replace(topology, rendezvous=replace(rdzv, id=made, id_origin="digest of the job (no job identity found)"),
                           origins={**topology.origins, "rdzv_id": "digest of the job (no job identity found)"})
    return topology, values, target


def _global_ranks_row(topology: Topology) -> tuple[str, str, str]:
    ranks = topology.global_ranks
    if ranks is None:
        return ("global_ranks", "(at each rendezvous)", "the rendezvous numbers the nodes: they may change when one leaves or joins")
    shown = f"{ranks.start}-{ranks.stop - 1}" if len(ranks) > 1 else str(ranks.start)
    return ("global_ranks", shown, "node_rank x nproc_per_node onwards, at every start and restart")


def _software_rows(spec: RunSpec) -> list[str]:
    """This node's fingerprint, as the agent publishes it at each rendezvous (trainpod.agent.consistency)."""
    if spec.consistency == "off":
        return ["", "software: not compared between the nodes (--consistency off)"]
    mine = consistency.of_run(spec)
    width = max(len(name) for name in mine.fields)
    return ["", f"software (--consistency {spec.consistency}: every node's must be the same, checked at each rendezvous):",
            *(f"  {name:<{width}}  {value}" for name, value in mine.fields.items())]


def _explain_table(topology: Topology, command: str | None, software: list[str] = ()) -> str:
    rdzv = topology.rdzv
    elastic = f" (elastic: {rdzv.min_nodes} to {rdzv.max_nodes} nodes)" if rdzv.elastic else ""
    world = f"{rdzv.min_nodes * topology.nproc_per_node}:{topology.world_size}" if rdzv.elastic else topology.world_size
    rows = [
        ("source", topology.source, ""),
        ("nnodes", rdzv.nnodes, topology.origins.get("nnodes", "") + elastic),
        ("node_rank", topology.node_label, topology.origins.get("node_rank", "")),
        ("nproc_per_node", topology.nproc_per_node, topology.origins.get("nproc_per_node", "")),
        ("world_size", world, "nnodes x nproc_per_node"),
        _global_ranks_row(topology),
        ("master_addr", topology.master_addr, topology.origins.get("master_addr", "")),
        ("master_port", topology.master_port, topology.origins.get("master_port", "")),
        ("backend", topology.backend, topology.origins.get("backend", "")),
        ("interface", topology.interface or "(not yet known)", f"{topology.origins.get('interface', '')}: {topology.interface_reason}"),
        ("rdzv_backend", rdzv.backend, f"{topology.origins.get('rdzv_backend', 'default')}: {RDZV_NOTES[rdzv.backend]}"),
        ("rdzv_endpoint", rdzv.endpoint, topology.origins.get("rdzv_endpoint", "the master's address and port")),
        ("rdzv_id", rdzv.id + (".g<N>" if rdzv.uses_etcd else ""),
         rdzv.id_origin + ("; N: the job's generation in etcd, one more after each run" if rdzv.uses_etcd else "")),
    ]
    if rdzv.elastic:
        rows.append(("spares", rdzv.spares, f"{topology.origins.get('spares', 'default')}: nodes started beyond the maximum "
                     f"of {rdzv.max_nodes} wait warm and take the place of a node that leaves, at the same world size"))
    if rdzv.settings:
        rows.append(("rdzv_conf", ",".join(f"{k}={v}" for k, v in rdzv.settings.items()),
                     topology.origins.get("rdzv_conf", "default") + " over trainpod's defaults"))
    access = rdzv.access
    if access.tls or access.user or rdzv.endpoint.startswith("https://"):  # files and the user: never a password
        shown = ", ".join(filter(None, ["TLS" if rdzv.endpoint.startswith("https://") else "", access.user and f"user {access.user}"]))
        rows.append(("etcd_access", shown, access.describe() or "https:// endpoint, the system's CAs"))
    width = max(len(str(value)) for _, value, _ in rows)
    lines = [f"{name:<15} {str(value):<{width}}  {origin}".rstrip() for name, value, origin in rows]
    lines += [f"warning: {w}" for w in topology.warnings]
    lines += software
    if command:
        lines += ["", "would run:", f"  {command}"]
    return "\n".join(lines)


def cmd_explain(args: argparse.Namespace, command: list[str]) -> int:
    explain = settings.resolve(EXPLAIN, vars(args), os.environ)
    topology, values, target = _job(args, command, os.environ, required=False, resolve_names=explain.resolve)
    plan, spec = None, None
    if target:
        spec = RunSpec.from_values(topology, target, values)
        plan = build_plan(spec, os.environ, cpus=available_cpus())
    if explain.json:
        data = topology.to_dict()
        if plan:
            data["command"] = plan.argv
            data["env"] = plan.env
        if spec and spec.consistency != "off":
            data["software"] = consistency.of_run(spec).fields
        if explain.left_out:
            data["left_out"] = left_out.to_dict(topology, min(values.connect_timeout, LEFT_OUT_WAIT_S))
        print(json.dumps(data, indent=2))
    else:
        rows = (_software_rows(spec) if spec else []) + (
            left_out.rows(topology, min(values.connect_timeout, LEFT_OUT_WAIT_S)) if explain.left_out else [])
        print(_explain_table(topology, plan.command_line() if plan else None, rows))
    return 0


def cmd_run(args: argparse.Namespace, command: list[str]) -> int:
    topology, values, target = _job(args, command, os.environ, required=True, resolve_names=False)
    if target.command:
        try:
            check_command(target.command, os.environ)  # not found: 64 here, before any rank (or supervisord) starts
        except TrainpodError as error:
            error.node = topology.node_label
            raise
    say = log.writer(topology.node_label)
    for warning in topology.warnings:  # once per run, not once per restart of the job
        say(f"warning: {warning}")
    spec = RunSpec.from_values(topology, target, values)
    if values.no_supervise:
        job.run(spec)  # does not return: this process becomes torchrun's agent, and exits with its code
    if importlib.util.find_spec("supervisor") is None:
        raise ConfigError("supervisor is not installed in this Python: pip install supervisor, or run with --no-supervise")
    # The outer run: what could be checked without the network was (64/78 end above, never
    # supervised); the job itself runs, and is restarted, under supervisord.
    policy = Policy(max_restarts=spec.max_restarts, backoff_s=spec.restart_backoff, progress_window=spec.progress_window)
    return run_supervised(contract.job_command(sys.executable), {**os.environ, **spec.to_env()}, policy, topology.node_label,
                          stop_wait=stop_wait_s(spec.term_grace))


def cmd_examples(args: argparse.Namespace, command: list[str]) -> int:
    for example in EXAMPLES.values():
        print(f"{example.name:<16} {example.description}")
    return 0


def cmd_job(args: argparse.Namespace, command: list[str]) -> int:
    warnings = settings.repeated(args)
    renderer, values = jobs.build(args.scheduler, args.job_example, vars(args), os.environ, command, warnings)
    say = log.writer()
    for warning in warnings:  # on stderr: the job file on stdout stays whole
        say(f"warning: {warning}")
    if values.submit:
        return renderer.submit()
    sys.stdout.write(renderer.render())
    return 0


def cmd_report(args: argparse.Namespace, command: list[str]) -> int:
    print(report.write(args.output_dir, args.out))
    return 0


COMMANDS = {"explain": cmd_explain, "run": cmd_run, "examples": cmd_examples, "job": cmd_job, "report": cmd_report}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, command = _split_command(argv)
    try:
        parser = build_parser()
        args = parser.parse_args(own)
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        if command and args.command not in ("run", "explain", "job"):
            raise UsageError(f"trainpod {args.command}: takes no command after --")
        return COMMANDS[args.command](args, command)
    except TrainpodError as error:
        print(f"{log.prefix(error.node)}: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        return 130
