"""What trainpod's agent does when a rank fails or a node stops: a mixin for torch's LocalElasticAgent.

trainpod.agent builds `class Agent(AgentPolicy, LocalElasticAgent)`. This module holds the policy;
agent.py the plumbing (logs, exit codes). Per failed worker group, in order:

1. another node ended the job (trainpod.agent.control's stop key): stop this node's ranks with SIGTERM,
   exit with that node's code (143 after its SIGTERM), restart nothing;
2. the master's store stopped answering after the job had started (its agent was killed, not
   stopped): wait at most --rejoin-timeout for its port, then end with 69 and one line (or, if it
   answers again, exit 69 so that supervisord starts an agent that joins the new master). Any
   multi-node c10d job: node 0's store, or the one at --rdzv-endpoint (an elastic job's too, where
   nothing else could replace it; JobControl's thread watches it, else the agent asks its port
   when the ranks failed or the rendezvous did);
3. otherwise trainpod.supervisor.restarts.Budget decides: codes that are never restarted (64, 73, 78, 143),
   the same failure twice without progress, or a budget of restarts *without progress* spent end
   the job, and the node that ends it tells the others (the stop key); else torchrun restarts the
   worker group at once.

And on SIGTERM (docker stop, pre-emption) the agent sets the stop key before it signals its own
ranks, and node 0, which holds the store, keeps it up until the others saw it.

Elastic jobs (--nnodes MIN:MAX with MIN < MAX) differ: a node that leaves is a membership change,
not the end of the job, so there is no stop key (JobControl runs only in fixed-size c10d jobs):

- SIGTERM to one node: that node leaves. Its agent stops its ranks and exits 143; nothing tells the
  other nodes to stop. With trainpod's stop vote (trainpod.train.preemption, the bundled examples) every
  rank of the job checkpoints at the same step and exits 143: the other nodes' agents take a rank's
  143 that they did not cause as the membership change it is and re-rendezvous without the node,
  resuming from that checkpoint; without the vote, their ranks fail in their next collective, and
  the rule below applies. (The whole job is stopped by stopping every node.)
- Losing the node that hosts a c10d store is rule 2: c10d cannot move its store (etcd and etcd-v3
  have no such node).
- A failed worker group is decided by the budget as always. Where this node's ranks only lost a peer
  (their traceback ends in torch.distributed, or their stderr says a peer went away), the next
  rendezvous tells what it was: if it has a different number of nodes, a node left (or joined) and
  the failure was that change, so the restart it counted is given back
  (restarts.Budget.membership_changed) and it is not "the same failure" as the next one. When the
  budget would end the job (spent, or the same failure twice), the agent first re-rendezvouses once:
  fewer nodes -> a membership change, go on; the same nodes, the first time -> one more attempt; the
  same nodes again -> the failure was real, and the job ends with the budget's code and line. The
  nodes judge progress by the job's newest committed checkpoint, which they share through the run's
  store (trainpod.agent.committed; a node's own ranks report a commit only when they resume from it).
  The one more attempt covers what sharing cannot: a commit published a moment after a node's
  failure, which makes a failing node's "same failure twice" come one failure after the others',
  and it would otherwise still be in the round that ended the job (CI, before the shared view: the
  saving node ended the job while the crashing node counted its resume as progress).
- Where this node's ranks failed on their own (an exception of theirs, a signal, not a hang), no
  membership change explains it: the restart stays counted, and when the budget would end the job
  the node leaves it instead (_leave_failing), excluded from its next rounds, and the others, whose
  ranks only lost a peer, meet again without it. Were it forgiven, a node that crashes at step 6
  every time would be forgiven by each round that formed without a late node, and the budget would
  end the whole job instead (seen in CI under load). Its exclusion, kept in the run's store, keeps it
  out when an orchestrator starts it again (trainpod.rendezvous.exclusions, _stay_out_if_excluded).

Every rank is started through trainpod.supervisor.orphans (it dies with the agent), or forked from
trainpod.agent.warm's server (--warm-start: it dies with the server, which dies with the agent), and reports its progress
to TRAINPOD_PROGRESS_DIR (set here when the launcher did not: the supervisor's directory, which
outlives the agent, or a temporary one).

A hung worker group (trainpod.agent.hangwatch, a mixin between this one and torch's agent) reaches the
policy as a failed one whose code is 124, already explained by the watch's line.

Deaths are named for what they are (restarts.Failure's cause, in the line that decides; where that line names
the first failed rank, it is not said twice):
- the kernel's OOM killer: a death by SIGKILL after the cgroup's oom_kill count grew (trainpod.supervisor.oom): "rank 1 was
  killed by the kernel's OOM killer (its cgroup's memory limit is 400 MiB, oom_kill 1 in ...)", 137; a second
  one at the same step is the same failure twice, whichever process it took;
- the fork server (--warm-start): its death takes every rank of the node, which multiprocessing reports as
  255; the line names the server and its signal (or the OOM killer), 128 + N. A server that dies while it
  forks the ranks (multiprocessing's EOFError in the agent) makes a failed worker group, decided like any;
- a rank that exited 0 while the others still ran, whose peers then failed in a collective (their traceback
  ends in torch.distributed, or their stderr says a peer closed the connection): "rank 1 exited 0 at step 3
  while the other ranks were still training (...); rank 0 then exited with 1", the peers' code.

torch's private API used here (checked by trainpod.agent.agent.torch_internals_missing()):
LocalElasticAgent._monitor_workers(), _start_workers(), _invoke_run(), _remaining_restarts,
_worker_group.spec (entrypoint, args, max_restarts, rdzv_handler), _pcontext.stderrs (and its processes:
_exited_zero()), the c10d
rendezvous handler's `_store`, the dynamic rendezvous's `_delay` and `_state_holder._cache_duration`
(_poll_rendezvous_faster()), and its handler's `_bootstrap_store_info` and `_shared_tcp_store_server`
(_fresh_workers_store()), the state holder's `_backend` and the c10d backend's `_store` (_heartbeats_of_their_own()).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from trainpod import log
from trainpod.agent import consistency, devcheck, hangwatch, metrics, netcheck, peercopy, round_gather, survivors, warm, zygote
from trainpod.agent.committed import SharedCommitted, own_client
from trainpod.agent.control import PROBE_WAIT_S, JobControl, Stop, wait_for_port
from trainpod.contract import INPROCESS_MAX_VAR, PROGRESS_DIR, PROGRESS_DIR_VAR, SUPERVISOR_DIR_VAR
from trainpod.errors import EXIT_CONFIG, EXIT_UNAVAILABLE
from trainpod.rendezvous import exclusions, node_order, presence
from trainpod.runspec import RunSpec
from trainpod.supervisor import oom, orphans, restarts, supervise
from trainpod.train import progress
from trainpod.train.distributed import PEER_LOST

_current: AgentPolicy | None = None


def current() -> AgentPolicy | None:
    """The agent of this process, once torch's launcher built it."""
    return _current


