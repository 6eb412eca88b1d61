"""Timers tested at their scale: every timeout that can end a job is set low, the job restarts, and it trains
well past that timeout after each restart, then ends with 0 on every node (no Docker: real `trainpod run`
nodes on this host, real torchrun, a real etcd from tests/fixtures/etcd.py).

Issue 29 was such a timer: torch stops the ranks before each worker-group restart through the agent's
_shutdown(), which also closed trainpod's JobControl, so the master's last answer froze and exactly
--rejoin-timeout after the restart the other node declared a live master lost (69). No test saw it, since
every multi-node recovery test ended within a minute of its restart. Here the timers are a few seconds, and
the job trains at least 3 x the longest of them (AFTER) after each restart, counted in steps of 0.1 s at
least, so a fast machine cannot cut a window short. Two restarts per job, both of node 1's rank, so that its
second failure is "the same failure twice" unless the attempt before it ran longer than --progress-window.
Every 2-node job runs with

- --rejoin-timeout (how long a node waits for a silent master: JobControl's view of the store, c10d);
- --hang-timeout (the agent's hang watch: in the c10d job it is also what restarts the group, twice: node
  1's rank is stopped with SIGSTOP, the watch's verdict kills the group, 124; its verdict and its clocks must
  not outlive the group they judged);
- --progress-window (the budget: an attempt that ran longer is progress);
- in the c10d job, the rendezvous' join timeout (--rdzv-conf join_timeout; by default --connect-timeout's
  value, which also bounds the start's waits, kept long here: a start under load may take more): every
  rendezvous comes more than that after the one before. (Not in the elastic etcd jobs, where both nodes start
  the rendezvous on their own: under load, one may take longer than a low join timeout to get there.)
- the rendezvous keep-alive: torch's dynamic rendezvous (c10d, etcd-v3) drops a node that sent no heartbeat
  for keep_alive_interval x keep_alive_max_attempt (1 x 3 s, trainpod's default for an elastic job, set
  for the fixed-size c10d one); torch's etcd backend keeps a key per node with a TTL (keep_alive_ttl, 4 s
  by default in an elastic job). A lapsed keep-alive ends no job by itself (it matters at the next
  rendezvous), so these tests read the rendezvous' own record while the job trains: every node of the round
  renewed its keep-alive recently, at every look after each restart.

over c10d (fixed size, 2 nodes: node 0's agent hosts the store), etcd-v3 (trainpod's backend) and etcd
(torch's, etcd's v2 API), the last two elastic (1:2), as etcd jobs are. And in-process recovery: a
SIGKILLed rank is replaced (trainpod.agent.keeper), the group re-forms, and it trains 3 x inprocess.STUCK_S (10 s:
a rank whose main thread stays idle where it was once its group was given up ends itself; a module
constant) past the replacement, on a script whose main thread sleeps most of each step.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psutil
import pytest

from fixtures.ports import free_port
from fixtures.processes import script_rank_pid

pytest.importorskip("torch")

pytestmark = pytest.mark.slow

ENTRYPOINT = str(Path(__file__).resolve().parents[2] / "entrypoint")
LOW = 4  # --rejoin-timeout, --hang-timeout, --progress-window
JOIN = 10  # the rendezvous' join timeout (the c10d job's)
KEEP_ALIVE = {"interval": 1, "attempts": 3}  # the dynamic rendezvous drops a node silent for 3 s
ETCD_TTL = 4  # torch's etcd backend: the keep-alive key's TTL in an elastic job (trainpod.launcher.resolve.ETCD_V2_CONF)
AFTER = 3 * LOW  # seconds of training after each restart, at least: 3 x the longest timer that runs then
STEP_S = 0.1  # each step sleeps this long
FIRST = 20  # steps of the first attempt before node 1's rank is signalled
SECOND = int(AFTER / STEP_S)  # steps of the second attempt before it is: AFTER seconds at least
STEPS = SECOND + 10  # each attempt starts at step 0 (no checkpoint): the last one trains AFTER seconds too
assert JOIN < AFTER  # so the third rendezvous comes more than the join timeout after the second
# The elastic jobs' last call: both nodes start together, but under load (CI) one reached the first rendezvous more
# than trainpod's 3 s after the other, which formed world 1 alone and trained the whole job before the other came.
# 30 s covers that skew. It is no timer of a running job: a round that both nodes join forms at once.
MEET = "last_call_timeout=30"
STUCK_S = 10  # trainpod.train.inprocess.STUCK_S: a module constant, run past at its real value
HANG_LINE = "hang: no progress"  # the hang watch's verdict
FAILURE_LINES = (  # never after the first restart began
    "stopped answering",  # --rejoin-timeout: the master's store fell silent (issue 29)
    "went away after the job started",
    "not restarting",  # the budget: the same failure twice (the progress window not seen), or a final code
    "giving up",  # the budget spent
    "rendezvous at",  # the join timeout ("error: rendezvous at ... failed: RendezvousTimeoutError"), or any failure
    "RendezvousTimeoutError",
)

# A plain torch.distributed script with no checkpoint: each attempt starts at step 0 and trains argv[1] steps of
# argv[2] seconds, reporting each step (trainpod.train.progress: the hang watch sees a rank whose step advances as busy).
SCRIPT = """
import os, sys, time, torch, torch.distributed as dist
from trainpod.train import distributed, progress
print(f"start pid {os.getpid()}", flush=True)
dist.init_process_group("gloo")
t = torch.ones(1)
for step in range(int(sys.argv[1])):
    dist.all_reduce(t)
    time.sleep(float(sys.argv[2]))
    progress.step(step)
    if step % 10 == 0:
        print(f"step {step} world {dist.get_world_size()}", flush=True)
