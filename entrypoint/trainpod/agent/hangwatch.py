"""The agent's hang watch: a thread that samples the local ranks and acts on trainpod.agent.hang's verdict.

Every `interval` seconds (a tenth of --hang-timeout, between 0.5 and 1 s) it reads each local
rank's process state and the CPU time of its process tree (psutil), its last step
(trainpod.train.progress) and, for a rank that used no CPU since the previous look, its main thread's
Python stack (trainpod.agent.stacks: py-spy, else the rank's own faulthandler), at most every
`refresh` seconds per rank. trainpod.agent.hang.Tracker turns that into a RankView per rank.

Several nodes: each agent publishes its ranks' views in the rendezvous store that the agents share
(the c10d store on node 0's agent; a key per node, under this rendezvous round's prefix) whenever
one of its ranks is not busy, and reads the other nodes' keys while one of its own is: that is how
a node whose ranks only wait learns that a rank on another node is the one behind. The first agent
to find the job stalled stores its verdict; every agent that has a rank involved acts on it.

Acting: every local rank's stack (all threads) goes to `<output>/hangs/<time>-node<N>/rank<R>.txt`
(<output> is TRAINPOD_OUTPUT_DIR, else a bundled example's --output-dir, else ./output: where it writes its metrics), torch's flight
recorder of ranks that serve dump requests to `<output>/hangs/flight-recorder/rank<R>` (and NCCL's
own dump through its pipe), then one line names the ranks behind; the agents wait (a few seconds
at most) until each involved node has written its stacks, then SIGKILL their ranks' process groups.
The agent sees a failed worker group with code 124, and its restart policy (trainpod.agent.policy)
decides what comes next, as for any other failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil

from trainpod import log
from trainpod.agent import keeper, metrics, stacks
from trainpod.agent.hang import BUSY, FLIGHT_RECORDER, PIPE_STEM, RankView, Sample, Tracker, Verdict, decide, describe, output_dir
from trainpod.contract import EXIT_HANG, HANGS_DIR, PROGRESS_DIR_VAR
from trainpod.train import progress

KEY_PREFIX = "trainpod/hang/"
VERDICT_KEY = KEY_PREFIX + "verdict"
ACK_KEY = KEY_PREFIX + "ack"


def interval_for(timeout: float) -> float:
    return min(1.0, max(0.5, timeout / 10))


@dataclass(frozen=True)
class Worker:
    rank: int  # global
    local_rank: int
    pid: int


TICKS = os.sysconf("SC_CLK_TCK")


def _own(pid: int) -> tuple[str, float]:
    """(/proc state letter, CPU seconds of the process's threads); ("", 0) when it is gone. ~20 us."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return "", 0.0
    return fields[0].decode(), (int(fields[11]) + int(fields[12])) / TICKS


def _children_cpu(pid: int) -> float:
    """CPU seconds of the process's live descendants (DataLoader workers): a scan of /proc."""
    total = 0.0
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return 0.0
    for child in children:
        try:
            times = child.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


class Watch:
    """One per agent; start() per worker group, stop() when the group stops; outcome() for the agent."""

    def __init__(self, timeout: float, node: str, say: log.Log, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        self.timeout = timeout
        self.interval = interval_for(timeout)
        self.refresh = max(self.interval, timeout / 5)  # how old an idle rank's stack may get
        self.node = node
        self.say = say
        self.output = Path(output_dir(env))
        directory = env.get(PROGRESS_DIR_VAR, "").strip()
        if not directory:  # not started by `trainpod run`: a directory of our own
            directory = tempfile.mkdtemp(prefix="trainpod-progress-")
        self.progress_dir = Path(directory)
        self.pyspy = stacks.pyspy_path()
        if not self.pyspy:
            say("warning: py-spy is not installed: the hang watch reads the stacks only of ranks that use trainpod.train.progress "
                "(pip install py-spy)")
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._verdict: Verdict | None = None
        self._acted = threading.Event()
        self._workers: list[Worker] = []
        self._children: dict[int, float] = {}  # local rank -> its descendants' CPU seconds when last counted
        self._group_started = 0.0  # time.time() of the worker group's start: older reports are the last group's

    @staticmethod
    def wanted(timeout: float, node: str, say: log.Log, env: Mapping[str, str] | None = None) -> Watch | None:
        """The watch --hang-timeout asks for (RunSpec.hang_timeout), None when it is 0."""
        return Watch(timeout, node, say, env) if timeout > 0 else None

    # --- the agent's calls ----------------------------------------------------------------------

    def prepare(self) -> None:
        """Before a worker group starts: no FIFO or pipe of the previous group is left. Its ranks'
        reports stay (the restart budget reads their last committed step); _look() ignores them."""
        self.progress_dir.mkdir(parents=True, exist_ok=True)
        self._group_started = time.time()
        for entry in self.progress_dir.iterdir():
            if entry.name.endswith(".dump") or entry.name.startswith(PIPE_STEM):
                entry.unlink(missing_ok=True)

    def start(self, workers: list[Worker], world_size: int, store=None, group_rank: int = 0, group_world_size: int = 1,
              exitcode: Callable[[int], int | None] = lambda local: None) -> None:
        self.stop()
        self._workers = workers
        self._children = {}
        self._verdict = None
        self._acted.clear()
        self._stop = threading.Event()
        share = Sharing(store, group_rank, group_world_size) if store is not None and group_world_size > 1 else None
        self._thread = threading.Thread(target=self._run, args=(world_size, share, exitcode, self._stop),
                                        name="trainpod-hang-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self._thread = None

    def verdict(self) -> Verdict | None:
        """The verdict on this worker group, once its ranks are killed (None while there is none)."""
        with self._lock:
            verdict = self._verdict
        if verdict is not None:
            self._acted.wait(timeout=60)
        return verdict

    # --- the thread -----------------------------------------------------------------------------

    def _run(self, world_size: int, share: Sharing | None, exitcode, stop: threading.Event) -> None:
        trackers = {w.local_rank: Tracker(w.rank, self.node) for w in self._workers}
        try:
            while not stop.wait(self.interval):
                views = self._look(trackers, exitcode)
                verdict, remote = None, []
                if share is not None:
                    remote, verdict = share.exchange(views)
                verdict = verdict or decide(views + remote, time.time(), self.timeout, world_size)
                if verdict is not None and not stop.is_set():
                    if share is not None:
                        share.announce(verdict)
                    self._act(verdict, trackers, share)
                    return
        except Exception as exc:  # the watch must never take the agent down
            self.say(f"warning: the hang watch stopped: {type(exc).__name__}: {exc}")

    def _look(self, trackers: dict[int, Tracker], exitcode) -> list[RankView]:
        records = progress.read(self.progress_dir)
        looks = {}
        now = time.time()
        for worker in self._workers:
            state, own = _own(worker.pid)
            record = records.get(worker.local_rank)
            fresh = record is not None and record.time >= self._group_started
            step, reported = (record.step, record.time) if fresh else (-1, 0.0)
            # The descendants' CPU (a scan of /proc) only when the rank itself looks idle: computing, it is
            # busy whatever they do. A stale figure only ever makes a rank look busier than it is.
            children = self._children.get(worker.local_rank, 0.0)
            if state and trackers[worker.local_rank].idle(state, own + children, step, now):
                children = self._children[worker.local_rank] = _children_cpu(worker.pid)
            looks[worker.local_rank] = (state, own + children, step, reported)
        wanted = [w for w in self._workers if looks[w.local_rank][0] not in ("", "Z", "X")
                  and trackers[w.local_rank].wants_stack(*looks[w.local_rank][:3], now, self.refresh)]
        read = dict(zip([w.local_rank for w in wanted], self._stacks(wanted)))
        views = []
        for worker in self._workers:
            state, cpu, step, reported = looks[worker.local_rank]
            stack = read.get(worker.local_rank)
            sample = Sample(worker.rank, worker.local_rank, now, state, cpu, step,
                            stack=stack.main if stack is not None and stack.threads else None,
                            stack_error=stack.error if stack is not None else "",
                            exitcode=exitcode(worker.local_rank) if not state else None, step_time=reported)
            views.append(trackers[worker.local_rank].update(sample))
        return views

    def _stacks(self, workers: list[Worker], timeout: float = 2.0) -> list[stacks.Stack]:
        """Every thread's stack of each worker, read in parallel (py-spy, else the rank's own dump)."""
        if not workers:
            return []

        def one(worker: Worker) -> stacks.Stack:
            stack = stacks.pyspy(keeper.rank_pid(worker.pid), self.pyspy)  # the rank, not its keeper
            if stack.threads or not (stack.refused or not self.pyspy):
                return stack
            own = stacks.own_dump(self.progress_dir, worker.local_rank,
                                  self.progress_dir / f"stack{worker.local_rank}.txt", timeout=timeout)
            return own if own.threads else stacks.Stack(error=f"{stack.error}; {own.error}")

        with ThreadPoolExecutor(max_workers=min(8, len(workers))) as pool:
            return list(pool.map(one, workers))

    def _act(self, verdict: Verdict, trackers: dict[int, Tracker], share: Sharing | None) -> None:
        with self._lock:
            self._verdict = verdict
        if (figures := metrics.recorder()) is not None:
            figures.count("trainpod_hangs_total")
            figures.event("hang", ranks=sorted(view.rank for view in verdict.behind), stalled_s=round(verdict.stalled_for, 3),
                          limit_s=round(verdict.limit, 3))
        try:
            try:
                directory, note = self._write(verdict, trackers)
                stacks_at = f"stacks in {directory}{note}"
            except OSError as exc:  # the line matters more than the files
                stacks_at = f"stacks not written ({exc})"
            # What comes next (a restart, or the end with 124) is the restart policy's line, which follows.
            self.say(f"{describe(verdict, self.node)}; {stacks_at}")
            if share is not None:
                share.acknowledge(timeout=2 * self.interval + 2)
        finally:
            for worker in self._workers:
                try:
                    os.killpg(worker.pid, signal.SIGKILL)  # torchrun starts each rank in a session of its own
                except OSError:
                    with contextlib.suppress(OSError):
                        os.kill(worker.pid, signal.SIGKILL)
            self._acted.set()

    def _write(self, verdict: Verdict, trackers: dict[int, Tracker]) -> tuple[Path, str]:
        """Every local rank's stack, the flight recorders, a summary; (the directory, a note if not the output)."""
        name = f"{time.strftime('%Y%m%dT%H%M%S')}-node{self.node}"
        note = ""
        directory = self.output / HANGS_DIR / name
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            fallback = Path(tempfile.gettempdir()) / "trainpod-hangs" / name
            fallback.mkdir(parents=True, exist_ok=True)
            note = f" (not {directory}: {exc.strerror})"
            directory = fallback
        read = self._stacks(self._workers)  # first: a rank busy dumping its flight recorder would move under py-spy
        recorder = directory.parent / FLIGHT_RECORDER
        asked = []
        for worker in self._workers:
            if stacks.request(self.progress_dir, worker.local_rank, flight_recorder=recorder / f"rank{worker.rank}"):
                asked.append(worker)
            self._poke_nccl(worker.rank)
        for worker, stack in zip(self._workers, read):
            view = trackers[worker.local_rank].view
            head = (f"rank {worker.rank} (local rank {worker.local_rank}, node{self.node}, pid {worker.pid}): "
                    f"{view.kind if view else '?'}{' at ' + view.where if view and view.where else ''}, "
                    f"step {view.step if view else -1}; stack by {stack.source or 'nobody'}\n")
            (directory / f"rank{worker.rank}.txt").write_text(head + stack.render())
        summary = {"behind": [v.to_dict() for v in verdict.behind], "waiting": [v.to_dict() for v in verdict.waiting],
                   "stalled_for_s": verdict.stalled_for, "mismatch": verdict.mismatch, "sites": verdict.sites,
                   "node": self.node, "timeout_s": self.timeout}
        (directory / "hang.json").write_text(json.dumps(summary, indent=2))
        deadline = time.monotonic() + 2
        while asked and time.monotonic() < deadline:  # the flight recorders, from ranks that can still run
            asked = [w for w in asked if not (recorder / f"rank{w.rank}").exists()]
            time.sleep(0.05)
        return directory, note

    def _poke_nccl(self, rank: int) -> None:
        pipe = self.progress_dir / f"{PIPE_STEM}{rank}.pipe"
        try:
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return
        try:
            os.write(fd, b"1")
        except OSError:
            pass
        finally:
            os.close(fd)


class Sharing:
    """The views of every node, through the rendezvous store the agents share (one key per node)."""

    def __init__(self, store, group_rank: int, group_world_size: int):
        self.store = store
        self.key = f"{KEY_PREFIX}node{group_rank}"
        self.others = [f"{KEY_PREFIX}node{g}" for g in range(group_world_size) if g != group_rank]
        self.published = ""
        self.involved = 1  # nodes with a rank not busy, this one included: how many acknowledgements to wait for
        self.failed = False

    def exchange(self, views: list[RankView]) -> tuple[list[RankView], Verdict | None]:
        """Publish this node's views when one is not busy; read the others' while one is."""
        noteworthy = any(v.kind != BUSY for v in views)
        # Busy views carry no time: the key then changes only when a rank's state does.
        payload = json.dumps([{**v.to_dict(), "since": 0.0} if v.kind == BUSY else v.to_dict() for v in views]) if noteworthy else "[]"
        try:
            if payload != self.published:
                self.store.set(self.key, payload)
                self.published = payload
            if not noteworthy:
                return [], None
            if self.store.check([VERDICT_KEY]):
                return [], verdict_from_json(self.store.get(VERDICT_KEY))
            remote: list[RankView] = []
            involved = 1
            for key in self.others:
                if self.store.check([key]):
                    theirs = [RankView.from_dict(d) for d in json.loads(self.store.get(key))]
                    involved += bool(theirs)
                    remote += theirs
            self.involved = involved
            return remote, None
        except Exception:  # the store is gone (node 0's agent ended): judge this node alone
            self.failed = True
            return [], None

    def announce(self, verdict: Verdict) -> None:
        try:
            if not self.store.check([VERDICT_KEY]):
                self.store.set(VERDICT_KEY, verdict_to_json(verdict))
        except Exception:
            pass

    def acknowledge(self, timeout: float) -> None:
        """This node wrote its stacks; wait (bounded) until every involved node has, before killing."""
        try:
            self.store.add(ACK_KEY, 1)
            deadline = time.monotonic() + timeout
            while self.store.add(ACK_KEY, 0) < self.involved and time.monotonic() < deadline:
                time.sleep(0.1)
        except Exception:
            pass


def verdict_to_json(verdict: Verdict) -> str:
    return json.dumps({"behind": [v.to_dict() for v in verdict.behind], "waiting": [v.to_dict() for v in verdict.waiting],
                       "stalled_for": verdict.stalled_for, "mismatch": verdict.mismatch, "sites": verdict.sites,
                       "limit": verdict.limit, "step_s": verdict.step_s})


def verdict_from_json(text: str | bytes) -> Verdict:
    data = json.loads(text)
    return Verdict(behind=tuple(RankView.from_dict(v) for v in data["behind"]),
                   waiting=tuple(RankView.from_dict(v) for v in data["waiting"]),
                   stalled_for=data["stalled_for"], mismatch=data["mismatch"], sites=data["sites"],
                   limit=data.get("limit", 0.0), step_s=data.get("step_s", 0.0))


# --- the agent's side: mixed in before torch's LocalElasticAgent ---------------------------------------

HANG_MARK = "trainpod_hang"  # an attribute set on the ProcessFailure a hang becomes


def is_hang(failure) -> bool:
    """Whether a torchrun ProcessFailure is the one the hang watch made (exit 124)."""
    return getattr(failure, HANG_MARK, False) is True


def said(result) -> bool:
    """Whether a RunResult is a hang's, which the watch has already explained in its line."""
    return any(is_hang(f) for f in (getattr(result, "failures", None) or {}).values())


class WatchedAgent:
    """torch's agent hooks for the hang watch: `class Agent(WatchedAgent, LocalElasticAgent)`, with
    `hang_watch` set to a Watch (None: no watch). A layer that decides restarts goes before it, so a
    hang reaches it as a failed worker group like any other."""

    hang_watch: Watch | None = None

    def _start_workers(self, worker_group):
        watch = self.hang_watch
        if watch is not None:
            watch.prepare()
        pids = super()._start_workers(worker_group)
        if watch is not None:
            self._watch_workers(worker_group, pids)
        return pids

    def _shutdown(self, *args, **kwargs):
        if self.hang_watch is not None:
            self.hang_watch.stop()
        super()._shutdown(*args, **kwargs)

    def _monitor_workers(self, worker_group):
        # Asked before and after torch looks: the ranks the watch killed are no crash.
        hung = self._hang_result(worker_group)
        result = hung or super()._monitor_workers(worker_group)
        return hung or self._hang_result(worker_group) or result

    def _watch_workers(self, worker_group, pids: Mapping[int, int]) -> None:
        workers = [Worker(w.global_rank, w.local_rank, pids[w.local_rank]) for w in worker_group.workers]

        def exitcode(local_rank: int) -> int | None:
            try:  # torch's private API, for the words only: "exited with 0"
                code = self._pcontext.subprocess_handlers[local_rank].proc.returncode
            except (AttributeError, KeyError, TypeError):
                return None
            return None if code is None else (128 - code if code < 0 else code)

        self.hang_watch.start(workers, world_size=worker_group.workers[0].world_size if workers else 0,
                              store=worker_group.store, group_rank=worker_group.group_rank or 0,
                              group_world_size=worker_group.group_world_size or 1, exitcode=exitcode)

    def _hang_result(self, worker_group):
        """torchrun's RunResult for a hung worker group (FAILED, exit 124 for the first rank behind), or None."""
        verdict = self.hang_watch.verdict() if self.hang_watch is not None else None
        if verdict is None:
            return None
        from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        behind = {v.rank for v in verdict.behind}
        first = min(worker_group.workers, key=lambda w: (w.global_rank not in behind, w.global_rank))
        failure = ProcessFailure(local_rank=first.local_rank, pid=first.id or 0, exitcode=EXIT_HANG, error_file="")
        setattr(failure, HANG_MARK, True)
        return RunResult(state=WorkerState.FAILED, failures={first.global_rank: failure})