def exit_code(exitcode: int) -> int:
    """A worker's exit status as a shell reports it: 128 + N after signal N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def describe_exit(exitcode: int) -> str:
    """'exited with 3', 'was killed by SIGKILL': what a worker's raw status says."""
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with {exitcode}"


def describe_failure(failure) -> str:
    """describe_exit() of a failed worker, or what the hang watch did to it (its code is 124)."""
    if hangwatch.is_hang(failure):
        return f"was stopped by the hang watch ({failure.exitcode})"
    return describe_exit(failure.exitcode)


REPLACE_LOOK_S = 2.0  # --replace-stragglers: how often a node with a named straggler asks whether a spare waits
WAITING_LOOK_S = 0.5  # while the ranks train: how often the agent asks the rendezvous whether a node waits to join
SERVER_DEATH_WAIT_S = 2.0  # a fork server whose pipes closed is dying: at most this long until it is seen dead
LOST_STATUS = 255  # what multiprocessing reports of a rank whose fork server died (it alone could send the status)
SERVER_MARK = "trainpod_fork_server"  # on a ProcessFailure made for a fork server that died: (pid, its status)
LEFT_WHERE = "a rank exited 0 while the others were still training"


def _exited_zero(pcontext) -> set[int]:
    """The local ranks of torch's process context that have exited with 0 so far. torch's private API: its
    SubprocessContext's handlers (each a Popen), its MultiprocessContext's ProcessContext (multiprocessing's
    processes, --warm-start). Popen.poll() and Process.exitcode reap and keep the status, as torch's own poll does."""
    try:
        handlers = getattr(pcontext, "subprocess_handlers", None)
        if handlers:
            return {rank for rank, handler in handlers.items() if handler.proc.poll() == 0}
        processes = getattr(getattr(pcontext, "_pc", None), "processes", None) or []
        return {rank for rank, process in enumerate(processes) if process.exitcode == 0}
    except (AttributeError, OSError, ValueError):
        return set()


def _lost_a_peer(stderr: str | None, where: str) -> bool:
    """Whether a failed rank failed in a collective whose peer went away: its traceback ended in torch.distributed,
    or its stderr's end says a peer closed the connection."""
    if "/torch/distributed/" in where:
        return True
    try:
        with open(stderr or "", "rb") as file:
            file.seek(0, os.SEEK_END)
            file.seek(max(0, file.tell() - restarts.TAIL_BYTES))
            return PEER_LOST.search(file.read().decode("utf-8", errors="replace")) is not None
    except OSError:
        return False


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


class JobEnded(Exception):
    """The budget ended an elastic job once the rendezvous showed the same nodes again (no membership change)."""

    def __init__(self, code: int, line: str):
        super().__init__(line)
        self.code = code


class MasterLost(Exception):
    """The master's agent went away after the job started; `final`: it did not come back in time."""

    def __init__(self, line: str, final: bool):
        super().__init__(line)
        self.final = final


def _stopped_exception(code: int, line: str):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    class JobStopped(SignalException):
        """Another node ended the job: torch's agent stops the ranks as after a SIGTERM."""

    error = JobStopped(line, signal.SIGTERM)
    error.code = code
    return error


def progress_dir(env=os.environ) -> str:
    """Where the ranks report (trainpod.train.progress): inside the supervisor's directory, which outlives an
    agent (so the listener can read what the ranks last said), else a temporary directory."""
    supervisor = env.get(SUPERVISOR_DIR_VAR)
    if supervisor:
        path = Path(supervisor, PROGRESS_DIR)
        path.mkdir(exist_ok=True)
        return str(path)
    return tempfile.mkdtemp(prefix="trainpod-progress-")