distributed.shutdown()
print("done", flush=True)
"""

# The same with in-process recovery (trainpod.train.inprocess): a replacement joins the survivors at their step.
INPROCESS_SCRIPT = """
import os, sys, time, torch, torch.distributed as dist
from trainpod.train import distributed, inprocess, progress
print(f"start pid {os.getpid()} generation {inprocess.generation()}", flush=True)
inprocess.init_process_group("gloo")
steps, done = int(sys.argv[1]), [0]


def train():
    at = torch.tensor([float(done[0])])
    dist.all_reduce(at, op=dist.ReduceOp.MAX)  # a replacement (0) resumes where the survivors are
    step = int(at.item())
    while step < steps:
        dist.all_reduce(torch.ones(1))
        time.sleep(float(sys.argv[2]))
        step += 1
        done[0] = step
        progress.step(step)
        if step % 10 == 0:
            print(f"step {step} generation {inprocess.generation()}", flush=True)


while True:
    try:
        train()
        break
    except RuntimeError as error:
        print(f"re-formed at generation {inprocess.recover(error)}", flush=True)
distributed.shutdown()
print("done", flush=True)
"""

STEP_LINE = re.compile(r"\] step (\d+) ")
START_LINE = re.compile(r"\] start pid (\d+)")


def clean_env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRAINPOD_", "MASTER_", "PET_", "PAI_", "TORCHELASTIC_", "GLOO_", "NCCL_", "SLURM_"))
           and k not in ("NNODES", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return {**env, "PYTHONPATH": ENTRYPOINT, "OMP_NUM_THREADS": "1", **more}


class Node:
    """One `trainpod run`, in a session of its own, its output in a file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], tmp: Path):
        self.name = name
        self.log = tmp / f"{name}.log"
        with self.log.open("w") as out:
            # in tmp, with its output there too (the hang watch writes stacks to TRAINPOD_OUTPUT_DIR/hangs)
            self.proc = subprocess.Popen(argv, env={**env, "TRAINPOD_OUTPUT_DIR": str(tmp / f"{name}-output")}, cwd=tmp,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def attempt(self, since: int = 0) -> str | None:
        """The output since the start of the rank started last, after offset `since` of the log (None: none)."""
        text = self.text()[since:]
        starts = list(START_LINE.finditer(text))
        return text[starts[-1].start():] if starts else None

    def processes(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def rank_pid(self, script: str) -> int | None:
        """The pid of the node's rank: the process that runs the script and has no child (a wrapper or the
        warm server has one)."""
        return script_rank_pid(self.proc.pid, script)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def reached(attempt: str | None, step: int) -> bool:
    return attempt is not None and any(int(n) >= step for n in STEP_LINE.findall(attempt))


def tails(nodes: list[Node], size: int = 3000) -> str:
    return "\n".join(f"--- {node.name}:\n{node.text()[-size:]}" for node in nodes)


# --- the rendezvous' record of each node's keep-alive -------------------------------------------------


@dataclass(frozen=True)
class Look:
    """One look at the rendezvous' current round: its nodes, and the oldest keep-alive among them (seconds;
    inf when a node of the round has none left)."""

    nodes: int
    oldest: float


def _dynamic(state) -> Look:
    """torch's dynamic rendezvous state (_RendezvousState): its participants' last heartbeats."""
    now = datetime.now(timezone.utc)
    ages = [(now - state.last_heartbeats[node]).total_seconds() if node in state.last_heartbeats else float("inf")
            for node in state.participants]
    return Look(len(state.participants), max(ages, default=float("inf")))


class C10dRecord:
    """torch's c10d backend: the state in node 0's store, key torch.rendezvous.<run id>, base64 of the pickle."""

    limit = KEEP_ALIVE["interval"] * KEEP_ALIVE["attempts"]

    def __init__(self, port: int, run_id: str):
        self.port, self.key, self.store = port, f"torch.rendezvous.{run_id}", None

    def look(self) -> Look | None:
        import torch.distributed as dist

        try:
            if self.store is None:
                self.store = dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=2))
            if not self.store.check([self.key]):
                return None
            return _dynamic(pickle.loads(base64.b64decode(self.store.get(self.key))))
        except (RuntimeError, OSError):
            self.store = None
            return None


