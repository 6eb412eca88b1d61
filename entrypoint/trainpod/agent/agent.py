"""torchrun's agent, with what a container needs: node-prefixed logs, real exit codes, a shared budget.

`python -m trainpod.agent ARGS` takes exactly torchrun's arguments. torchrun itself exits 1
whatever its workers returned; here the exit code is the first failed rank's own code (earliest by
time; a signal becomes 128 + its number, as a shell reports it), so a cluster can tell a crash
from a pre-emption. torchrun restarts a failed worker group up to --max-restarts times whatever
the code; here trainpod.agent.policy decides each restart (never after 64, 73, 78 or 143; a budget
of restarts without progress, shared with the supervisor; the same failure twice ends the job),
and one node that stops or gives up ends the job on every node (trainpod.agent.control).

It also runs the hang watch (trainpod.agent.hangwatch, --hang-timeout): a stalled worker group is
killed and counts as a failed one with code 124, which the same policy decides on.

torch offers no hook for these changes, so the agent relies on some of torch's private API:
`torch.distributed.launcher.api.LocalElasticAgent` (replaced by a subclass), and in the subclass
`_monitor_workers()`, `_start_workers()`, `_invoke_run()`, `_shutdown()`, `_rendezvous()` (then
`_worker_group.group_world_size`), `_remaining_restarts`, `_worker_group`, `_start_method` (trainpod.agent.warm),
`_pcontext.stderrs`, and its processes (`subprocess_handlers`, or a warm start's `_pc.processes`: which ranks
exited 0), the c10d rendezvous handler's `_store`, the etcd backend's module constant
`CONST_WORKER_KEEPALIVE_TTL` (trainpod's --rdzv-conf keep_alive_ttl) and its `_create_etcd_client()`
(wrapped to give python-etcd etcd's user and password: trainpod.rendezvous.etcd_http.EtcdAccess), the dynamic rendezvous's
one-second poll (its `_delay` and its state holder's `_cache_duration`: trainpod.agent.policy polls
faster) and
`torch.distributed.elastic.rendezvous.utils._matches_machine_hostname()`; and the function that copies
each rank's log file onto the agent's output, `torch.distributed.elastic.multiprocessing.tail_log.tail_logfile`
(replaced by trainpod.agent.ranklog's, which TailLog.start() finds by name); and where the dynamic rendezvous
numbers the nodes (trainpod.rendezvous.node_order). Checked with torch 2.13.0
(CHECKED_WITH); `torch_internals_missing()` lists what a newer torch no longer has, and a unit test
(tests/unit/agent/test_agent.py) fails with that list before an upgrade can break a job.
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import sys

from trainpod import log, records
from trainpod.agent import hang, hangwatch, metrics, policy, ranklog, stragglerwatch
from trainpod.contract import AGENT_PID_VAR, OUTPUT_DIR_VAR, PROGRESS_DIR_VAR, RDZV_BASE_ID_VAR, RDZV_GENERATION_VAR
from trainpod.errors import EXIT_CONFIG, EXIT_UNAVAILABLE, TrainpodError
from trainpod.rendezvous import node_order
from trainpod.rendezvous.conf import KEEP_ALIVE_TTL, KEEP_ALIVE_TTL_RANGE
from trainpod.rendezvous.etcd_http import EtcdAccess
from trainpod.runspec import RunSpec, Target
from trainpod.supervisor import supervise
from trainpod.topology import Rendezvous, Topology

CHECKED_WITH = ("2.13.0",)  # torch versions the private API below was read and tested against


def torch_internals_missing() -> list[str]:
    """What of torch's private API the agent uses is missing from the installed torch ([] if nothing)."""
    import torch.distributed.launcher.api as launcher
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    missing = []
    if getattr(launcher, "LocalElasticAgent", None) is not LocalElasticAgent:
        missing.append("torch.distributed.launcher.api.LocalElasticAgent (the class the launcher builds)")
    for method in ("_monitor_workers", "_start_workers", "_invoke_run", "_shutdown", "_rendezvous"):
        if not callable(getattr(LocalElasticAgent, method, None)):
            missing.append(f"LocalElasticAgent.{method}()")
    missing += _rendezvous_store_missing()
    from torch.distributed.elastic.rendezvous import etcd_rendezvous, utils

    if not isinstance(getattr(etcd_rendezvous, "CONST_WORKER_KEEPALIVE_TTL", None), int):
        missing.append("torch.distributed.elastic.rendezvous.etcd_rendezvous.CONST_WORKER_KEEPALIVE_TTL (--rdzv-conf "
                       "keep_alive_ttl)")
    creator = getattr(etcd_rendezvous, "_create_etcd_client", None)
    if not callable(creator) or "_create_etcd_client(params)" not in inspect.getsource(etcd_rendezvous.create_rdzv_handler):
        missing.append("torch.distributed.elastic.rendezvous.etcd_rendezvous._create_etcd_client(params), called by "
                       "create_rdzv_handler (wrapped: etcd's user and password for python-etcd)")
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    executor = getattr(dynamic_rendezvous, "_DistributedRendezvousOpExecutor", None)
    if (executor is None or not callable(getattr(dynamic_rendezvous, "_delay", None))
            or "_delay(seconds=1)" not in inspect.getsource(executor)):  # fmt: skip
        missing.append("torch.distributed.elastic.rendezvous.dynamic_rendezvous._delay(seconds=1), the executor's "
                       "poll while a node waits (trainpod.agent.policy polls faster)")
    holder = getattr(dynamic_rendezvous, "_BackendRendezvousStateHolder", None)
    if holder is None or "self._cache_duration" not in inspect.getsource(holder):
        missing.append("torch.distributed.elastic.rendezvous.dynamic_rendezvous._BackendRendezvousStateHolder"
                       "._cache_duration (how long a read state is reused: trainpod.agent.policy polls faster)")
    from torch.distributed import Store
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    backend = getattr(c10d_rendezvous_backend, "C10dRendezvousBackend", None)
    if (holder is None or backend is None or "self._backend" not in inspect.getsource(holder)
            or "self._store" not in inspect.getsource(backend) or not callable(getattr(Store, "clone", None))):  # fmt: skip
        missing.append("torch.distributed.elastic.rendezvous's _BackendRendezvousStateHolder._backend, "
                       "C10dRendezvousBackend._store and Store.clone() (trainpod.agent.policy gives the c10d rendezvous' "
                       "heartbeats a client of the store of their own)")
    handler = getattr(dynamic_rendezvous, "DynamicRendezvousHandler", None)
    if handler is None or not all(f"self.{name}:" in inspect.getsource(handler.__init__)
                                  for name in ("_bootstrap_store_info", "_shared_tcp_store_server")):
        missing.append("torch.distributed.elastic.rendezvous.dynamic_rendezvous.DynamicRendezvousHandler's "
                       "_bootstrap_store_info and _shared_tcp_store_server (trainpod.agent.policy makes the workers' "
                       "store anew in each round)")
    if not callable(getattr(utils, "_matches_machine_hostname", None)):
        missing.append("torch.distributed.elastic.rendezvous.utils._matches_machine_hostname() (who hosts a c10d store)")
    try:
        spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=None, entrypoint="true", max_restarts=2)
        agent = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs())
    except Exception as exc:  # a changed constructor: nothing below can be checked
        return [*missing, f"LocalElasticAgent(spec, logs_specs=...) ({type(exc).__name__}: {exc})"]
    if getattr(agent, "_remaining_restarts", None) != 2:
        missing.append("LocalElasticAgent._remaining_restarts (the restarts left)")
    spec = getattr(getattr(agent, "_worker_group", None), "spec", None)
    if getattr(spec, "max_restarts", None) != 2:
        missing.append("LocalElasticAgent._worker_group.spec.max_restarts")
    if getattr(spec, "entrypoint", None) != "true" or not hasattr(spec, "args"):
        missing.append("WorkerSpec.entrypoint and .args (the ranks' command)")
    if getattr(agent, "_start_method", None) != "spawn":
        missing.append("LocalElasticAgent._start_method (how function entrypoints start: trainpod.agent.warm's forkserver)")
    if not hasattr(agent, "_pcontext"):
        missing.append("LocalElasticAgent._pcontext (its stderrs: the ranks' log files)")
    from torch.distributed.elastic.multiprocessing.api import PContext

    if "self.stderrs" not in inspect.getsource(PContext.__init__):
        missing.append("PContext.stderrs (local rank -> the file of its stderr)")
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, SubprocessContext

    if "self.subprocess_handlers" not in inspect.getsource(SubprocessContext):
        missing.append("SubprocessContext.subprocess_handlers (each rank's Popen: which ranks exited 0, trainpod.agent.policy)")
    if "self._pc" not in inspect.getsource(MultiprocessContext):
        missing.append("MultiprocessContext._pc (the warm ranks' processes: which exited 0, trainpod.agent.policy)")
    missing += ranklog.torch_internals_missing()  # tail_log.tail_logfile, as TailLog.start() calls it
    missing += node_order.torch_internals_missing()  # where the dynamic rendezvous numbers the nodes
    from torch.distributed import distributed_c10d

    for name in ("_set_pg_timeout", "_get_default_timeout"):  # trainpod.train.inprocess: a re-formed group's timeout
        if not callable(getattr(distributed_c10d, name, None)):
            missing.append(f"torch.distributed.distributed_c10d.{name}() (trainpod.train.inprocess: a re-formed group's timeout)")
    return missing