class AgentPolicy:
    """Mixed in before torch's LocalElasticAgent (module docstring)."""

    would_host_store = False  # set by trainpod.agent: a new agent on this node would host the c10d store
    run_spec: RunSpec  # set by trainpod.agent: the run, as the launcher wrote it (trainpod.runspec)

    def __init__(self, spec, *args, **kwargs):
        global _current
        super().__init__(spec, *args, **kwargs)
        _current = self
        node = log.node_from_env()
        self._say = log.writer(node)
        self.node_rank = int(node) if node and node.isdigit() else 0
        self.node_label = node or "?"  # '?': the rendezvous numbers the nodes (etcd, an elastic c10d job)
        run = self.run_spec
        self.nnodes = run.topology.nnodes
        self.min_nodes = run.topology.rdzv.min_nodes
        self.elastic = run.topology.rdzv.elastic  # nodes may leave and join (trainpod.topology.Rendezvous)
        if not os.environ.get(PROGRESS_DIR_VAR):
            os.environ[PROGRESS_DIR_VAR] = progress_dir()  # the ranks inherit the agent's environment
        self._progress_dir = os.environ[PROGRESS_DIR_VAR]
        spec = self._worker_group.spec
        if isinstance(spec.entrypoint, str):  # a command (torchrun --run-path would give a function)
            target = warm.python_target([spec.entrypoint, *spec.args])
            if warm.wanted(run.warm_start, target):
                # Forked from a server that imports torch and the example now, during the rendezvous.
                spec.entrypoint, spec.args = warm.run_rank, (target[0], target[1], *target[2])
                os.environ[INPROCESS_MAX_VAR] = str(spec.max_restarts)  # in-process replacements per rank (trainpod.agent.keeper)
                self._start_method = warm.START_METHOD
                warm.start_server(warm.preload(target))
            else:
                spec.entrypoint, spec.args = orphans.wrap(spec.entrypoint, tuple(spec.args), os.getpid())
        if self._start_method != warm.START_METHOD:
            zygote.discard()  # the job's copy of itself, made for a fork server no rank needs
        node_order.hold(spec.rdzv_handler)  # each round's world as it completed, on every node
        if self.nnodes > 1 or self.elastic:  # a lost node dropped as its peers see its agent go
            self._presence(spec.rdzv_handler)
        if not self.elastic and node and node.isdigit():
            node_order.keep(spec.rdzv_handler, self.node_rank)  # global ranks by the platform's node numbering
        _poll_rendezvous_faster(spec.rdzv_handler, self.nnodes)
        _fresh_workers_store(spec.rdzv_handler)
        _heartbeats_of_their_own(spec.rdzv_handler)
        self.left_open = False  # an elastic job's rendezvous this agent did not close on its way out
        self.left_job = False  # this node left an elastic job (a check named it, or its ranks failed alike twice)
        if self.elastic:
            self._close_only_at_the_end(spec.rdzv_handler)
            node_order.when_spare(spec.rdzv_handler, self._waits_as_spare)
        self._group_started_at = time.time()  # the wall clock (the ranks' progress records use it) of the last start
        self._said_finishing = False
        _look_for_joining_nodes_less_often(spec.rdzv_handler)
        self._no_restart_once_finishing(spec.rdzv_handler)
        self.budget = restarts.node_budget(spec.max_restarts, run.progress_window)
        self.rejoin_timeout = run.rejoin_timeout
        self.final: restarts.Decision | None = None
        self.started = False  # the first worker group ran: a lost master is now a lost job
        self._attempt_started = time.monotonic()
        self.control: JobControl | None = None
        self.oom = oom.Watch()  # the cgroup's OOM kills so far: one more at a death by SIGKILL names the OOM killer
        self._left: set[int] = set()  # local ranks of this worker group that exited 0 (while the others still ran)
        self._server_lost: tuple[int, int] | None = None  # the fork server died while it started the ranks: (pid, status)
        self._nodes: int | None = None  # nodes in the last rendezvous round (an elastic job's membership)
        self._members: frozenset | None = None  # ... and which (node_order.members: a spare in a lost node's place)
        self._spare = False  # this node waits on the redundancy list (_waits_as_spare)
        self._replace_look_at = 0.0  # when _replace_a_straggler() may read the rendezvous again
        # This node's software (trainpod.agent.consistency), read on a thread while the agent waits for the other nodes:
        # a script with many local imports takes a while, which the round's exchange would otherwise wait for.
        self._fingerprint = consistency.Pending(run)
        self._counted = False  # a failure since that round was counted by the budget
        self._own = False  # ... and this node's ranks failed on their own (not a lost peer: _rendezvous keeps it counted)
        self._provisional: restarts.Decision | None = None  # the budget's end, unless a node left (elastic)
        self._reprieved = False  # that end was put off once already, the same nodes having met (_met)
        # A multi-node c10d job meets in a TCPStore that one node's agent hosts: node 0's, or the one at
        # --rdzv-endpoint. Losing that node loses the store (_master_lost).
        store = getattr(spec.rdzv_handler, "_store", None) if _backend(spec.rdzv_handler) == "c10d" else None
        self.store: tuple[str, int] | None = None
        if self.nnodes > 1 and store is not None:
            self.store = (str(getattr(store, "host", "?")), int(getattr(store, "port", 0)))  # a TCPStore's endpoint
        # The stop key lives in that store: a fixed-size job's (the module docstring), where the node ranks
        # are known (node 0's agent is the store's host).
        if self.store is not None and not self.elastic and node and node.isdigit():
            self.control = JobControl(store, node_rank=self.node_rank, nnodes=self.nnodes, is_host=self.node_rank == 0,
                                      master=self.store, committed=lambda: restarts.reported(self._progress_dir)[0],
                                      say=self._say)
        # An elastic job's store of the whole run (not of one round): the nodes it keeps out (_leave_job,
        # _stay_out_if_excluded), and, as it has no JobControl, the job's newest checkpoint its nodes share.
        self.run_store = exclusions.job_store(spec.rdzv_handler) if self.elastic else None
        self.committed: SharedCommitted | None = None
        if self.run_store is not None and self.nnodes > 1:
            self.committed = SharedCommitted(own_client(self.run_store),
                                             lambda: restarts.reported(self._progress_dir)[0]).start()
        self.copies = self._copy_server(spec.rdzv_handler) if run.peer_copies else None  # --peer-copies

    def _job_address(self) -> str | None:
        """This node's address on the job's interface (--interface, or the one trainpod chose); None without one."""
        interface = self.run_spec.topology.interface or ""
        return netcheck.address_of(interface) if interface else None

    def _presence(self, handler) -> None:
        """The listener whose end tells the other nodes this agent is gone, and this agent's watch on theirs
        (trainpod.rendezvous.presence). Without an address on the job's interface a lost node leaves the rendezvous
        once its heartbeat lapses, as in torch."""
        address = self._job_address()
        if address is not None:
            presence.start(handler, address, self._say)

    def _copy_server(self, handler) -> peercopy.CopyServer | None:
        """--peer-copies: the server that keeps another node's newest checkpoint in this agent's memory, on the job's
        interface (trainpod.agent.peercopy). A node with no address there keeps none, and says so."""
        interface = self.run_spec.topology.interface or ""
        address = self._job_address()
        if address is None:
            self._say(f"warning: --peer-copies: this node has no address on the interface {interface or '(none chosen)'}: "
                      "it keeps no copy, and its ranks restore from their checkpoint directory only")
            return None
        return peercopy.CopyServer(address, handler.get_run_id())

    def _share_copies(self, worker_group, first: bool) -> None:
        """Every node's copy server, by group rank, for this round's ranks (peercopy.share: a file they read), and
        whether this node is new to the job (`first`: this agent's first round, and not the job's first: a joiner, a
        spare, a node started again), whose ranks then take a copy from memory even where their directory has the
        same step."""
        if self.copies is None:
            return
        world, addresses = worker_group.group_world_size or 1, [self.copies.address]
        if world > 1:
            try:
                addresses = peercopy.exchange(worker_group.store, worker_group.group_rank, world, self.copies.address)
            except Exception as error:  # noqa: BLE001 - a node without --peer-copies never publishes (--consistency off)
                self._say(f"warning: --peer-copies: the other nodes' copy servers were not found ({type(error).__name__}: "
                          f"{str(error)[:200]}): this round's ranks restore from their checkpoint directory only")
                addresses = []
        new = first and (node_order.round_of(worker_group.spec.rdzv_handler) or 0) > 0
        peercopy.share(self._progress_dir, addresses, new)

    def _close_only_at_the_end(self, handler) -> None:
        """torch's launcher closes the rendezvous whenever its agent ends but by a signal: also when this node's
        agent fails and is about to be retried (its own rendezvous timed out, it crashed, a master that may come
        back). In an elastic job the other nodes still train in that rendezvous: closed, the retried agent then
        met in the job's next generation alone and trained a second copy of the job beside them (both at world
        1, one checkpoint directory). Here the agent closes it only when the job is over: it ended without an
        error, the policy decided its end, or the rendezvous is closed already."""
        from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousGracefulExitError

        torch_shutdown = handler.shutdown

        def shutdown() -> bool:
            error = sys.exc_info()[1]  # called from the launcher's `finally`, with its exception in flight
            if self.left_job:
                return False  # this node left the others' job (_leave_round): closing it would end theirs
            over = (error is None or self.final is not None
                    or isinstance(error, (RendezvousClosedError, RendezvousGracefulExitError, JobEnded))
                    or (isinstance(error, MasterLost) and error.final))
            if over:
                return torch_shutdown()
            self.left_open = True
            self._say(f"leaving the rendezvous open for the other nodes ({type(error).__name__}): this node's agent "
                      "may be started again and join them")
            return False

        handler.shutdown = shutdown

    def _waits_as_spare(self, max_nodes: int) -> None:
        """torch put this node on the rendezvous' redundancy list (trainpod.rendezvous.node_order.when_spare): said once
        per wait, shown by the metrics until it joins a round."""
        if self._spare:
            return  # said already for this wait
        self._spare = True
        spares = self.run_spec.topology.rdzv.spares
        declared = f" and --spares {spares}" if spares else " (--spares 0: the job declares none)"
        self._say(f"this node waits as a spare: the job has --nnodes' maximum of {max_nodes} node(s){declared}; it trains "
                  "nothing and takes the place of the first node that leaves")
        if (figures := metrics.recorder()) is not None:
            figures.set("trainpod_spare", 1)

    def _no_restart_once_finishing(self, handler) -> None:
        """torch restarts a healthy worker group whenever a node waits to join it (its agent's num_nodes_waiting()),
        even one whose training is over and that only tears down: a node that arrived then made the whole job
        train again (CI: a node that came late to the first round, as the other finished the job alone). Once a
        local rank ended with 0 or reported the end of training (trainpod.train.progress.finished), the group
        is finishing: the waiting node is not let in. If the group ends with 0, the run is over and the node ends
        when it closes (trainpod.agent.agent's _ended_while_waiting); else (a stop vote's 143, a failure) the agent
        meets again, and the node joins then."""
        torch_waiting = handler.num_nodes_waiting

        def num_nodes_waiting() -> int:
            waiting = torch_waiting()
            if not waiting:
                return 0
            finishing = self._finishing()
            if finishing is None:
                return waiting
            if not self._said_finishing:
                self._said_finishing = True
                self._say(f"{waiting} node(s) waiting to join, but this worker group is finishing ({finishing}): "
                          "it is not restarted for them")
            return 0

        handler.num_nodes_waiting = num_nodes_waiting

    def _finishing(self) -> str | None:
        """Why this worker group's training is over (None: it is not): a local rank ended with 0 while the others
        run, or a rank reported the end of training since the group started."""
        left = self._left | _exited_zero(self._pcontext)
        if left:
            return f"local rank {min(left)} ended with 0"
        records = progress.read(self._progress_dir)
        done = sorted(rank for rank, record in records.items() if record.finished and record.time >= self._group_started_at)
        return f"local rank {done[0]} reported the end of training" if done else None

    # --- torch's hooks ---

    def _start_workers(self, worker_group):
        self._left, self._server_lost = set(), None
        self._group_started_at, self._said_finishing = time.time(), False
        try:
            pids = super()._start_workers(worker_group)
        except (EOFError, OSError):
            death = warm.server_death(SERVER_DEATH_WAIT_S) if self._start_method == warm.START_METHOD else None
            if death is None:
                raise
            # The fork server died while it forked the ranks (the OOM killer's choice in a small container: it holds
            # torch): multiprocessing found its pipe closed (EOFError) or its socket gone. The ranks it forked died
            # with it. A failed worker group, which the policy decides on, not an agent's crash with a traceback.
            self._server_lost = death
            return {worker.local_rank: 0 for worker in worker_group.workers}
        survivors.bound(self._pcontext)  # a crashed rank's peers stopped in seconds, not torch's 30
        figures = metrics.recorder()
        if figures is not None and worker_group.workers:
            figures.group_started({w.local_rank: w.global_rank for w in worker_group.workers},
                                  worker_group.workers[0].world_size, worker_group.group_world_size or 1)
        stderrs = getattr(self._pcontext, "stderrs", None) or {}
        if stderrs:  # <run log dir>/attempt_<N>/<local rank>/stderr.log: torch's lines that repeat trainpod's go beside
            log.ASIDE.path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(next(iter(stderrs.values()))))),
                                          log.ASIDE_FILE)
        return pids

    def _monitor_workers(self, worker_group):
        if self._server_lost is not None:
            result = self._server_lost_result(worker_group)
        else:
            # Before torch looks: which ranks have exited 0 while the others run. After a failure torch stops the
            # others, and a rank that ends with 0 on that SIGTERM left nothing early.
            self._left |= _exited_zero(self._pcontext)
            result = super()._monitor_workers(worker_group)
        self.started = True
        control = self.control
        if control is not None:
            if control.stop is not None and not control.announced:
                raise self._stopped_by(control.stop)
            if self.started and control.unreachable_s() >= self.rejoin_timeout:
                self._master_lost(already_s=control.unreachable_s())
        if result.is_failed():
            self._on_failure(result)
        elif self.run_spec.replace_stragglers and self.elastic:
            self._replace_a_straggler()
        return result

    def _replace_a_straggler(self) -> None:
        """--replace-stragglers: while the straggler watch names a rank of this node and a spare waits (torch's redundancy
        list), this node leaves the job for the spare: its ranks stop as on SIGTERM (the stop vote: every rank of the job
        at one checkpoint), it is excluded from the next rounds, and the others meet again with the spare at the same
        world size. The rendezvous is read at most every REPLACE_LOOK_S, and only while a rank here is named."""
        watch = getattr(self, "straggler_watch", None)
        named = watch.named_here() if watch is not None else []
        if not named or time.monotonic() < self._replace_look_at:
            return
        self._replace_look_at = time.monotonic() + REPLACE_LOOK_S
        try:
            waiting = node_order.spares_waiting(self._worker_group.spec.rdzv_handler)
        except Exception:  # noqa: BLE001 - the rendezvous unreachable now: the next look asks again
            return
        if not waiting:
            return
        slow = min(named, key=lambda straggler: straggler.rank)
        line = (f"rank {slow.rank} of this node paces the job (its own work {slow.busy_s:.3g} s per step, the others' "
                f"{slow.others_s:.3g} s) and {waiting} spare(s) wait: this node leaves the elastic job "
                "(--replace-stragglers); a spare takes its place")
        self._say(f"error: {line}")
        self._leave_job(EXIT_UNAVAILABLE, line)
        self.final = self.budget.end(EXIT_UNAVAILABLE, line)
        raise JobEnded(EXIT_UNAVAILABLE, line)  # torch's run() stops this node's ranks on its way out (SIGTERM)

    def _invoke_run(self, *args, **kwargs):
        from torch.distributed.elastic.multiprocessing.api import SignalException

        try:
            return super()._invoke_run(*args, **kwargs)
        except SignalException as error:
            if getattr(error, "code", None) is None:  # this node's own SIGTERM: stop the others first
                code = 128 + int(error.sigval)
                why = f"node {self.node_label} received {supervise.stop_signal() or signal.Signals(error.sigval).name}"
                self.budget.end(code, why)
                if self.control is not None:
                    self.control.announce(code, why)
            raise

    def _rendezvous(self, worker_group):
        """torch's rendezvous, then: every node the same software? did the membership change since the last
        round (elastic jobs)?"""
        before, members = self._nodes, self._members
        if before is None and self.elastic:
            self._stay_out_if_excluded()
        super()._rendezvous(worker_group)
        self._check_consistency(worker_group)
        while not (self._check_network(worker_group) and self._check_devices(worker_group)):  # a node left: meet again
            super()._rendezvous(worker_group)
            self._check_consistency(worker_group)
        self._share_copies(worker_group, first=before is None)
        self._members = node_order.members(worker_group.spec.rdzv_handler)
        self._spare = False  # in a round: a spare no more
        if (figures := metrics.recorder()) is not None:
            figures.set("trainpod_spare", 0)
        known = self._members is not None and members is not None
        new = len(self._members - members) if known else 0
        self._met(before, worker_group.group_world_size, new, members - self._members if known else frozenset())

    def _met(self, before: int | None, after: int, new: int = 0, left: frozenset = frozenset()) -> None:
        """The round has `after` nodes, `before` the last, `new` of them not in the last one (where both are known), and
        not the nodes `left`: a failure since then is decided (the module docstring). As many nodes, some of them new,
        is a membership change too: a spare (a node beyond --nnodes' maximum) took a lost node's place."""
        self._nodes = after
        counted, provisional = self._counted, self._provisional
        self._counted, self._provisional = False, None
        if before is None or (after == before and not new):
            if provisional is not None and not self._reprieved:
                self._reprieved = True
                self.budget.reprieve()
                self._say(f"the same {after} node(s) met again: one more attempt before the job ends ({provisional.line}): "
                          "a node whose own ranks fail may leave after its next failure")
                return
            if provisional is not None:
                line = f"the same {after} node(s) met again, so no node left: {provisional.line}"
                self._say(line)
                self.final = self.budget.end(provisional.code, line)
                raise JobEnded(provisional.code, line)
            return
        forgiven = provisional is not None or (counted and not self._own)
        if (figures := metrics.recorder()) is not None:
            figures.count("trainpod_membership_changes_total")
            figures.event("membership", nodes=after, before=before, **({"new": new} if new else {}))
        change = (f"the job now has {after} node(s), {before} before" if after != before else
                  f"{new} node(s) took the place of {'one' if new == 1 else 'nodes'} that left: the job has {after} "
                  "node(s), as before")
        seen = sorted(map(repr, presence.seen_gone(left)))  # dropped at once, not after their heartbeats lapsed
        self._say(f"{change}: a membership change"
                  + (", not counted against --max-restarts" if forgiven else "")
                  + (" (this node's ranks failed on their own: that restart stays counted)" if counted and self._own else "")
                  + (f"; {', '.join(seen)} left as {'its agent' if len(seen) == 1 else 'their agents'} ended, seen at once"
                     if seen else ""))
        if forgiven:
            self.budget.membership_changed()
            self._reprieved = False

    def _check_consistency(self, worker_group) -> None:
        """Every node publishes its fingerprint in the round's store and compares everyone's (trainpod.agent.consistency):
        each node reaches the same verdict, so under --consistency refuse each ends the job with 78 and the same line,
        before any rank of the round starts. --consistency off still publishes (nodes set to compare wait for it)."""
        run = self.run_spec
        if worker_group.group_world_size < 2:
            return
        mine = self._fingerprint.result()  # once per agent: its software does not change between rounds
        if run.consistency == "off":
            with contextlib.suppress(Exception):  # for nodes that compare; a store gone fails the round its own way
                round_gather.publish(worker_group.store, consistency.KEY_PREFIX, worker_group.group_rank, mine.to_json())
            return
        try:
            prints = consistency.exchange(worker_group.store, worker_group.group_rank, worker_group.group_world_size, mine)
        except Exception as error:  # a node that never published (an older trainpod): its round fails or trains alone
            self._say(f"warning: the nodes' software was not compared: {type(error).__name__}: {str(error)[:200]}")
            return
        line = consistency.verdict(prints)
        if line is None:
            return
        if run.consistency == "warn":
            self._say(f"warning: {line} (--consistency warn: training anyway)")
            return
        line = f"{line}: {consistency.remedy(line)}, or pass --consistency warn to train anyway"
        self._say(f"error: {line}")
        self.final = self.budget.end(EXIT_CONFIG, line)
        raise JobEnded(EXIT_CONFIG, line)

    def _check_network(self, worker_group) -> bool:
        """--netcheck (trainpod.agent.netcheck), or a --min-bandwidth, which asks for it: measure the links of this
        round. True: go on (node 0 says the job's line). A named node: a fixed-size job ends on every node (69); in an
        elastic job the named node leaves (69) and the others return False, to meet again without it."""
        run = self.run_spec
        if worker_group.group_world_size < 2 or (run.netcheck == "off" and not run.min_bandwidth):
            return True
        found = netcheck.check(worker_group.store, worker_group.group_rank, worker_group.group_world_size,
                               run.topology.interface or "", run.min_bandwidth)
        return self._judged(found.line, found.named, worker_group, "--netcheck")

    def _check_devices(self, worker_group) -> bool:
        """--devcheck (trainpod.agent.devcheck): this node's GPUs, measured in a child process, against the job's; the
        same rules as _check_network(). A node that never publishes (another trainpod) leaves the devices unjudged."""
        if self.run_spec.devcheck == "off":
            return True
        mine = devcheck.run()
        try:
            found = devcheck.exchange(worker_group.store, worker_group.group_rank, worker_group.group_world_size, mine)
        except Exception as error:  # noqa: BLE001 - torch's store errors have no common type across backends
            self._say(f"warning: the nodes' devices were not compared: {type(error).__name__}: {str(error)[:200]}")
            return True
        bad = devcheck.verdict(found)
        if bad is None:
            return self._judged(f"devices: {devcheck.summary(found)}", {}, worker_group, "--devcheck")
        return self._judged(f"devices: {bad.line}", dict.fromkeys(bad.ranks, ""), worker_group, "--devcheck")

    def _judged(self, line: str, named: dict[int, str], worker_group, flag: str) -> bool:
        """What a check's verdict costs (the network and the devices alike): the rules in _check_network()."""
        if not named:
            if worker_group.group_rank == 0:
                self._say(line)
            return True
        if not self.elastic:
            line = f"{line}: a fixed-size job cannot go on without it ({flag}; fix the node, or run without it)"
            self._say(f"error: {line}")
            self.final = self.budget.end(EXIT_UNAVAILABLE, line)
            raise JobEnded(EXIT_UNAVAILABLE, line)
        if worker_group.group_rank in named:
            line = f"{line}: this node leaves the elastic job ({flag}); the others go on if --nnodes' minimum remains"
            self._say(f"error: {line}")
            self._leave_job(EXIT_UNAVAILABLE, line)
            self.final = self.budget.end(EXIT_UNAVAILABLE, line)
            raise JobEnded(EXIT_UNAVAILABLE, line)
        others = ", ".join(f"node {rank}" for rank in sorted(named))
        self._say(f"{line}: {others} left the job ({flag}); meeting again without {'it' if len(named) == 1 else 'them'}")
        return False

    def run(self, *args, **kwargs):
        """torch's run(); then, and only then, JobControl ends. Not in _shutdown(): torch calls that also to
        stop the ranks before each worker-group restart (_restart_workers -> _stop_workers, and a membership
        change), and a control closed there froze the master's last answer, so exactly --rejoin-timeout after
        a restart the other nodes declared a master lost that was still training (issue 29)."""
        try:
            result = super().run(*args, **kwargs)
            if result is None:
                return self._spare_not_needed()
            return result
        finally:
            if self.control is not None:
                self.control.wait_seen()  # node 0: the store goes away with this process
                self.control.close()  # no request to the store in flight when the interpreter exits
            if self.committed is not None:
                self.committed.close()

    def _spare_not_needed(self):
        """torch's run() returns nothing when the rendezvous closes on a node of its redundancy list (it swallows the
        RendezvousGracefulExitError), and its launcher then fails on `None.is_failed()`: a spare that the job never
        needed ended in an AttributeError's traceback. Here it ends with 0 and one line."""
        from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

        self._say("the job ended while this node waited as a spare: it trained nothing, and ends with 0")
        return RunResult(state=WorkerState.SUCCEEDED)

    # --- the policy ---

    def _on_failure(self, result) -> None:
        control = self.control
        if control is not None:
            # A fresh look at the store: a node that stopped set the key before its ranks went away,
            # so the peers' failure that follows finds it (node 0 too, whose thread may not have polled yet).
            if not control.reachable_now() and control.stop is None:
                self._master_lost()
            if control.stop is not None and not control.announced:
                raise self._stopped_by(control.stop)
        elif self._store_gone():  # an elastic job, or one whose nodes the rendezvous numbers: no stop key
            self._master_lost()
        rank, first = _first_failure(result.failures)
        code = exit_code(first.exitcode)
        if self.elastic and code == restarts.EXIT_STOPPED:
            # Not this node's SIGTERM (that ends _invoke_run first): another node was stopped and every rank
            # voted to stop with it (trainpod.train.preemption) after a checkpoint. The job goes on without it.
            self._say(f"rank {rank} {describe_failure(first)}: another node of this elastic job was stopped and every rank "
                      "checkpointed; re-rendezvous without it (not counted against --max-restarts)")
            self._remaining_restarts = max(1, self._remaining_restarts)
            self._attempt_started = time.monotonic()
            return
        committed, step = restarts.reported(self._progress_dir)
        if control is not None:
            committed = max(committed, control.job_committed)
        elif self.committed is not None:  # the job's, as every node sees it (trainpod.agent.committed)
            committed = max(committed, self.committed.fresh())
        stderr = getattr(self._pcontext, "stderrs", {}).get(first.local_rank) if self._pcontext else None
        # a hang's code (124) already says what happened; the stopped rank's stderr ends in no traceback of its own
        where = "" if hangwatch.is_hang(first) else restarts.read_where(stderr) if first.exitcode > 0 else ""
        code, cause, where = self._cause(rank, first, code, where, stderr)
        failure = restarts.Failure(code=code, committed=committed, step=step, where=where,
                                   ran_s=time.monotonic() - self._attempt_started, who=f"rank {rank}", cause=cause)
        decision = self.budget.decide(failure)
        if (figures := metrics.recorder()) is not None:
            figures.group_failed("hang" if hangwatch.is_hang(first) else "failure", restarting=decision.restart)
        # A final line or a cause names the first failure (a restart's line always did, beside the ranks' lines)
        named = (cause or not decision.restart) and failure.what() in decision.line
        for global_rank, each in sorted(result.failures.items()):
            if global_rank == rank and named:
                continue  # said once
            self._say(f"rank {global_rank} (local rank {each.local_rank}) {describe_failure(each)}")
        max_restarts = self._worker_group.spec.max_restarts
        own = not hangwatch.is_hang(first) and not _lost_a_peer(stderr, where)
        if self.elastic and own and not decision.restart and decision.code not in restarts.NEVER_RESTARTED:
            self._leave_failing(decision)
        if self.elastic and not decision.restart and decision.code not in restarts.NEVER_RESTARTED:
            # A node that left makes the others fail too: the next rendezvous tells (_rendezvous).
            self._say(f"{decision.line}, unless a node left the job: one more rendezvous tells (an elastic job)")
            self._provisional = decision
            self._remaining_restarts = max(1, self._remaining_restarts)
            self._attempt_started = time.monotonic()
            return
        self._say(("restarting the worker group: " if decision.restart else "") + decision.line)
        if decision.restart:
            self._counted, self._own = True, own
            self._reprieved = self._reprieved and decision.used > 1  # progress (a full budget again) ends a reprieve
            # torch takes one off, then tells the ranks TORCHELASTIC_RESTART_COUNT = max - remaining:
            # the restarts without progress so far.
            self._remaining_restarts = max(1, max_restarts - decision.used + 1)
            self._attempt_started = time.monotonic()
            return
        self._remaining_restarts = 0
        self.final = decision
        if control is not None:
            control.announce(decision.code, decision.line)

    def _leave_job(self, code: int, line: str) -> None:
        """Leave the elastic job's rendezvous round, and keep it open for the others when this agent ends; the run's
        store keeps the node out (trainpod.rendezvous.exclusions), should an orchestrator start it again."""
        self.left_job = True
        handler = self._worker_group.spec.rdzv_handler
        try:
            if self.run_store is None:
                raise LookupError(f"{type(handler).__name__} has no store of the run's")
            exclusions.record(self.run_store, exclusions.Exclusion.of(exclusions.Node.this(), code, line))
        except Exception as error:  # noqa: BLE001 - torch's store errors have no common type across backends
            self._say(f"warning: this node's exclusion was not kept in the run's store ({type(error).__name__}: "
                      f"{str(error)[:200]}): started again, it would join again")
        _leave_round(handler)

    def _stay_out_if_excluded(self) -> None:
        """Before this agent's first rendezvous: a node that left this run (_leave_job) does not join it again
        (trainpod.rendezvous.exclusions); it ends with the code it left with, and the others never see it."""
        handler = self._worker_group.spec.rdzv_handler
        store = self.run_store
        try:
            found = exclusions.of(exclusions.Node.this(), exclusions.read(store, self._say)) if store is not None else None
            live = found is not None and exclusions.run_is_live(handler)
        except Exception as error:  # noqa: BLE001 - the run's store down: the rendezvous says so its own way
            self._say(f"warning: the run's exclusions were not read ({type(error).__name__}: {str(error)[:200]})")
            return
        if found is None:
            return
        if not live:
            self._say(f"this node left rendezvous {handler.get_run_id()} before ({found.describe()}), but no node is in it "
                      "now: the job starts afresh there, this node with it")
            return
        line = (f"this node left this elastic job (rendezvous {handler.get_run_id()}) and stays out of it: "
                f"{found.describe()}; started on another host, after a reboot of this one, or under a new --rdzv-id, "
                "it joins")
        self._say(f"error: {line}")
        self.left_job = True  # never joined: nothing of the others' to close
        self.final = self.budget.end(found.code, line)
        raise JobEnded(found.code, line)

    def _leave_failing(self, decision: restarts.Decision) -> None:
        """The budget ended this node's part (the same failure twice, or spent) for failures of its own ranks (not for
        a peer that went away: that is the other nodes' view of it), in an elastic job: the node leaves it, and the
        others, whose ranks only lost a peer, meet again without it (their own end is provisional until that
        rendezvous: _on_failure). Where every node's ranks fail alike, every node leaves: the job ends, with the
        failure's code on each."""
        how = "the same way twice" if decision.repeated else "on their own until --max-restarts was spent"
        line = (f"{decision.line}: this node's ranks failed {how}, the other nodes' only for want of them: "
                "it leaves the elastic job, excluded from its next rounds; the others go on if --nnodes' minimum remains")
        self._say(f"error: {line}")
        self._leave_job(decision.code, line)
        self.final = restarts.Decision(restart=False, code=decision.code, line=line, used=decision.used,
                                       attempt=decision.attempt, repeated=decision.repeated)
        raise JobEnded(decision.code, line)

    def _cause(self, rank: int, first, code: int, where: str, stderr: str | None) -> tuple[int, str, str]:
        """(code, cause, where) of a failed worker group where its first failure's code alone would mislead
        (restarts.Failure): the fork server died (and took the ranks), the kernel's OOM killer killed, or a rank
        exited 0 while the others still trained and they failed in a collective without it. Else (code, '', where)."""
        memory = self.oom.killed()  # at every failure: a kill the policy did not see (a loader worker's) is no later SIGKILL's
        death = getattr(first, SERVER_MARK, None)
        if death is None and self._start_method == warm.START_METHOD:
            # multiprocessing reports the ranks of a dead server as 255, which may come before the death is seen
            death = warm.server_death(SERVER_DEATH_WAIT_S if first.exitcode == LOST_STATUS else 0.0)
        subject, also = f"rank {rank}", ""
        if death is not None:
            pid, code = death
            subject, also = f"the fork server of --warm-start (pid {pid})", ", and every rank of this node with it"
        killed = code == 128 + signal.SIGKILL and memory is not None
        if killed:
            return code, (f"{subject} was killed by the kernel's OOM killer{also} ({oom.describe(memory)}: give the job "
                          "more memory or make it use less)"), oom.WHERE
        if death is not None:
            return code, f"{subject} {describe_exit(128 - code if code > 128 else code)}{also}", "the fork server died"
        if self._left and first.exitcode > 0 and code not in restarts.NEVER_RESTARTED and _lost_a_peer(stderr, where):
            records = progress.read(self._progress_dir)
            workers = {worker.local_rank: worker.global_rank for worker in self._worker_group.workers}
            left = sorted(workers.get(local, local) for local in self._left)
            steps = sorted({records[local].step for local in self._left if local in records and records[local].step >= 0})
            at = f" at step {steps[0]}" if len(steps) == 1 else ""
            return code, (f"{_ranks(left)} exited 0{at} while the other ranks were still training (every rank must run "
                          f"every collective: the others wait for it, then fail); rank {rank} then {describe_failure(first)}"), LEFT_WHERE
        return code, "", where

    def _server_lost_result(self, worker_group):
        """torchrun's RunResult for a worker group whose fork server died while it started them: FAILED, the
        server's status for the first rank (as a rank's: -9 after SIGKILL)."""
        from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        pid, code = self._server_lost
        first = min(worker_group.workers, key=lambda worker: worker.global_rank)
        failure = ProcessFailure(local_rank=first.local_rank, pid=pid, exitcode=128 - code if code > 128 else code, error_file="")
        setattr(failure, SERVER_MARK, (pid, code))
        return RunResult(state=WorkerState.FAILED, failures={first.global_rank: failure})

    def _stopped_by(self, stop: Stop):
        line = f"node {stop.node} ended the job ({stop.why}): stopping this node's ranks, exit {stop.code}"
        self._say(line)
        self.final = self.budget.end(stop.code, line)
        return _stopped_exception(stop.code, line)

    def _store_gone(self) -> bool:
        """After the job started: the c10d store's port does not answer (its host node's agent is gone),
        and no agent on this node could host it again (else the supervisor's restart does). Asked only
        without JobControl, whose thread watches the store all along."""
        return (self.control is None and self.store is not None and self.started and not self.would_host_store
                and not wait_for_port(self.store, PROBE_WAIT_S))

    def _master_lost(self, already_s: float = 0.0) -> None:
        """The store (node 0's agent, or the endpoint's) stopped answering: wait for it, bounded; raises MasterLost."""
        host, port = self.store or ("?", 0)
        wait = max(0.0, self.rejoin_timeout - already_s)
        self._say(f"the master {host}:{port} stopped answering: waiting up to {wait:g}s for it to come back (--rejoin-timeout)")
        if self.store is not None and wait > 0 and wait_for_port(self.store, wait):
            line = f"the master {host}:{port} answers again: this node's agent exits {EXIT_UNAVAILABLE} to join it anew"
            self._say(line)
            raise MasterLost(line, final=False)
        line = (f"error: the master {host}:{port} went away after the job started and did not come back within "
                f"{self.rejoin_timeout:g}s (--rejoin-timeout): not restarting")
        self.final = self.budget.end(EXIT_UNAVAILABLE, line)
        self._say(line)
        raise MasterLost(line, final=True)

    def rendezvous_failed(self) -> bool:
        """After torch's RendezvousError: if the job had started and the master is gone, the bounded
        wait for it (MasterLost) instead of a retry with the full --connect-timeout. False: not that case."""
        if not self.started or self.final is not None:
            return False
        if self.control is not None:
            if self.control.is_host:
                return False
            already = self.control.unreachable_s()
        elif self._store_gone():
            already = 0.0
        else:
            return False
        try:
            self._master_lost(already_s=already)
        except MasterLost:
            return True
        return True