class EtcdV3Record:
    """trainpod's etcd-v3 backend: the same state, the value of /trainpod/rdzv/<run id>/state."""

    limit = KEEP_ALIVE["interval"] * KEEP_ALIVE["attempts"]

    def __init__(self, endpoint: str, run_id: str):
        from trainpod.rendezvous.etcd_http import EtcdClient

        self.client, self.key = EtcdClient(endpoint, 2.0), f"/trainpod/rdzv/{run_id}/state".encode()

    def look(self) -> Look | None:
        try:
            found = self.client.get(self.key)
        except Exception:  # etcd_http's errors: a slow answer under load is a look skipped
            return None
        return None if found is None else _dynamic(pickle.loads(found[0]))


class EtcdV2Record:
    """torch's etcd backend: the final version lists a keep-alive key per node, with a TTL that the node's
    agent renews every TTL/2; a key's age is the TTL less what is left of it (whole seconds)."""

    limit = ETCD_TTL

    def __init__(self, endpoint: str, run_id: str):
        self.base = f"http://{endpoint}/v2/keys"
        self.active = f"/torchelastic/p2p/run_{run_id}/rdzv/active_version"

    def _get(self, key: str) -> dict | None:
        try:
            with urllib.request.urlopen(self.base + key, timeout=2) as answer:
                return json.loads(answer.read())["node"]
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise

    def look(self) -> Look | None:
        try:
            active = self._get(self.active)
            state = json.loads(active["value"]) if active is not None else {}
            if state.get("status") != "final":
                return None
            keys = [self._get(key) for key in state.get("keep_alives", [])]
        except (OSError, ValueError, KeyError):
            return None
        ages = [ETCD_TTL - key.get("ttl", 0) if key is not None else float("inf") for key in keys]
        return Look(len(keys), max(ages, default=float("inf")))


# --- a 2-node job, two restarts ---------------------------------------------------------------------


@dataclass
class Restart:
    """What followed one signal to node 1's rank: the looks at the rendezvous while both nodes trained in the
    new attempt, each node's output from its new rank's start on, and the seconds until the next signal or
    the end of training."""

    offsets: list[int]  # where each node's log was at the signal
    began: float  # time.monotonic() of the signal
    looks: list[Look] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    seconds: float = 0.0


def two_nodes(tmp: Path, flags: list[str], env: dict[str, str]) -> list[Node]:
    script = tmp / "long.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, "-m", "trainpod", "run", "--nproc-per-node", "1", "--warm-start", "on", "--progress-window",
            str(LOW), "--hang-timeout", str(LOW), "--rejoin-timeout", str(LOW), *flags, "--", sys.executable, str(script),
            str(STEPS), str(STEP_S)]
    return [Node(f"node{i}", argv, {**env, **({"NODE_RANK": str(i)} if "NNODES" in env else {})}, tmp) for i in (0, 1)]