def _rendezvous_store_missing() -> list[str]:
    """The c10d rendezvous handler keeps the store the agents share as `_store` (trainpod.agent.control)."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    store = dist.HashStore()
    try:
        handler = DynamicRendezvousHandler.from_backend("check", store, C10dRendezvousBackend(store, "check"), 1, 1)
    except Exception as exc:
        return [f"DynamicRendezvousHandler.from_backend(...) ({type(exc).__name__}: {exc})"]
    return [] if getattr(handler, "_store", None) is store else ["DynamicRendezvousHandler._store (the store the agents share)"]


class _PrefixedFormatter(logging.Formatter):
    """Puts the node prefix in front of every line another formatter produces."""

    def __init__(self, inner: logging.Formatter | None, prefix: str):
        super().__init__()
        self.inner = inner or logging.Formatter()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(self.prefix + line for line in self.inner.format(record).splitlines())


def _prefix_logs(prefix: str) -> None:
    logging.basicConfig(format="%(name)s %(levelname)s: %(message)s", stream=sys.stderr)
    # torch installs handlers of its own ("torch", "torch.distributed"), so wrap every handler.
    loggers = [logging.getLogger()] + [
        logger for logger in logging.root.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            handler.setFormatter(_PrefixedFormatter(handler.formatter, prefix))
            handler.addFilter(log.ASIDE)  # torch's lines about a failure trainpod names: in the run's agent.log


def _report(failures, say: log.Log) -> None:
    for rank, failure in sorted(failures.items()):
        say(f"rank {rank} (local rank {failure.local_rank}) {policy.describe_failure(failure)}")


def _install_agent_class(say: log.Log, run: RunSpec, watch: hangwatch.Watch | None = None, hosts_store: bool = False,
                         stragglers: stragglerwatch.StragglerWatch | None = None) -> None:
    """Make torchrun's launcher build our agent: torch offers no hook for the changes it makes."""
    import torch.distributed.launcher.api as launcher
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent(policy.AgentPolicy, hangwatch.WatchedAgent, stragglerwatch.StragglerAgent, LocalElasticAgent):
        """torchrun's agent with trainpod's restart policy, stop key and orphan guard (trainpod.agent.policy),
        which sees a hung worker group (trainpod.agent.hangwatch) as a failed one and names a straggler
        (trainpod.agent.stragglerwatch)."""

        hang_watch = watch
        straggler_watch = stragglers
        would_host_store = hosts_store
        run_spec = run

    launcher.LocalElasticAgent = Agent