def rendezvous_poll_s(max_nodes: int) -> float:
    """How often a node reads a c10d or etcd-v3 rendezvous's state while it waits for the others: 0.01 s
    per node, from 0.02 s to torch's 1 s, so a job's nodes read the store about 100 times a second at
    most, whatever their number. (While the ranks train, the agent asks every WAITING_LOOK_S whether a
    node waits to join: _look_for_joining_nodes_less_often.)"""
    return min(1.0, max(0.02, 0.01 * max_nodes))


def _look_for_joining_nodes_less_often(handler) -> None:
    """torch's agent asks the rendezvous whether a node waits to join (num_nodes_waiting()) at every turn of its
    monitor loop while the ranks train, every 0.1 s, and with the state's cache at rendezvous_poll_s
    (_poll_rendezvous_faster) each ask is a read of the store: every node of every job ten times a second, on
    an etcd that several jobs share (an HTTP request, a linearizable read) or on the TCPStore one node's agent
    hosts. Here it asks every WAITING_LOOK_S: a joining node is seen up to that much later (torch's own cache
    made it a second), and its restart takes seconds anyway. An answer of 0 is what it repeats between two
    looks: a node seen waiting restarts the group at once, as in torch."""
    torch_waiting = handler.num_nodes_waiting
    next_look = [0.0]

    def num_nodes_waiting() -> int:
        now = time.monotonic()
        if now < next_look[0]:
            return 0
        next_look[0] = now + WAITING_LOOK_S
        return torch_waiting()

    handler.num_nodes_waiting = num_nodes_waiting


