"""The supervised job: `python -m trainpod.job`, the program supervisord runs and restarts.

    trainpod run (outer: flags, variables, topology; 64 and 78 end here, never supervised)
      -> supervisord -> python -m trainpod.job (this module: preflight, then the agent, in this process)

The outer run hands over everything it resolved as a JobSpec (JSON in TRAINPOD_JOB_SPEC), so
nothing is parsed twice. Here the preflight checks run (they wait for the master, so an
unreachable one, 69, is retried by the supervisor), then this process becomes torchrun's agent
with what is left of the restart budget: it runs trainpod.agent's main() with the launch plan's
arguments and environment, as `python -m trainpod.agent` would, without starting Python and
importing trainpod a second time (an exec cost about 0.1 s of every start). `trainpod run
--no-supervise` calls run() in its own process instead.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, NoReturn

from trainpod import devices, dirlock, log, orphans
from trainpod.errors import EXIT_USAGE, TrainpodError
from trainpod.launch import Target, available_cpus, build_plan
from trainpod.preflight import run_preflight
from trainpod.restarts import Budget
from trainpod.settings import HANG_TIMEOUT, LOCK_TIMEOUT, PROGRESS_WINDOW, RECOVERY, REJOIN_TIMEOUT, TRUST_CHECKPOINTS, WARM_START
from trainpod.supervise import BUDGET_DIR, supervisor_pid
from trainpod.topology import C10D_ID, Topology

SPEC_VAR = "TRAINPOD_JOB_SPEC"


@dataclass(frozen=True)
class JobSpec:
    """What the outer run resolved: where this node stands, what to run, and the run's settings."""

    topology: Topology
    target: Target
    connect_timeout: float
    term_grace: float
    max_restarts: int
    progress_window: float = PROGRESS_WINDOW.default
    rejoin_timeout: float = REJOIN_TIMEOUT.default
    hang_timeout: float = HANG_TIMEOUT.default
    warm_start: str = WARM_START.default
    recovery: str = RECOVERY.default
    trust_checkpoints: bool = TRUST_CHECKPOINTS.default
    lock_timeout: float = LOCK_TIMEOUT.default

    def to_json(self) -> str:
        data: dict[str, Any] = asdict(self)
        data["topology"] = self.topology.to_dict()
        return json.dumps(data)

    @staticmethod
    def from_json(text: str) -> JobSpec:
        data = json.loads(text)
        return JobSpec(
            topology=Topology.from_dict(data["topology"]),
            target=Target.from_dict(data["target"]),
            connect_timeout=data["connect_timeout"],
            term_grace=data["term_grace"],
            max_restarts=data["max_restarts"],
            progress_window=data.get("progress_window", PROGRESS_WINDOW.default),
            rejoin_timeout=data.get("rejoin_timeout", REJOIN_TIMEOUT.default),
            hang_timeout=data.get("hang_timeout", HANG_TIMEOUT.default),
            warm_start=data.get("warm_start", WARM_START.default),
            recovery=data.get("recovery", RECOVERY.default),
            trust_checkpoints=data.get("trust_checkpoints", TRUST_CHECKPOINTS.default),
            lock_timeout=data.get("lock_timeout", LOCK_TIMEOUT.default),
        )


def gloo_fallback_note(topology: Topology, cuda: str | None) -> str | None:
    """One line when a CUDA build of torch (`cuda`: its version) falls back to gloo because no GPU
    is visible: on a GPU host that usually means the container was started without GPUs."""
    if cuda and topology.backend == "gloo" and topology.origins.get("backend") == "default (no GPU visible)":
        return (f"no GPU visible: gloo instead of NCCL, on the CPU (torch here is built for CUDA {cuda}; "
                "give the container GPUs, e.g. docker run --gpus all, to train on them with NCCL)")
    return None