def _would_host_c10d_store(args) -> bool:
    """Whether an agent started on this node hosts the c10d store, by torch's rule: the rendezvous
    configuration's is_host if set, else whether the endpoint names this machine."""
    if args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        return False
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

    conf = _rdzv_conf(args)
    is_host = RendezvousParameters(args.rdzv_backend, args.rdzv_endpoint, "check", 1, 1, **conf).get_as_bool("is_host")
    if is_host is not None:
        return is_host
    return _matches_machine_hostname(parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=DEFAULT_PORT)[0])


def _run_spec(args) -> RunSpec:
    """The run as the launcher wrote it (trainpod.runspec). An agent started as torchrun is (by hand, by
    a benchmark) has none: it runs what its own flags say, with the settings' defaults and no warm start."""
    spec = RunSpec.from_env(os.environ)
    if spec is not None:
        return spec
    from torch.distributed.run import parse_min_max_nnodes

    low, high = parse_min_max_nnodes(args.nnodes)
    host, _, port = (args.rdzv_endpoint or "127.0.0.1:29400").rpartition("://")[2].partition(",")[0].rpartition(":")
    topology = Topology(source="torchrun's flags", nnodes=high, node_rank=args.node_rank if high == low else None,
                        nproc_per_node=int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else 1,
                        master_addr=host.strip("[]") or "127.0.0.1", master_port=int(port) if port.isdigit() else 29400,
                        backend="gloo", interface=None,
                        rendezvous=Rendezvous(backend=args.rdzv_backend, endpoint=args.rdzv_endpoint, id=args.rdzv_id,
                                              min_nodes=low, max_nodes=high))
    return RunSpec(topology=topology, target=Target(command=(args.training_script, *args.training_script_args)),
                   max_restarts=args.max_restarts, warm_start="off")