def rendezvous_skew_s(max_nodes: int) -> float:
    """The most a node delays its first join by chance, so that many nodes do not write the rendezvous's
    state at once: 0.01 s per node (the rate above), at most torch's 0.3 s. A 2-node job waited up to
    0.3 s (0.15 on average) for nothing at every launch."""
    return min(0.3, 0.01 * max_nodes)


def _leave_round(handler) -> None:
    """Leave the rendezvous round as next_rendezvous() begins (torch's exit op on DynamicRendezvousHandler: c10d,
    etcd-v3), without closing it: the others' next round need not wait for this node's keep-alive to lapse. Best
    effort: where it cannot, the keep-alive lapses (a few heartbeats), and the backend drops the node then."""
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        node_order.leave(handler)  # for good: the others' next round does not wait for it
        handler._stop_heartbeats()
        handler._op_executor.run(_RendezvousExitOp(), handler._get_deadline(handler._settings.timeout.close))
    except Exception:  # noqa: BLE001, S110 - another backend (etcd's v2), or torch moved it: the keep-alive lapses
        pass


def _poll_rendezvous_faster(handler, max_nodes: int) -> None:
    """torch's DynamicRendezvousHandler (c10d, trainpod's etcd-v3) reads the state at most once a second
    while a node waits for the others: it sleeps a second between two reads (_DistributedRendezvousOpExecutor:
    _Action.SYNC -> _delay(seconds=1)) and reuses a read state for a second (_BackendRendezvousStateHolder's
    _cache_duration). Every restart of a multi-node job is such a round (each node leaves the last round,
    then waits for the others to), so it took a second more than needed, and a node waiting to join
    was seen up to a second late: here both become rendezvous_poll_s(). torch's other delay, the
    first round's random skew of up to 0.3 s, becomes up to rendezvous_skew_s()."""
    holder = getattr(handler, "_state_holder", None)
    if not hasattr(holder, "_cache_duration"):
        return  # torch's etcd backend (v2 API) has a rendezvous of its own
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    poll = rendezvous_poll_s(max_nodes)
    holder._cache_duration = poll
    torch_delay = getattr(dynamic_rendezvous._delay, "torch_delay", dynamic_rendezvous._delay)

    skew = rendezvous_skew_s(max_nodes)

    def delay(seconds: float | tuple[float, float]) -> None:
        if isinstance(seconds, tuple):  # the first round's skew, a range
            seconds = (min(seconds[0], skew), min(seconds[1], skew))
        torch_delay(poll if seconds == 1 else seconds)

    delay.torch_delay = torch_delay  # type: ignore[attr-defined]
    dynamic_rendezvous._delay = delay


