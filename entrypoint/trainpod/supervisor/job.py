"""The supervised job: `python -m trainpod.supervisor.job`, the program supervisord runs and restarts.

    trainpod run (outer: flags, variables, topology; 64 and 78 end here, never supervised)
      -> supervisord -> python -m trainpod.supervisor.job (this module: preflight, then the agent, in this process)

The outer run hands over everything it resolved as a RunSpec (trainpod.runspec), so nothing is
parsed twice. Here the preflight checks run (they wait for the master, so an
unreachable one, 69, is retried by the supervisor), then this process becomes torchrun's agent
with what is left of the restart budget: it runs trainpod.agent's main() with the launch plan's
arguments and environment, as `python -m trainpod.agent` would, without starting Python and
importing trainpod a second time (an exec would add a Python start to every start of the job). `trainpod run
--no-supervise` calls run() in its own process instead.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import replace
from typing import NoReturn

from trainpod import log, proctitle
from trainpod.agent import zygote
from trainpod.contract import EXIT_UNAVAILABLE, EXIT_USAGE, JOB_MODULE, RDZV_BASE_ID_VAR, RDZV_GENERATION_VAR, RUN_SPEC_VAR
from trainpod.errors import TrainpodError
from trainpod.launcher import devices
from trainpod.launcher.launch import available_cpus, build_plan
from trainpod.launcher.preflight import run_preflight
from trainpod.runspec import RunSpec
from trainpod.supervisor import dirlock, orphans, restarts
from trainpod.supervisor.restarts import Budget
from trainpod.supervisor.supervise import supervisor_pid
from trainpod.topology import C10D_ID, Topology


def gloo_fallback_note(topology: Topology, cuda: str | None) -> str | None:
    """One line when a CUDA build of torch (`cuda`: its version) falls back to gloo because no GPU
    is visible: on a GPU host that usually means the container was started without GPUs."""
    if cuda and topology.backend == "gloo" and topology.origins.get("backend") == "default (no GPU visible)":
        return (f"no GPU visible: gloo instead of NCCL, on the CPU (torch here is built for CUDA {cuda}; "
                "give the container GPUs, e.g. docker run --gpus all, to train on them with NCCL)")
    return None


def run(spec: RunSpec, env: Mapping[str, str] = os.environ) -> NoReturn:
    """Preflight, then this process becomes the agent (torchrun) and exits with its code. (The
    topology's warnings were printed once, by the outer run.)"""
    say = log.writer(spec.topology.node_label)  # "@host" where the rendezvous will number the node
    try:
        topology, checks = _check_while_importing(spec, env, say)
    except TrainpodError as error:
        # Said once, by the job; recorded as the job's end where retrying cannot help (64, 78).
        if error.exit_code != EXIT_UNAVAILABLE:
            _end_job(spec, env, error.exit_code)
        raise
    # torch imported (and before the environment changes: glibc's getenv in torch's libraries races setenv): the
    # job's copy of itself, the node's fork server to be, shares the import; before any thread, lock or connection
    # of the agent's, and once the checks' thread has ended in the kernel too (trainpod.agent.zygote)
    zygote.fork(joined=[checks])
    held = _hold_directories(spec, say, env)
    note = gloo_fallback_note(topology, devices.torch_cuda_version())
    if note:
        say(note)
    topology, extra = _generation(topology, spec.connect_timeout)
    # The whole budget: the agent reads what is spent (trainpod.supervisor.restarts) and decides each restart.
    plan = build_plan(spec.with_topology(topology), env, cpus=available_cpus())
    rdzv = topology.rdzv
    where = (f"node {topology.node_rank} of {topology.nnodes}" if topology.node_rank is not None
             else f"{rdzv.nnodes} nodes, this one's rank from the rendezvous")
    meet = (f"master {topology.master_addr}:{topology.master_port}" if rdzv.backend == "c10d"
            else f"{rdzv.backend} rendezvous {rdzv.id} at {rdzv.endpoint}")
    say(f"{topology.source}: {where}, {topology.nproc_per_node} process(es) per node, {meet}, "
        f"{topology.backend} over {topology.interface}")
    sys.stdout.flush()
    os.environ.update({**env, **plan.env, **extra})  # the agent's, and through it the ranks'
    from trainpod.agent import agent

    code = agent.main(plan.agent_args)
    if held is not None:
        held.release(ended=_job_over(code, spec, env))
    exit_before_finalization(code)


def exit_before_finalization(code: int) -> NoReturn:
    """End the process with `code` as the interpreter would, but for its finalization: the non-daemon threads
    joined, the atexit handlers run (multiprocessing's finalizers, the rank lines still pending, logging's
    flush), the streams flushed, then os._exit. torch's rendezvous keep-alive runs on a daemon thread; one
    still inside a store call when the store's host was gone returned during finalization, which ends such a
    thread inside C++ that cannot unwind, and the agent aborted after its code was decided ("terminate called
    without an active exception": a c10d survivor exited 137 instead of 69; docs/shutdown.md, section 4, also
    the ranks' case). Without the handlers, multiprocessing's semaphores were reported leaked at every exit."""
    threading._shutdown()  # what Py_FinalizeEx does first (private, as warm.py's atexit._run_exitfuncs)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _hold_directories(spec: RunSpec, say, env: Mapping[str, str]) -> dirlock.Hold | None:
    """This job's hold on its output and checkpoint directories (trainpod.supervisor.dirlock), its heartbeat started;
    another job's: 78, recorded as the job's end (no layer retries it)."""
    topology, target = spec.topology, spec.target
    key = dirlock.job_key(topology.rdzv.id, topology.rdzv.backend, topology.master_addr, topology.master_port, C10D_ID)
    try:
        held = dirlock.hold(target.directories(), key, topology.node_label, spec.lock_timeout, say)
    except TrainpodError as error:
        _end_job(spec, env, error.exit_code)
        raise
    if held is not None:
        held.start()
    return held


def _budget(spec: RunSpec, env: Mapping[str, str]) -> Budget | None:
    """This node's restart budget, kept by the supervisor (None when the job runs unsupervised)."""
    budget = restarts.node_budget(spec.max_restarts, spec.progress_window, env)
    return budget if budget.path is not None else None


def _end_job(spec: RunSpec, env: Mapping[str, str], code: int) -> None:
    """Record `code` as the job's end, so that no layer retries it (a mistake retrying cannot fix)."""
    budget = _budget(spec, env)
    if budget is not None:
        budget.end(code, "")


def _job_over(code: int, spec: RunSpec, env: Mapping[str, str]) -> bool:
    """Whether the agent's exit ends the job on this node: it succeeded, ran unsupervised, or the budget
    recorded the job's end; else supervisord starts it again, and the directories stay held."""
    budget = _budget(spec, env)
    return code == 0 or budget is None or budget.load().final is not None


def _check_while_importing(spec: RunSpec, env: Mapping[str, str], say: log.Log) -> tuple[Topology, threading.Thread]:
    """The preflight checks on a thread of their own while this thread, the main one, imports torch's launcher (most
    of the agent's start): on a node that waits for the master, the wait and the import overlap instead of adding up
    (torchrun, which does not wait, imports first and then retries the master's store). Returns the checked topology
    and the checks' thread (joined); what the checks raised is raised here, once the import is done.

    Not the other way round: the node's fork server is a copy of this process, and a copy forked after another
    thread ran torch's import (its MKL code) can inherit MKL's allocator lock held (trainpod.agent.zygote's module
    docstring: what that does to the ranks, and why the checks' thread is waited for until it has ended)."""
    outcome: list = []

    def check() -> None:
        try:
            outcome.append(run_preflight(spec.topology, env, connect_timeout=spec.connect_timeout, log=say,
                                         target=spec.target))
        except BaseException as error:  # noqa: BLE001 (raised again in the main thread, below)
            outcome.append(error)

    thread = threading.Thread(target=check, name="trainpod-preflight", daemon=True)
    thread.start()
    _import_the_launcher()
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0], thread