def _rdzv_conf(args) -> dict[str, str]:
    return dict(item.split("=", 1) for item in args.rdzv_conf.split(",") if "=" in item)


def _set_etcd_keep_alive_ttl(args) -> str | None:
    """torch's etcd backend keeps each node in a rendezvous by a key with a TTL that is a module constant
    (10 s, renewed every 5 s), so a lost node is seen up to 10 s late. --rdzv-conf keep_alive_ttl=N
    (an elastic etcd job's default: 4, trainpod.launcher.resolve) sets it for this agent. Returns the error line
    for a bad value, None otherwise."""
    value = _rdzv_conf(args).get(KEEP_ALIVE_TTL)
    if args.rdzv_backend != "etcd" or value is None:
        return None
    low, high = KEEP_ALIVE_TTL_RANGE
    if not value.strip().isdigit() or not low <= int(value) <= high:
        return f"--rdzv-conf {KEEP_ALIVE_TTL}={value!r}: expected whole seconds from {low} to {high}"
    from torch.distributed.elastic.rendezvous import etcd_rendezvous

    etcd_rendezvous.CONST_WORKER_KEEPALIVE_TTL = int(value)  # read by the backend each time it sets or renews the key
    return None


def _etcd_access(args) -> EtcdAccess:
    """etcd's TLS files (the agent's --rdzv-conf) and user (TRAINPOD_ETCD_*), as the launch plan passed them."""
    return EtcdAccess.from_env(_rdzv_conf(args))


def _give_etcd_credentials(args) -> str | None:
    """torch's etcd backend makes its python-etcd client with TLS from --rdzv-conf (protocol, cacert, cert, key)
    and never with a user, though python-etcd sends one (username/password: HTTP basic auth on every request
    of etcd's v2 API). So torch's client creator is wrapped to set them, the password read here, once.
    Returns the error line for a password that cannot be read, None otherwise."""
    access = _etcd_access(args)
    if args.rdzv_backend != "etcd" or not access.user:
        return None
    try:
        password = access.password()
    except TrainpodError as error:
        return str(error)
    from torch.distributed.elastic.rendezvous import etcd_rendezvous

    create = etcd_rendezvous._create_etcd_client

    def create_with_user(params):
        client = create(params)
        client.username, client.password = access.user, password  # python-etcd builds each request's header from them
        return client

    etcd_rendezvous._create_etcd_client = create_with_user
    return None


def _without_unknown_shutdown_timeout(parser, argv: list[str], say: log.Log) -> list[str]:
    """torchrun's --shutdown-timeout (the wait between SIGTERM and SIGKILL of the workers) came with
    torch 2.13; an older torch keeps its fixed 30 s, and the flag is left out rather than refused."""
    if "--shutdown-timeout" not in argv or "--shutdown-timeout" in parser.format_usage():
        return argv
    at = argv.index("--shutdown-timeout")
    say(f"warning: this torch has no --shutdown-timeout: the ranks get its fixed 30 s after SIGTERM, not {argv[at + 1]} s")
    return argv[:at] + argv[at + 2 :]