def run_with_two_restarts(nodes: list[Node], record, how: signal.Signals, timeout: float = 360) -> tuple[list, list]:
    """Signal node 1's rank (`how`: SIGKILL, or SIGSTOP for the hang watch to find) once the first attempt
    trained FIRST steps, and again once the second trained SECOND; look at the rendezvous' record every 0.5 s
    while both nodes train after each restart; wait for the end. (exit codes, [Restart, Restart])."""
    deadline = time.monotonic() + timeout
    restarts: list[Restart] = []

    def wait(until, what: str) -> None:
        restart = restarts[-1] if restarts else None
        next_look = 0.0
        while not until():
            assert time.monotonic() < deadline, f"{what}: still waiting after {timeout} s\n" + tails(nodes)
            if any(node.proc.poll() is not None for node in nodes):
                assert until(), f"{what}: a node ended\n" + tails(nodes)  # (unless its last line came meanwhile)
                break
            if restart is not None and time.monotonic() >= next_look and all(
                    reached(node.attempt(offset), 10) for node, offset in zip(nodes, restart.offsets)):
                look = record.look()
                if look is not None:
                    restart.looks.append(look)
                next_look = time.monotonic() + 0.5
            time.sleep(0.1)

    def signal_rank() -> None:
        pid = nodes[1].rank_pid("long.py")
        assert pid is not None, "no rank on node 1\n" + tails(nodes)
        if restarts:
            restarts[-1].seconds = time.monotonic() - restarts[-1].began
        restarts.append(Restart([len(node.text()) for node in nodes], time.monotonic()))
        os.kill(pid, how)

    def trained(steps: int):
        return lambda: all(reached(node.attempt(offset), steps) for node, offset in zip(nodes, restarts[-1].offsets))

    try:
        wait(lambda: reached(nodes[1].attempt(), FIRST), "the first attempt")
        signal_rank()
        wait(trained(SECOND), "the second attempt")
        signal_rank()
        wait(lambda: any("] done" in (node.attempt(offset) or "") for node, offset in zip(nodes, restarts[-1].offsets)),
             "the third attempt")
        restarts[-1].seconds = time.monotonic() - restarts[-1].began  # training ended: the keep-alives stop
        codes = [node.proc.wait(max(1.0, deadline - time.monotonic())) for node in nodes]
    finally:
        for node in nodes:
            node.stop()
    texts = [node.text() for node in nodes]
    for restart, end in zip(restarts, [r.offsets for r in restarts[1:]] + [[len(text) for text in texts]]):
        for text, begin, stop in zip(texts, restart.offsets, end):
            start = START_LINE.search(text, begin, stop)
            restart.texts.append(text[start.start():stop] if start else "")
    return codes, restarts


def check(codes: list, restarts: list[Restart], texts: list[str], limit: float) -> None:
    both = "\n".join(f"--- node{i}:\n{text[-4000:]}" for i, text in enumerate(texts))
    assert codes == [0, 0], both
    for line in FAILURE_LINES:
        assert not any(line in text[restarts[0].offsets[i]:] for i, text in enumerate(texts)), f"{line!r}:\n{both}"
    dones = [text.count("] done") for text in texts]
    assert dones == [1, 1], f"'] done' seen {dones} times:\n" + "\n".join(
        f"--- node{i} in full:\n{text}" for i, text in enumerate(texts) if dones[i] != 1)
    # The second restart was allowed because the attempt before it ran longer than --progress-window. (Unless
    # node 0 came back more than last_call_timeout after node 1 in an elastic job: that round had one node, a
    # membership change, which forgets the failure before. Not seen so far; the job must still end with 0.)
    if "a membership change" not in texts[1][restarts[0].offsets[1]:]:
        assert "--progress-window" in texts[1] and "the budget is full again" in texts[1], both
    for number, restart in enumerate(restarts, 1):
        assert all(restart.texts), (number, both)  # both nodes started a rank after it
        assert not any(HANG_LINE in text for text in restart.texts), (number, both)  # the new group was never judged hung
        assert restart.seconds >= AFTER, (number, restart.seconds, both)  # trained past every timer after it
        looks = restart.looks
        assert len(looks) >= 5, (number, looks, both)  # the rendezvous' record was read, again and again
        # Every node of the round kept renewing its keep-alive: one that stopped after the restart would be older
        # than the limit (and dropped by the dynamic rendezvous) for most of the window. Twice the limit: a
        # renewal late under load is no failure, nor seen as one by the rendezvous while its node trains.
        assert all(look.nodes == 2 for look in looks), (number, looks, both)
        assert max(look.oldest for look in looks) < 2 * limit, (number, looks, both)
    print(f"\nafter the restarts: {restarts[0].seconds:.1f} s, {restarts[1].seconds:.1f} s of training; the oldest "
          f"keep-alive seen: {', '.join(f'{max(look.oldest for look in r.looks):.1f} s' for r in restarts)} (limit {limit} s)")