def _fresh_workers_store(handler) -> None:
    """The workers' store (where env:// ranks meet: MASTER_ADDR:MASTER_PORT) is a new one in every
    rendezvous round, hosted by the agent of the round's rank 0 on a new port.

    torch's dynamic rendezvous (c10d, trainpod's etcd-v3) shares one store, made in the agent's first
    round, with the workers of every round: restarted ranks then read the dead ones' keys
    (pytorch/pytorch#135712), and in a round that a node joins, rank 0 publishes no address and the
    new node waits for it until the store's timeout. Its opt-out (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
    makes rank 0's process host the store once it has imported torch, and every other rank's client
    backs off exponentially while it is not there yet: seen 1 to 2 s late at a 2-node launch. Here the
    agent forgets the last round's store before each round, so torch makes a new one (the old one
    closes with its last reference) and publishes its address in the new round."""
    if os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1" or not hasattr(handler, "_shared_tcp_store_server"):
        return  # the user's opt-out (rank 0 hosts a new store each time), or a rendezvous with a store of its own
    torch_next = getattr(handler.next_rendezvous, "torch_next", handler.next_rendezvous)

    def next_rendezvous():
        handler._bootstrap_store_info = None
        handler._shared_tcp_store_server = None
        return torch_next()

    next_rendezvous.torch_next = torch_next  # type: ignore[attr-defined]
    handler.next_rendezvous = next_rendezvous