def _import_the_launcher() -> None:
    """Import torch's launcher and trainpod's agent, in the main thread (_check_while_importing says why). A failed
    import is left to the agent's own import, which raises it again (Python forgets a failed module)."""
    try:
        import torch.distributed.run  # noqa: F401

        import trainpod.agent.agent  # noqa: F401
    except Exception:  # noqa: BLE001, S110 (raised again by the agent's import)
        pass


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
    return topology, {RDZV_BASE_ID_VAR: rdzv.id, RDZV_GENERATION_VAR: str(number)}


def main() -> int:
    # supervisord's child, and so is the agent it becomes: they die with supervisord.
    orphans.die_with_parent(orphans.PARENT_SIGNAL, supervisor_pid())
    proctitle.set_command_line([sys.executable, "-m", JOB_MODULE])  # the room stays, for the forked (trainpod.contract)
    try:
        spec = RunSpec.from_env(os.environ)
    except TrainpodError as error:
        print(f"trainpod.supervisor.job: error: {error}", file=sys.stderr)
        return error.exit_code
    if spec is None:
        print(f"trainpod.supervisor.job: error: {RUN_SPEC_VAR} is not set: this module is started by `trainpod run`", file=sys.stderr)
        return EXIT_USAGE
    try:
        run(spec)
    except TrainpodError as error:
        print(f"{log.prefix(spec.topology.node_label)}: error: {error}", file=sys.stderr, flush=True)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