def test_a_c10d_job_restarted_twice_by_the_hang_watch_trains_past_every_timer(tmp_path):
    port, run_id = free_port(), f"timers-{uuid.uuid4().hex[:8]}"
    conf = f"join_timeout={JOIN},keep_alive_interval={KEEP_ALIVE['interval']},keep_alive_max_attempt={KEEP_ALIVE['attempts']}"
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NNODES="2")
    nodes = two_nodes(tmp_path, ["--rdzv-id", run_id, "--rdzv-conf", conf], env)
    codes, restarts = run_with_two_restarts(nodes, C10dRecord(port, run_id), signal.SIGSTOP)
    texts = [node.text() for node in nodes]
    check(codes, restarts, texts, C10dRecord.limit)
    for restart in restarts:  # each restart was the hang watch's: node 1's rank stopped
        assert re.search(rf"{HANG_LINE}.*behind: rank 1 .*stopped", texts[1][restart.offsets[1]:]), texts[1][-4000:]
    assert texts[1].count("restarting the worker group: rank 1 hung (124: stopped by the hang watch)") == 2, texts[1][-4000:]


@pytest.mark.parametrize("backend,server,record", [("etcd-v3", "etcd", EtcdV3Record), ("etcd", "etcd_v2", EtcdV2Record)],
                         ids=["etcd-v3", "etcd"])
def test_an_elastic_etcd_job_restarted_twice_by_a_killed_rank_trains_past_every_timer(tmp_path, request, backend, server,
                                                                                    record):
    endpoint, run_id = request.getfixturevalue(server).endpoint, f"timers-{uuid.uuid4().hex[:8]}"
    # the keep-alive: trainpod's elastic defaults (keep_alive_interval=1, keep_alive_max_attempt=3; keep_alive_ttl=4)
    nodes = two_nodes(tmp_path, ["--nnodes", "1:2", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id",
                                 run_id, "--rdzv-conf", MEET], clean_env())
    codes, restarts = run_with_two_restarts(nodes, record(endpoint, f"{run_id}.g0"), signal.SIGKILL)
    texts = [node.text() for node in nodes]
    check(codes, restarts, texts, record.limit)
    assert texts[1].count("was killed by SIGKILL") == 2, texts[1][-4000:]


# --- in-process recovery -------------------------------------------------------------------------------


def test_a_rank_replaced_in_process_trains_past_the_stuck_rank_watch(tmp_path):
    """A replacement (trainpod.agent.keeper) re-forms the group with the survivor; then 3 x inprocess.STUCK_S of steps
    whose main thread sleeps most of the time: a stuck-rank watch still running after the recovery would end
    the survivor (its main thread idle where it was), and the agent would restart the group."""
    script = tmp_path / "inprocess.py"
    script.write_text(INPROCESS_SCRIPT)
    kill_at, after = FIRST, int(3 * STUCK_S / STEP_S)  # steps
    argv = [sys.executable, "-m", "trainpod", "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
            "--backend", "gloo", "--recovery", "in-process", "--warm-start", "on", "--max-restarts", "1",
            "--", sys.executable, str(script), str(kill_at + after + 10), str(STEP_S)]
    node = Node("node", argv, clean_env(), tmp_path)
    try:
        deadline = time.monotonic() + 300
        while not reached(node.text(), kill_at):
            assert time.monotonic() < deadline and node.proc.poll() is None, node.text()[-4000:]
            time.sleep(0.1)
        ranks = {}
        for process in node.processes():
            try:
                if re.fullmatch(r"rank\d+", process.name()):
                    ranks[process.name()] = process.pid
            except psutil.NoSuchProcess:
                continue
        assert set(ranks) == {"rank0", "rank1"}, (ranks, node.text()[-4000:])
        os.kill(ranks["rank1"], signal.SIGKILL)
        killed = time.monotonic()
        code = node.proc.wait(max(1.0, deadline - time.monotonic()))
        ended = time.monotonic()
    finally:
        node.stop()
    text = node.text()
    assert code == 0, text[-4000:]
    assert f"rank 1 (pid {ranks['rank1']}) was killed by SIGKILL: its replacement joins" in text, text[-4000:]
    assert "re-formed at generation 1" in text, text[-4000:]  # the survivor recovered in its own process
    assert "restarting the worker group" not in text, text[-4000:]  # and the agent never restarted the group
    assert "still idle in" not in text, text[-4000:]  # inprocess.STUCK_S's line
    assert "no in-process recovery" not in text, text[-4000:]  # a re-form that failed (inprocess.REFORM_TIMEOUT_S)
    assert text.count("was killed by") == 1, text[-4000:]  # and no rank was replaced again
    assert text.count("] done") == 2, text[-4000:]
    assert re.search(rf"\] step {kill_at + after} generation 1", text), text[-4000:]  # trained on in generation 1
    assert ended - killed >= after * STEP_S, (ended - killed, text[-4000:])
    print(f"\nin-process: {ended - killed:.1f} s from the kill to the end (inprocess.STUCK_S {STUCK_S} s)")
