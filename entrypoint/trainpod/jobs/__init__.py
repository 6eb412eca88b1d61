"""`trainpod job SCHEDULER NAME`: a bundled example's job file for a scheduler, from the example registry.

One small renderer per scheduler, in a registry: the write-side mirror of environments/ (which
reads what the scheduler then sets on every node). A new scheduler is one module plus its line in
REGISTRY; the CLI builds `trainpod job <scheduler>` and its flags from here. The pattern is
TorchX's: a spec, a printable dry run (the default: print the file, write nothing), then
`--submit` where trainpod can launch it (slurm: sbatch; ssh: run it on every host).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trainpod import settings
from trainpod.errors import UsageError, error_for
from trainpod.examples import EXAMPLES, Example
from trainpod.jobs.base import JobRequest, Scheduler
from trainpod.jobs.kubeflow import KubeflowJob
from trainpod.jobs.openpai import OpenPAIJob
from trainpod.jobs.slurm import SlurmJob
from trainpod.jobs.ssh import SSHJob
from trainpod.jobs.values import CONTROL_EXPECTED, DnsLabel, ImageReference, check_text, has_control
from trainpod.rendezvous.etcd_http import has_userinfo, parse_endpoints, redact
from trainpod.settings import BACKENDS, MAX_NODES, MAX_NPROC, Choice, Host, Integer, Invalid, Setting, Switch
from trainpod.text import number

REGISTRY: dict[str, type[Scheduler]] = {cls.name: cls for cls in (OpenPAIJob, KubeflowJob, SlurmJob, SSHJob)}


NODES = Setting("nodes", "nodes (containers, hosts) the job runs on (default: the size the example is meant for)",
                Integer(1, MAX_NODES), var="TRAINPOD_JOB_NODES")
GPUS = Setting("gpus", "GPUs per node; 0: a CPU job (default: what the example wants, e.g. 8 for imagenet-ddp)",
               Integer(0, MAX_NPROC), var="TRAINPOD_JOB_GPUS")
NPROC_PER_NODE = Setting("nproc_per_node", "processes per node (default: one per GPU, decided on the node; 1 on CPU)",
                         Integer(1, MAX_NPROC), var="TRAINPOD_JOB_NPROC_PER_NODE")
BACKEND = Setting("backend", "collective backend (default: decided on the node: nccl with GPUs, else gloo)", Choice(BACKENDS),
                  var="TRAINPOD_JOB_BACKEND")
IMAGE = Setting("image", "the image (default: trainpod:<flavour>: cpu, cuda, or the flavour the example needs on GPUs)",
                ImageReference(), var="TRAINPOD_JOB_IMAGE", metavar="IMAGE")
# A name every scheduler takes: Kubernetes' DNS label rules (OpenPAI's and SLURM's are looser), short
# enough for the pod names the operator derives from it (`<name>-worker-12`).
NAME = Setting("name", "the job's name (default: trainpod-<example>)", DnsLabel(40, letter_first=True), var="TRAINPOD_JOB_NAME",
               metavar="NAME")
CPUS = Setting("cpus", "CPU cores per node (default: 4 per GPU, 4 on CPU)", Integer(1, 100000), var="TRAINPOD_JOB_CPUS")
MEMORY_MB = Setting("memory_mb", "memory per node in MiB (default: 16384 per GPU, 8192 on CPU)", Integer(256, 100_000_000),
                    var="TRAINPOD_JOB_MEMORY_MB", metavar="MIB")
SHM_MB = Setting("shm_mb", "/dev/shm per node in MiB (default: what the example needs, at least 1024)", Integer(64, 100_000_000),
                 var="TRAINPOD_JOB_SHM_MB", metavar="MIB")
RDZV_ENDPOINT = Setting("rdzv_endpoint", "an elastic example's etcd: HOST:PORT[,HOST:PORT...], where its nodes meet "
                        "(etcd-v3); kubeflow without it: c10d on worker 0", var="TRAINPOD_JOB_RDZV_ENDPOINT", metavar="ENDPOINTS")
SPARES = Setting("spares", "an elastic example's hot spares: nodes started beyond --nodes that wait, torch imported, and take "
                 "a lost node's place at the same world size (trainpod run --spares; default 0)", Integer(0, MAX_NODES),
                 var="TRAINPOD_JOB_SPARES", default=0)
SUBMIT = Setting("submit", "launch the job instead of printing it (slurm: sbatch; ssh: run it on every host)", Switch(),
                 var="TRAINPOD_JOB_SUBMIT", default=False)
SETTINGS = (NODES, GPUS, NPROC_PER_NODE, BACKEND, IMAGE, NAME, CPUS, MEMORY_MB, SHM_MB, settings.TERM_GRACE, RDZV_ENDPOINT,
            SPARES, SUBMIT)


MAX_GRACE_S = 2**31 - 1  # terminationGracePeriodSeconds, docker's --stop-timeout: every scheduler holds it in 32 bits


def default_image(example: Example, gpus: int) -> str:
    if not gpus:
        return "trainpod:cpu"
    return f"trainpod:{example.flavor if example.flavor != 'cpu' else 'cuda'}"


def _canonical(scheduler: str, example: str, values: settings.Values, own: settings.Values,
               own_settings: Sequence[Setting], args: Sequence[str]) -> tuple[str, ...]:
    """The `trainpod job` command line that renders this exact file: every value not left to its default."""
    argv = ["trainpod", "job", scheduler, example]
    for setting, source in [(s, values) for s in SETTINGS if s is not SUBMIT] + [(s, own) for s in own_settings]:
        value = getattr(source, setting.name)
        if source.origins[setting.name] == "default" or value is None:
            continue
        if isinstance(setting.kind, Switch):
            argv.append(setting.flag)
        else:
            text = number(value) if isinstance(value, float) else ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            argv += [setting.flag, text]
    return (*argv, *(("--", *args) if args else ()))


def _check_given(own_settings: Sequence[Setting], flags: Mapping[str, Any], env: Mapping[str, str], args: Sequence[str]) -> None:
    """No value this job takes holds a control character: a newline in a flag would start a second line
    of the job file (a command in an sbatch script, a key in YAML). Only what resolve() will use is
    checked: a variable that a flag overrides is not. An endpoint is shown without its credentials."""
    for setting in (*SETTINGS, *own_settings):
        given = flags.get(setting.name)
        origin, value = (setting.flag, given) if given is not None else (setting.var, env.get(setting.var or "", ""))
        if isinstance(value, str) and value.strip():
            check_text(value, origin or setting.flag, shown=redact(value) if setting is RDZV_ENDPOINT else None)
    for arg in args:
        if has_control(arg):
            raise UsageError(f"the example's flags after --: {arg!r}: expected {CONTROL_EXPECTED}")


def _endpoint(example: Example, text: str, origin: str) -> str:
    """The etcd endpoints as the job file gives them to `trainpod run`: host:port,... and nothing else.
    Credentials are refused: the file is printed, committed and shared (the nodes read them from a file
    or variable of their own), and no message repeats them."""
    shown = redact(text)
    if has_userinfo(text):
        raise error_for(origin)(f"{origin}={shown!r}: expected etcd endpoints without credentials: a job file is printed and "
                                "shared, so a user name and password do not go in it; give them to the nodes in a file or "
                                "variable of their own")
    if example.min_nodes is None:
        raise error_for(origin)(f"{origin}={shown}: the example {example.name} is not elastic; the endpoint is for "
                                f"{', '.join(e.name for e in EXAMPLES.values() if e.min_nodes is not None)}")
    try:
        endpoints = parse_endpoints(text)
    except ValueError as exc:
        raise error_for(origin)(f"{origin}: {exc}") from None
    for endpoint in endpoints:
        # Each host lands in the job file (a YAML field, a --rdzv-endpoint of the command): a host name or an address.
        address = endpoint.split("://", 1)[-1]
        try:
            Host()(address.rpartition(":")[0] or address)
        except Invalid as bad:
            raise error_for(origin)(f"{origin}={shown!r}: the host of {endpoint!r}: expected {bad}") from None
    return ",".join(endpoints)


def _spares(example: Example, nodes: int, spares: int, origin: str) -> int:
    """--spares: nodes beyond --nodes; the job then trains on the example's minimum to --nodes, which must differ
    (trainpod run keeps spares for an elastic job only: a job of a fixed size has no node to lose)."""
    if not spares:
        return 0
    if example.min_nodes is None:
        raise error_for(origin)(f"{origin}={spares}: the example {example.name} is not elastic; spares are for "
                                f"{', '.join(e.name for e in EXAMPLES.values() if e.min_nodes is not None)}")
    if nodes <= example.min_nodes:
        raise error_for(origin)(f"{origin}={spares}: with spares the job trains on {example.min_nodes} to --nodes node(s), and "
                                f"--nodes {nodes} leaves it no node to lose: give --nodes {example.min_nodes + 1} or more")
    return spares


def build(scheduler: str, example_name: str, flags: Mapping[str, Any], env: Mapping[str, str],
          args: Sequence[str] = (), warnings: list[str] | None = None) -> tuple[Scheduler, settings.Values]:
    """The scheduler's renderer for this job, and the common settings (submit among them). A flag of the example's
    given again with another value: a line in `warnings`."""
    cls = REGISTRY[scheduler]
    if example_name not in EXAMPLES:
        raise UsageError(f"trainpod job {scheduler}: {example_name!r}: expected one of {', '.join(EXAMPLES)}")
    example = EXAMPLES[example_name]
    _check_given(cls.settings, flags, env, args)
    # The example's flags, parsed as its ranks will parse them: a typo is one line now, not a job that fails on the
    # cluster after it waited in the queue. This machine's TRAINPOD_* variables do not go into the job file.
    example.check_args(args, {}, warnings)
    values = settings.resolve(SETTINGS, flags, env)
    nodes = values.nodes if values.nodes is not None else example.nodes
    example.check_nodes(nodes, values.origins["nodes"])
    gpus = values.gpus if values.gpus is not None else example.gpus
    if values.backend == "nccl" and not gpus:
        origin = values.origins["backend"]
        raise error_for(origin)(f"{origin}=nccl: NCCL needs GPUs; give --gpus N, or use gloo on CPU")
    if values.term_grace > MAX_GRACE_S - 30:
        origin = values.origins["term_grace"]
        raise error_for(origin)(f"{origin}={values.term_grace:g}: expected at most {MAX_GRACE_S - 30} seconds (a job file's grace "
                                "period, --term-grace + 30 s, is a 32-bit integer of seconds)")
    nproc = values.nproc_per_node
    if nproc is not None and example.nproc_per_node and nproc != example.nproc_per_node:
        origin = values.origins["nproc_per_node"]
        raise error_for(origin)(f"{origin}={nproc}: the example {example.name} runs {example.nproc_per_node} process(es) per node; "
                                "leave the flag out")
    if nproc is not None and gpus and nproc > gpus:
        origin = values.origins["nproc_per_node"]
        raise error_for(origin)(f"{origin}={nproc}: more processes than the {gpus} GPU(s) per node")
    endpoint = values.rdzv_endpoint
    if endpoint is not None:
        endpoint = _endpoint(example, endpoint, values.origins["rdzv_endpoint"])
    own = settings.resolve(cls.settings, flags, env)
    request = JobRequest(
        example=example,
        nodes=nodes,
        gpus=gpus,
        nproc_per_node=nproc,
        backend=values.backend,
        image=values.image or default_image(example, gpus),
        name=values.name or f"trainpod-{example.name}",
        cpus=values.cpus or (4 * gpus if gpus else 4),
        memory_mb=values.memory_mb or (16384 * gpus if gpus else 8192),
        shm_mb=values.shm_mb or max(1024, example.shm_mib),
        term_grace=values.term_grace,
        rdzv_endpoint=endpoint,
        spares=_spares(example, nodes, values.spares, values.origins["spares"]),
        args=tuple(args),
        command_line=_canonical(scheduler, example.name, values, own, cls.settings, args),
        origins=dict(values.origins),
    )
    return cls(request, flags, env), values


__all__ = ["REGISTRY", "SETTINGS", "JobRequest", "Scheduler", "build", "default_image"]