def run(spec: JobSpec, env: Mapping[str, str] = os.environ) -> NoReturn:
    """Preflight, then this process becomes the agent (torchrun) and exits with its code. (The
    topology's warnings were printed once, by the outer run.)"""
    say = log.writer(spec.topology.node_rank)
    importing = _import_the_launcher()
    try:
        topology = run_preflight(spec.topology, env, connect_timeout=spec.connect_timeout, log=say, target=spec.target)
    except TrainpodError as error:
        # Said once, by the job; recorded as the job's end where retrying cannot help (64, 78).
        if error.exit_code != 69 and env.get(BUDGET_DIR):
            Budget(spec.max_restarts, spec.progress_window, env[BUDGET_DIR]).end(error.exit_code, "")
        importing.join()  # an exit with the import half done could end in a crash rather than this code
        raise
    held = _hold_directories(spec, say, env)
    note = gloo_fallback_note(topology, devices.torch_cuda_version())
    if note:
        say(note)
    topology, extra = _generation(topology, spec.connect_timeout)
    # The whole budget: the agent reads what is spent (trainpod.restarts) and decides each restart.
    plan = build_plan(topology, spec.target, env, cpus=available_cpus(), max_restarts=spec.max_restarts,
                      term_grace=spec.term_grace, join_timeout=spec.connect_timeout,
                      progress_window=spec.progress_window, rejoin_timeout=spec.rejoin_timeout,
                      hang_timeout=spec.hang_timeout, warm_start=spec.warm_start,
                      recovery=spec.recovery, trust_checkpoints=spec.trust_checkpoints)
    rdzv = topology.rdzv
    where = (f"node {topology.node_rank} of {topology.nnodes}" if topology.node_rank is not None
             else f"{rdzv.nnodes} nodes, this one's rank from the rendezvous")
    meet = (f"master {topology.master_addr}:{topology.master_port}" if rdzv.backend == "c10d"
            else f"{rdzv.backend} rendezvous {rdzv.id} at {rdzv.endpoint}")
    say(f"{topology.source}: {where}, {topology.nproc_per_node} process(es) per node, {meet}, "
        f"{topology.backend} over {topology.interface}")
    sys.stdout.flush()
    importing.join()  # before the environment changes: glibc's getenv (torch's libraries) races setenv
    os.environ.update({**env, **plan.env, **extra})  # the agent's, and through it the ranks'
    from trainpod import agent

    code = agent.main(plan.agent_args)
    if held is not None:
        held.release(ended=_job_over(code, spec, env))
    sys.exit(code)


def _hold_directories(spec: JobSpec, say, env: Mapping[str, str]) -> dirlock.Hold | None:
    """This job's hold on its output and checkpoint directories (trainpod.dirlock), its heartbeat started;
    another job's: 78, recorded as the job's end (no layer retries it)."""
    topology, target = spec.topology, spec.target
    key = dirlock.job_key(topology.rdzv.id, topology.rdzv.backend, topology.master_addr, topology.master_port, C10D_ID)
    try:
        held = dirlock.hold(target.directories(), key, topology.node_label, spec.lock_timeout, say)
    except TrainpodError as error:
        if env.get(BUDGET_DIR):
            Budget(spec.max_restarts, spec.progress_window, env[BUDGET_DIR]).end(error.exit_code, "")
        raise
    if held is not None:
        held.start()
    return held


def _job_over(code: int, spec: JobSpec, env: Mapping[str, str]) -> bool:
    """Whether the agent's exit ends the job on this node: it succeeded, ran unsupervised, or the budget
    recorded the job's end; else supervisord starts it again, and the directories stay held."""
    if code == 0 or not env.get(BUDGET_DIR):
        return True
    return Budget(spec.max_restarts, spec.progress_window, env[BUDGET_DIR]).load().final is not None


def _import_the_launcher() -> threading.Thread:
    """Import torch's launcher (about 0.8 s of a 2-core host) on a thread while the checks run: on a node
    that waits for the master, the wait and the import overlap instead of adding up (torchrun, which
    does not wait, imports first and then retries the master's store). A failed import is left to the
    agent's own import, which raises it again in the main thread (Python forgets a failed module)."""

    def load() -> None:
        try:
            import torch.distributed.run  # noqa: F401

            import trainpod.agent  # noqa: F401
        except BaseException:  # noqa: BLE001, S110 (raised again by the agent's import)
            pass

    thread = threading.Thread(target=load, name="trainpod-import", daemon=True)
    thread.start()
    return thread


def _generation(topology: Topology, timeout: float) -> tuple[Topology, dict[str, str]]:
    """With etcd: the id of this run's rendezvous, `<id>.g<N>` (trainpod.rendezvous.generation), and what
    the agent needs to advance N when its run closes the rendezvous. etcd answered the preflight just now."""
    rdzv = topology.rdzv
    if not rdzv.uses_etcd:
        return topology, {}
    from trainpod.errors import UnreachableError
    from trainpod.rendezvous import generation
    from trainpod.rendezvous.etcd_http import EtcdClient, EtcdUnreachableError

    try:
        number = generation.current(EtcdClient(rdzv.endpoint, min(timeout, 10.0), rdzv.access), rdzv.id)
    except EtcdUnreachableError as error:
        raise UnreachableError(f"etcd at {rdzv.endpoint}: reading the job's rendezvous generation: {error}") from None
    topology = replace(topology, rendezvous=replace(rdzv, id=generation.run_id(rdzv.id, number)))
    return topology, {generation.BASE_VAR: rdzv.id, generation.GENERATION_VAR: str(number)}


def main() -> int:
    # supervisord's child, and so is the agent it becomes: they die with supervisord.
    orphans.die_with_parent(orphans.PARENT_SIGNAL, supervisor_pid())
    text = os.environ.pop(SPEC_VAR, None)  # popped: the agent and the ranks need none of it
    if not text:
        print(f"trainpod.job: error: {SPEC_VAR} is not set: this module is started by `trainpod run`", file=sys.stderr)
        return EXIT_USAGE
    spec = JobSpec.from_json(text)
    try:
        run(spec)
    except TrainpodError as error:
        print(f"{log.prefix(spec.topology.node_rank)}: error: {error}", file=sys.stderr, flush=True)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