def main(argv: list[str] | None = None) -> int:
    node = log.node_from_env() or "?"
    say = log.writer(node)

    from torch.distributed.run import get_args_parser, run

    _prefix_logs(log.tag(node) + " ")
    parser = get_args_parser()
    argv = _without_unknown_shutdown_timeout(parser, sys.argv[1:] if argv is None else argv, say)
    args = parser.parse_args(argv)
    try:
        run_spec = _run_spec(args)
    except TrainpodError as error:
        say(f"error: {error}")
        return error.exit_code
    # Where the ranks report (trainpod.train.progress), decided once: the ranks inherit the agent's environment.
    if not os.environ.get(PROGRESS_DIR_VAR, "").strip():
        os.environ[PROGRESS_DIR_VAR] = policy.progress_dir()
    os.environ.update(hang.pipe_env(os.environ[PROGRESS_DIR_VAR], os.environ))
    # The agent's own files (a hang's stacks, stragglers.jsonl) go where the example writes its metrics: its
    # --output-dir, which the launcher read (RunSpec.target); the ranks inherit the same value.
    if run_spec.target.output_dir and not os.environ.get(OUTPUT_DIR_VAR, "").strip():
        os.environ[OUTPUT_DIR_VAR] = run_spec.target.output_dir
    watch = hangwatch.Watch.wanted(run_spec.hang_timeout, node, say)  # --hang-timeout, None when 0
    stragglers = stragglerwatch.StragglerWatch.wanted(run_spec.straggler_window, node, say, os.environ)
    # The run's records go to the output directory, where there is one (trainpod.records: `trainpod report` draws them).
    output = os.environ.get(OUTPUT_DIR_VAR, "").strip()
    if run_spec.metrics_port or output:
        try:
            metrics.start(os.environ[PROGRESS_DIR_VAR], run_spec.metrics_port,
                          records.Writer(output, say) if output else None)
        except OSError as error:  # the port is taken, or not ours to bind: a configuration error, not retried
            say(f"error: --metrics-port {run_spec.metrics_port}: cannot serve the metrics there: {error.strerror or error}")
            return EXIT_CONFIG
    # A rank's stdout is a file (torchrun's tee), which Python buffers in blocks of 8 KiB: `python train.py` (a
    # command, not an example: those run -u) showed its lines when the job ended, wherever trainpod's output went.
    # Unbuffered, each line reaches the file when printed, and the tee copies it on. The user's own value stands.
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # the ranks inherit the agent's environment
    if watch is not None:
        os.environ[AGENT_PID_VAR] = str(os.getpid())  # the ranks ask this process to read their stacks
    # trainpod's own rendezvous backend (etcd's v3 API) must be in torch's registry before the launcher
    # creates the handler for --rdzv-backend etcd-v3.
    from trainpod.rendezvous import etcd_v3

    etcd_v3.register()

    bad = _set_etcd_keep_alive_ttl(args) or _give_etcd_credentials(args)
    if bad:
        say(f"error: {bad}")
        return EXIT_CONFIG
    _install_agent_class(say, run_spec, watch, _would_host_c10d_store(args), stragglers)
    ranklog.install()  # the ranks' lines whole, a script's error once (torch's tail_logfile replaced)
    code, signalled = _run(run, args, say)
    # torch's launcher closed the rendezvous (it does at any end but a signal); a signal that ended a
    # fixed-size job (SIGTERM, or another node's stop) leaves it open, with this run's nodes in it.
    current = policy.current()
    # for the other nodes the job is not over: this node left it open, or left it (a check, its ranks' failures)
    left_open = current is not None and (current.left_open or current.left_job)
    if (not signalled or not run_spec.topology.rdzv.elastic) and not left_open:
        _next_generation(_etcd_endpoint(args), args.rdzv_backend, say, _etcd_access(args))
    return code


def _etcd_endpoint(args) -> str:
    if args.rdzv_backend == "etcd" and _rdzv_conf(args).get("protocol") == "https":
        return f"https://{args.rdzv_endpoint}"  # (torch's etcd backend takes the scheme as protocol=https)
    return args.rdzv_endpoint