def _heartbeats_of_their_own(handler) -> None:
    """The c10d rendezvous' state (each node's heartbeat among it) read and written through a client of the store of its
    own, not the one that the round's checks and torch's agent wait on.

    A TCPStore client serves one call at a time, and a wait is one call: torch's c10d backend shares one client between
    the rendezvous' state and the store each round hands out (RendezvousInfo.store), so while the agent waited there
    (the nodes' fingerprints, --netcheck's and --devcheck's exchanges: up to the slowest node's time to publish, and
    more where one never does) its heartbeat thread queued behind the wait. A wait longer than the keep-alive lapse (3 s
    by an elastic trainpod job's default) made the node dead to the others, who dropped it from the state; torch then
    never sends its heartbeat again (a node that is no longer in last_heartbeats is not kept alive), so the next
    restart's round did not wait for it, and the job restarted once more to let it back in. trainpod's etcd-v3 store
    waits by polling (trainpod.rendezvous.etcd_v3) and holds nothing meanwhile."""
    holder = getattr(handler, "_state_holder", None)
    backend = getattr(holder, "_backend", None)
    store = getattr(backend, "_store", None)
    if _backend(handler) != "c10d" or store is None or store is not getattr(handler, "_store", None):
        return  # another backend, or the state has a client of its own already
    # Where the store went away a moment after the first client met it, torch's one client stays (own_client), and the
    # rendezvous fails or goes on as it would have.
    backend._store = own_client(store)


def _backend(handler) -> str:
    try:
        return handler.get_backend()
    except Exception:  # a handler without one (a test's): the launcher's default
        return "c10d"


def _first_failure(failures):
    """(global rank, failure) that the job's code comes from. Not a rank killed by SIGTERM if another
    failed otherwise: torch stops the others with SIGTERM as soon as one fails, and lists them too. Then
    one that exited with a code that is never restarted (a usage or configuration error says more than
    the peers' lost-connection errors), then one killed by another signal (SIGKILL, the OOM killer,
    SIGSEGV: its peers then exit with 1 on a lost connection, and a peer's error file carries the time of
    its exception, which may be earlier than the moment torch saw the killed rank gone), else the earliest."""
    def key(item):
        rank, failure = item
        collateral = failure.exitcode == -signal.SIGTERM
        final = failure.exitcode > 0 and exit_code(failure.exitcode) in restarts.NEVER_RESTARTED
        signalled = failure.exitcode < 0 and not collateral
        return (collateral, not final, not signalled, failure.timestamp, rank)

    return min(failures.items(), key=key)