def _ended_while_waiting(args, say: log.Log) -> bool:
    """This node found its etcd rendezvous closed as it waited for a round: whether the run ended meanwhile, its
    other nodes done with it (said here; trainpod.rendezvous.generation.ended_after), so that no retry starts
    the job again on this node alone."""
    from trainpod.rendezvous import generation
    from trainpod.rendezvous.etcd_http import EtcdClient

    base, number = os.environ.get(RDZV_BASE_ID_VAR), os.environ.get(RDZV_GENERATION_VAR)
    if not base or number is None:
        return False
    try:
        after = generation.ended_after(EtcdClient(_etcd_endpoint(args), 5.0, _etcd_access(args)), base, int(number))
    except Exception:  # etcd gone: the rendezvous error is said as any other
        return False
    if after is None:
        return False
    say(f"the job's run in rendezvous {generation.run_id(base, int(number))} ended while this node waited to join a "
        f"round of it (its other nodes closed it): nothing left for this node to run (the job's next run meets in "
        f"{generation.run_id(base, after)})")
    return True


def _next_generation(endpoint: str, backend: str, say: log.Log, access: EtcdAccess | None = None) -> None:
    """With etcd: this run is over, so the job's next run meets in the next generation
    (trainpod.rendezvous.generation). Best effort: with etcd gone now, the next run of the job would
    meet this run's closed rendezvous, and the warning says so. Only a closed rendezvous needs a new
    generation: one whose close never reached etcd (it lost its quorum) is still open, other nodes may
    already meet in it again, and advancing would split the job across two generations."""
    from trainpod.rendezvous import etcd_v3, generation

    base, number = os.environ.get(RDZV_BASE_ID_VAR), os.environ.get(RDZV_GENERATION_VAR)
    if not base or number is None:
        return
    from trainpod.rendezvous.etcd_http import EtcdClient

    try:
        client = EtcdClient(endpoint, 5.0, access)
        run_id = generation.run_id(base, int(number))
        if backend == etcd_v3.NAME and etcd_v3.closed(client, run_id) is False:
            say(f"the rendezvous {run_id} is still open (its close did not reach etcd): the job's next run meets in it")
            return
        generation.advance(client, base, int(number))
    except Exception as error:  # etcd gone: the run's result matters more than the next run's id
        say(f"warning: could not advance the rendezvous generation of {base} in etcd ({type(error).__name__}: {error}): "
            f"the next run of this job may meet the closed rendezvous {generation.run_id(base, int(number))}")


def _run(run, args, say: log.Log) -> tuple[int, bool]:
    """(exit code, whether a signal ended the run) of torchrun's run()."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousError

    try:
        run(args)
    except ChildFailedError as error:
        current = policy.current()
        if current is not None and current.final is not None:
            return current.final.code, False  # decided, and said, by the policy
        _report(error.failures, say)
        return policy.exit_code(error.get_first_failure()[1].exitcode), False
    except policy.JobEnded as ended:
        return ended.code, False  # said by the policy: an elastic job's real failure, decided by the budget
    except policy.MasterLost:
        return EXIT_UNAVAILABLE, False  # said by the policy; final or not, it is in the budget for the supervisor
    except SignalException as error:
        if getattr(error, "code", None) is not None:  # another node ended the job (trainpod.agent.control)
            return error.code, True
        # torchrun has already stopped the workers; a stop request is no crash, so no traceback. The signal is the one
        # `trainpod run` was given: supervisord passes any on as SIGTERM (Ctrl-C's SIGINT too).
        say(f"received {supervise.stop_signal() or signal.Signals(error.sigval).name}: the workers were stopped")
        return 128 + error.sigval, True
    except RendezvousError as error:
        current = policy.current()
        if current is not None and current.rendezvous_failed():
            return EXIT_UNAVAILABLE, False  # the master went away after the start: waited --rejoin-timeout for it
        if isinstance(error, RendezvousClosedError) and _ended_while_waiting(args, say):
            return 0, False  # the run this node came to join is over: no retry starts a copy of it here
        # The other nodes did not come (or the store went away): as transient as an unreachable master.
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        say(f"error: rendezvous at {args.rdzv_endpoint} failed: {type(error).__name__}: {first_line}")
        return EXIT_UNAVAILABLE, False
    return 0, False


if __name__ == "__main__":
    sys.exit(main())
