"""Soak test (issue 29, `make soak`): the 2-node compose job trains for a long time while a fault schedule hits it.

A recovery that works once can leave a timer behind that fires later: after a worker-group restart, the agent once
stopped its job-control thread (trainpod.agent.control), so exactly --rejoin-timeout after each restart the other node
declared the master lost and the job died with 69. The fault tests stop looking when the job is back. Here the
timers are set low (--rejoin-timeout 5, --hang-timeout 10) and after every fault the job must train on for SETTLE_S,
twice the longest of them, with nothing happening that no fault caused: no restart, resume, hang verdict or error
line on either node. Then the next fault, until the job nears its end.

The job: compose/pai-2node with tests/integration/compose/pai-2node-faults.yaml (2 containers x 2 ranks,
cifar10-ddp on synthetic data, a step line per step, a checkpoint every 4 steps), each step at least STEP_S long
(TRAINPOD_FAILPOINTS=pace@400: a sleep), --epochs scaled to --minutes at that pace (a loaded machine takes longer;
the reference run is not paced).
The first fault of every run is a checkpoint write killed
(TRAINPOD_FAILPOINTS=checkpoint-write@12: rank 0 dies between the bytes and the rename; another every
FAILPOINT_EVERY_MIN minutes of steps), then in turn (CYCLE): SIGKILL of a rank on node0, SIGKILL of a rank on node1,
SIGSTOP of a rank for STOP_S (< --hang-timeout: it must cost nothing) then SIGCONT, and node1's container killed and
started again (a node lost and back). Not in the schedule, by design: `docker stop` of one node (SIGTERM ends the whole
job with 143, trainpod.agent.control's stop key) and the loss of node0 (it hosts the rendezvous store: away for longer than
--rejoin-timeout, the job ends with 69, and its container takes 10 s or more to start here).

The configurations (CONFIGS): --recovery restart with --warm-start on and off, and --recovery in-process, which needs a
warm start (with --warm-start off `trainpod run` refuses it in one line: that combination does not exist). Each passes
when both nodes exit 0, rank 0's checksum is the uninterrupted run's (one reference run of the same steps, or
--reference), and every fault was followed by SETTLE_S of clean training. One line per configuration, e.g. (9024
steps, 2026-11-26, this 2-core host at a load of 5 from other work)

    soak restart/warm-on: exit 0/0, checksum identical, 39 faults, 30 recoveries in 1.0-15.5 s (median 1.6; ...),
    SIGSTOP 4 s x9: next step 0.0-0.2 s after SIGCONT, 65 steps lost, >= 20.0 s clean after each, 16.8 min

Recovery: from the fault (the return of `docker exec kill` or `docker kill`; the failpoint's own line) to the first
step line of rank 0 after its resume, by Docker's timestamps of the lines. Steps lost: for each resume, rank 0's last
step before it minus the step it resumed from.

    python3 bench/soak.py --minutes 30 [--configs restart/warm-on,in-process/warm-on] [--reference CHECKSUM]

Exits 1 if any configuration fails; the nodes' logs are kept in --out (build/soak/<time>/<configuration>/).
tests/integration/test_soak.py runs a short form of it.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import random
import re
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import results_page

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from fixtures.docker_env import REPO, ComposeJob, find_rank, run  # noqa: E402

COMPOSE = REPO / "compose" / "pai-2node" / "compose.yaml"
FAULTS_OVERLAY = REPO / "tests" / "integration" / "compose" / "pai-2node-faults.yaml"  # batch 8, a checkpoint every 4 steps
NODES = ("node0", "node1")
RANKS = {"node0": (0, 1), "node1": (2, 3)}  # the rendezvous orders the nodes by address: node0 has ranks 0 and 1

# The timers, low, and how long the job trains after each fault: twice the longest of them (trainpod.train.inprocess's
# 10 s watch of a rank stuck after its group was given up is the other one).
REJOIN_S = 5
HANG_S = 10
STOP_S = 4  # a SIGSTOP shorter than --hang-timeout: no verdict, no restart
SETTLE_S = 2 * max(REJOIN_S, HANG_S, 10)
GRACE_S = 1.0  # after a recovery's first step: lines of the recovery still on their way (another node's)

BATCH = 8  # per rank: pai-2node-faults.yaml's
SAMPLES = 1024  # synthetic samples: 32 steps an epoch (4 ranks x BATCH)
STEPS_PER_EPOCH = SAMPLES // (4 * BATCH)
CHECKPOINT_EVERY = 4  # pai-2node-faults.yaml
# Every step of the job lasts at least STEP_S (the failpoint pace@MS): --minutes -> epochs, and the schedule's steps
# (a fault, then SETTLE_S of clean steps before the next) hold on an idle fast machine as on a loaded one. Unpaced, the
# short form's 640 steps ran 15 a second on an idle host, too fast for its second fault (seen once in four runs). At
# 0.4 s a step the schedule, counted in seconds, takes half the steps of 0.2 s: half the training's CPU for the same
# timers (the short form runs in `make test`, whose time is the CPU its jobs take).
STEP_S = 0.4
FIRST_FAULT_STEP = 2 * CHECKPOINT_EVERY
FAILPOINT_EVERY_MIN = 10  # after the first fault, a checkpoint write killed every this many minutes of job
RECOVERY_TIMEOUT_S = 300  # no step this long after a fault: a failed recovery

CYCLE = ("kill-rank-node0", "kill-rank-node1", "sigstop", "kill-node1")
CHECKPOINT_WRITE = "checkpoint-write"


@dataclass(frozen=True)
class Config:
    recovery: str
    warm: str

    @property
    def name(self) -> str:
        return f"{self.recovery}/warm-{self.warm}"


# --recovery in-process with --warm-start off is refused by `trainpod run` (a keeper forks the ranks).
CONFIGS = {c.name: c for c in (Config("restart", "on"), Config("restart", "off"), Config("in-process", "on"))}

STEP = re.compile(r"^\[node0 rank0\] epoch \d+/\d+ step (\d+)/(\d+)")
RESUMED = re.compile(r"^\[node0 rank0\] .*resumed from the checkpoint of step (\d+)")
FAILPOINT = re.compile(r"failpoint checkpoint-write@(\d+): SIGKILL")
METRICS = re.compile(r"^\[node0 rank0\] trainpod-metrics: ")
# What no fault in a clean stretch may cause: an agent's or keeper's line (a failure, a restart, a hang verdict, a lost
# master, an error), a rank's in-process recovery, a resume.
TROUBLE = re.compile(r"\] trainpod: |resumed from the checkpoint|re-formed in-process")


class SoakFailure(Exception):
    pass


def stamp(text: str) -> float:
    """Docker's RFC 3339 timestamp (nanoseconds, trailing zeros trimmed) -> seconds since the epoch."""
    whole, _, frac = text.rstrip("Z").partition(".")
    return datetime.datetime.fromisoformat(f"{whole}.{(frac + '000000')[:6]}+00:00").timestamp()


@dataclass
class Line:
    at: float  # Docker's timestamp: when the daemon read it from the container (a follower's lag does not count)
    node: str
    text: str


class Logs:
    """Both nodes' lines as they come (`docker logs -f -t`, followed again after a container restarts), and rank 0's
    steps, resumes, failpoints and metrics line among them."""

    def __init__(self, job: ComposeJob):
        self.containers = {node: job.compose("ps", "-a", "-q", node).stdout.strip() for node in NODES}
        self.lines: list[Line] = []
        self.troubles: list[Line] = []  # the lines among them that TROUBLE matches
        self.steps: list[tuple[float, int]] = []  # rank 0's (time, step)
        self.resumes: list[tuple[float, int]] = []
        self.failpoints: list[tuple[float, int]] = []
        self.total = self.metrics_at = None
        self._closed = threading.Event()
        self._processes: list[subprocess.Popen] = []
        self._threads = [threading.Thread(target=self._follow, args=(node,), daemon=True) for node in NODES]
        for thread in self._threads:
            thread.start()

    def state(self, node: str) -> tuple[bool, str, int]:
        running, started, code = run("docker", "inspect", "-f", "{{.State.Running}} {{.State.StartedAt}} {{.State.ExitCode}}",
                                     self.containers[node]).stdout.split()
        return running == "true", started, int(code)

    def _follow(self, node: str) -> None:
        followed = None
        while not self._closed.is_set():
            try:
                running, started, _ = self.state(node)
            except AssertionError:  # the container is gone (the job torn down)
                return
            if not running or started == followed:
                self._closed.wait(0.1)
                continue
            followed = started
            process = subprocess.Popen(["docker", "logs", "-f", "-t", "--since", started, self.containers[node]],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
            self._processes.append(process)
            for raw in process.stdout:
                when, _, text = raw.rstrip("\n").partition(" ")
                self._take(Line(stamp(when), node, text))
            process.wait()

    def _take(self, line: Line) -> None:
        if line.node == "node0":
            if step := STEP.match(line.text):
                self.steps.append((line.at, int(step.group(1))))
                self.total = int(step.group(2))
            elif resumed := RESUMED.match(line.text):
                self.resumes.append((line.at, int(resumed.group(1))))
            elif METRICS.match(line.text):
                self.metrics_at = line.at
        if failpoint := FAILPOINT.search(line.text):
            self.failpoints.append((line.at, int(failpoint.group(1))))
        if TROUBLE.search(line.text):
            self.troubles.append(line)
        self.lines.append(line)

    def trouble(self, start: float, end: float) -> list[Line]:
        return [line for line in list(self.troubles) if start <= line.at < end]

    def step_after(self, when: float) -> tuple[float, int] | None:
        """Rank 0's first step line after `when`."""
        return next(((at, step) for at, step in list(self.steps) if at > when), None)

    def rate(self, window_s: float = 10.0) -> float:
        """Rank 0's steps per second over its last `window_s` seconds of steps."""
        steps = list(self.steps)
        recent = [(at, step) for at, step in steps if at >= steps[-1][0] - window_s]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return 1 / STEP_S
        return max(1 / STEP_S / 4, (len(recent) - 1) / (recent[-1][0] - recent[0][0]))

    def close(self) -> None:
        self._closed.set()
        for process in self._processes:
            process.kill()
        for thread in self._threads:
            thread.join(5)


@dataclass
class Fault:
    kind: str
    what: str  # which rank (pid) or node, for the report
    start: float  # wall clock when the fault began (a failpoint: its line's timestamp)
    hit: float  # when it surely took effect (the kill returned; SIGCONT sent; the failpoint's line)
    step: int = 0  # rank 0's last step before it
    recovered: float | None = None  # rank 0's first step after it (after its resume, where it caused one)
    resumes: list[tuple[int, int]] = field(default_factory=list)  # (last step before, resumed step)
    clean_s: float = 0.0  # seconds of clean training after the recovery, until the next fault or the job's end

    @property
    def recovery_s(self) -> float:
        return self.recovered - self.hit

    @property
    def lost(self) -> int:
        return sum(last - resumed for last, resumed in self.resumes)


@dataclass
class Result:
    config: str
    steps: int
    codes: dict[str, int | None] = field(default_factory=dict)
    checksum: str | None = None
    reference: str | None = None
    faults: list[Fault] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    minutes: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems and self.codes == {"node0": 0, "node1": 0} and self.checksum == self.reference

    def line(self) -> str:
        codes = "/".join(str(self.codes.get(node, "?")) for node in NODES)
        same = ("identical" if self.checksum == self.reference else "MISSING" if self.checksum is None
                else f"DIFFERENT ({self.checksum[:16]}... vs {self.reference[:16]}...)")
        recovered = [f for f in self.faults if f.kind != "sigstop" and f.recovered is not None]
        stops = [f for f in self.faults if f.kind == "sigstop" and f.recovered is not None]
        parts = [f"exit {codes}", f"checksum {same}", f"{len(self.faults)} faults"]
        if recovered:
            seconds = sorted(f.recovery_s for f in recovered)
            kinds = {f.kind: statistics.median(g.recovery_s for g in recovered if g.kind == f.kind) for f in recovered}
            parts.append(f"{len(recovered)} recoveries in {seconds[0]:.1f}-{seconds[-1]:.1f} s (median {statistics.median(seconds):.1f}; "
                         + ", ".join(f"{kind} {median:.1f}" for kind, median in kinds.items()) + ")")
        if stops:
            seconds = sorted(f.recovery_s for f in stops)
            parts.append(f"SIGSTOP {STOP_S} s x{len(stops)}: next step {seconds[0]:.1f}-{seconds[-1]:.1f} s after SIGCONT")
        parts.append(f"{sum(f.lost for f in self.faults)} steps lost")
        if self.faults and not self.problems:
            parts.append(f">= {min(f.clean_s for f in self.faults):.1f} s clean after each")
        parts.append(f"{self.minutes:.1f} min")
        text = f"soak {self.config}: " + ", ".join(parts)
        return text + "".join(f"\n  FAILED: {problem}" for problem in self.problems)


# --- the job ---


def job_env(steps: int, subnet: str | None, recovery: str, failpoints: list[int], paced: bool = True) -> dict[str, str]:
    """The job's variables; without `subnet` the job takes a free one (fixtures.subnets)."""
    return {**({"TRAINPOD_SUBNET_PREFIX": subnet} if subnet else {}), "TRAINPOD_SYNTHETIC_SAMPLES": str(SAMPLES),
            "TRAINPOD_EPOCHS": str(steps // STEPS_PER_EPOCH), "TRAINPOD_RECOVERY": recovery,
            "TRAINPOD_FAILPOINTS": ",".join([*([f"pace@{round(STEP_S * 1000)}"] if paced else []),
                                             *(f"{CHECKPOINT_WRITE}@{step}" for step in failpoints)])}


def new_job(out: Path, warm: str, env: dict[str, str], settings: dict[str, str] | None = None) -> ComposeJob:
    """The compose job with the low timers (and `settings`): an overlay written to `out` (JSON is YAML)."""
    settings = {"TRAINPOD_REJOIN_TIMEOUT": str(REJOIN_S), "TRAINPOD_HANG_TIMEOUT": str(HANG_S), "TRAINPOD_WARM_START": warm,
                **(settings or {})}
    out.mkdir(parents=True, exist_ok=True)
    overlay = out / "soak.compose.yaml"
    overlay.write_text(json.dumps({"services": {node: {"environment": settings} for node in NODES}}, indent=2))
    return ComposeJob(COMPOSE, env=env, overrides=(FAULTS_OVERLAY, overlay), project=f"tp-soak-{uuid.uuid4().hex[:8]}")


def plan_steps(minutes: float) -> int:
    """The job's steps for about `minutes` of training: whole epochs, at least 4."""
    return STEPS_PER_EPOCH * max(4, math.ceil(minutes * 60 / STEP_S / STEPS_PER_EPOCH))


def plan_failpoints(steps: int) -> list[int]:
    """The checkpoint writes killed: the first checkpoint after FIRST_FAULT_STEP (every run's first fault), then one
    every FAILPOINT_EVERY_MIN minutes of steps, none in the last 3 SETTLE_S."""
    every = CHECKPOINT_EVERY * round(FAILPOINT_EVERY_MIN * 60 / STEP_S / CHECKPOINT_EVERY)
    return list(range(FIRST_FAULT_STEP + CHECKPOINT_EVERY, int(steps - 3 * SETTLE_S / STEP_S), every))


def finish(job: ComposeJob, out: Path, result: Result, timeout: float) -> None:
    """Each node's exit code (killed after `timeout`), metrics, logs kept in `out`; the job torn down."""
    deadline = time.monotonic() + timeout
    try:
        for node in NODES:
            try:
                result.codes[node] = job.exit_code(node, timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                result.problems.append(f"{node} still running {timeout:.0f} s later: killed")
                job.compose("kill", check=False)
                result.codes[node] = job.exit_code(node, timeout=60)
        if result.codes != {"node0": 0, "node1": 0}:
            return  # no metrics to read; the logs say why
        try:
            metrics = job.metrics()
            result.checksum = metrics["checksum"]
            if len(set(metrics["rank_checksums"])) != 1:
                result.problems.append(f"the ranks' checksums differ: {metrics['rank_checksums']}")
            if metrics["steps"] != result.steps:
                result.problems.append(f"{metrics['steps']} steps, not {result.steps}")
        except AssertionError as error:
            result.problems.append(str(error).splitlines()[0])
    finally:
        for node in NODES:
            (out / f"{node}.log").write_text(job.compose("logs", "--timestamps", "--no-color", node, check=False).stdout)
        job.down()


def reference_run(steps: int, subnet: str | None, out: Path) -> str:
    """The uninterrupted run's checksum (same steps, no faults). Unpaced: a pace changes when a step runs, not what it
    computes, and the reference has no schedule to keep."""
    result = Result("reference", steps)
    job = new_job(out, "on", job_env(steps, subnet, "restart", [], paced=False))
    started = time.monotonic()
    job.up()
    finish(job, out, result, timeout=steps * STEP_S * 4 + 600)
    if result.codes != {"node0": 0, "node1": 0} or result.problems or not result.checksum:
        raise SoakFailure(f"the reference run failed: exit {result.codes}, {result.problems}; logs in {out}")
    print(f"soak reference: {steps} steps, {(time.monotonic() - started) / 60:.1f} min, checksum {result.checksum} "
          "(--reference reuses it)", flush=True)
    return result.checksum


# --- the faulted run ---


class Driver:
    """One configuration's faulted run: waits on rank 0's lines, injects the faults, watches the clean stretches."""

    def __init__(self, logs: Logs, result: Result, failpoints: list[int], cycle, rng: random.Random, max_faults: float):
        self.logs, self.result, self.rng, self.max_faults = logs, result, rng, max_faults
        self.pending = sorted(failpoints)  # armed checkpoint-write failpoints not fired yet
        self.cycle = itertools.cycle(cycle)
        self.clean_from: float | None = None  # a clean stretch runs from here (None: a fault is on)

    def wait(self, what: str, ready, timeout: float):
        """Until ready() is truthy. Fails at `timeout`, on trouble in a clean stretch, and when a node exits before
        the job's metrics line (a node killed and started is running again when inject() returns)."""
        deadline, checked = time.monotonic() + timeout, 0.0
        while not (value := ready()):
            self.check_clean(math.inf)
            now = time.monotonic()
            if now > deadline:
                raise SoakFailure(f"no {what} within {timeout:.0f} s")
            if now - checked > 2:
                checked = now
                for node in NODES:
                    running, _, code = self.logs.state(node)
                    if not running and self.logs.metrics_at is None:
                        self.check_clean(math.inf)  # the lines that say why, if it happened in a clean stretch
                        raise SoakFailure(f"{node} exited {code} while waiting for {what}")
            time.sleep(0.05)
        return value

    def check_clean(self, end: float) -> None:
        """No trouble from the start of the clean stretch to `end`."""
        if self.clean_from is None or not (trouble := self.logs.trouble(self.clean_from, end)):
            return
        last = self.result.faults[-1] if self.result.faults else None
        if last is None:
            after = "before any fault"
        elif last.recovered is None:
            after = f"during fault {len(self.result.faults)} ({last.kind})"
        else:
            after = f"{trouble[0].at - last.recovered:.1f} s after fault {len(self.result.faults)}'s recovery"
        lines = "\n    ".join(f"{datetime.datetime.fromtimestamp(line.at):%H:%M:%S.%f} {line.text}" for line in trouble[:12])
        raise SoakFailure(f"trouble no fault caused, {after}:\n    {lines}")

    def end_clean(self, end: float) -> None:
        """The clean stretch ends at `end` (a fault, the job's end): it was clean, and lasted SETTLE_S."""
        self.check_clean(end)
        self.clean_from = None
        if self.result.faults:
            last = self.result.faults[-1]
            last.clean_s = end - last.recovered
            if last.clean_s < SETTLE_S:
                what = "the job ended" if end == self.logs.metrics_at else "the next fault (a failpoint) came"
                raise SoakFailure(f"{what} {last.clean_s:.1f} s after fault {len(self.result.faults)}'s recovery, "
                                  f"under {SETTLE_S} s: the schedule misjudged the steps")

    def run(self) -> None:
        logs = self.logs
        self.wait(f"step {FIRST_FAULT_STEP}", lambda: logs.steps and logs.steps[-1][1] >= FIRST_FAULT_STEP, RECOVERY_TIMEOUT_S * 2)
        self.clean_from = logs.steps[-1][0]
        while True:
            if self.result.faults:  # the clean stretch: until a step line SETTLE_S after the recovery (or the job's end)
                settled = self.result.faults[-1].recovered + SETTLE_S
                self.wait(f"a step {SETTLE_S} s after fault {len(self.result.faults)}'s recovery",
                          lambda settled=settled: logs.metrics_at or self._fired() or logs.steps[-1][0] >= settled,
                          SETTLE_S * 10 + RECOVERY_TIMEOUT_S)
            step = logs.steps[-1][1]
            ahead = 1.5 * logs.rate() * SETTLE_S  # steps trained in 1.5 clean stretches
            fired = self._fired()
            last_ones = len(self.result.faults) >= self.max_faults
            if logs.metrics_at is None and fired is None and self.pending and (self.pending[0] - step < ahead or last_ones):
                fired = self.wait(f"the failpoint {CHECKPOINT_WRITE}@{self.pending[0]}", self._fired, RECOVERY_TIMEOUT_S)
            if fired is not None:
                self.end_clean(fired[0])
                fault = Fault(CHECKPOINT_WRITE, f"rank 0 at step {fired[1]}", fired[0], fired[0])
                self.pending.remove(fired[1])
            elif logs.metrics_at is not None or logs.total - step < ahead or last_ones:
                break
            else:
                self.end_clean(time.time())
                fault = self.inject(next(self.cycle))
            fault.step = max((s for at, s in list(logs.steps) if at < fault.start), default=0)
            self.result.faults.append(fault)
            self.recover(fault)
            self.clean_from = fault.recovered + GRACE_S
            print(f"  {time.strftime('%H:%M:%S')} {self.result.config} fault {len(self.result.faults)}: {fault.kind} "
                  f"({fault.what}) at step {fault.step}: back in {fault.recovery_s:.1f} s, "
                  f"{len(fault.resumes)} resume(s), {fault.lost} steps lost", flush=True)
        self.wait("the metrics line", lambda: logs.metrics_at, logs.total * STEP_S * 4 + RECOVERY_TIMEOUT_S)
        self.end_clean(logs.metrics_at)

    def _fired(self) -> tuple[float, int] | None:
        """A failpoint line not yet taken as a fault."""
        taken = sum(f.kind == CHECKPOINT_WRITE for f in self.result.faults)
        fired = list(self.logs.failpoints)
        return fired[taken] if len(fired) > taken else None

    def inject(self, kind: str) -> Fault:
        if kind == "kill-node1":
            container = self.logs.containers["node1"]
            start = time.time()
            run("docker", "kill", container)
            hit = time.time()
            run("docker", "start", container)
            return Fault(kind, "node1's container killed and started", start, hit)
        node = {"kill-rank-node0": "node0", "kill-rank-node1": "node1"}.get(kind) or self.rng.choice(NODES)
        rank = self.rng.choice(RANKS[node])
        start = time.time()
        pid = self._signal(node, rank, f"$({find_rank(rank)})", "STOP" if kind == "sigstop" else "KILL")
        if kind != "sigstop":
            return Fault(kind, f"rank {rank}, pid {pid}", start, time.time())
        time.sleep(STOP_S)
        self._signal(node, rank, pid, "CONT")
        return Fault(kind, f"rank {rank}, pid {pid}, {STOP_S} s", start, time.time())

    def _signal(self, node: str, rank: int, pids: str, signal: str) -> str:
        """Send `signal` to the one process `pids` expands to in `node`'s container; its pid."""
        script = f'set -- {pids}; [ $# -eq 1 ] || {{ echo "pids of rank {rank}: $*" >&2; exit 1; }}; kill -{signal} $1 && echo $1'
        done = run("docker", "exec", self.logs.containers[node], "sh", "-c", script, check=False)
        if done.returncode:
            raise SoakFailure(f"SIG{signal} of rank {rank} on {node}: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout.strip()

    def recover(self, fault: Fault) -> None:
        """Until rank 0's first step after the fault: after its resume, or, after a SIGSTOP, with no trouble at all."""
        logs = self.logs
        if fault.kind == "sigstop":  # it must cost nothing: a clean stretch goes on through it
            self.clean_from = fault.start

        def back():
            if fault.kind == "sigstop":
                return logs.step_after(fault.hit)
            resumed = next((at for at, _ in list(logs.resumes) if at > fault.start), None)
            return None if resumed is None else logs.step_after(resumed)

        fault.recovered, _ = self.wait(f"rank 0's step after fault {len(self.result.faults)} ({fault.kind})", back,
                                       RECOVERY_TIMEOUT_S)
        self.check_clean(fault.recovered)
        steps = list(logs.steps)
        for resumed_at, resumed in [r for r in list(logs.resumes) if fault.start < r[0] < fault.recovered]:
            before = [s for t, s in steps if t < resumed_at]
            fault.resumes.append((before[-1] if before else 0, resumed))


def soak_config(config: Config, minutes: float, reference: str, subnet: str | None, out: Path, cycle=CYCLE, max_faults=math.inf,
                seed: int = 29, settings: dict[str, str] | None = None) -> Result:
    steps = plan_steps(minutes)
    failpoints = plan_failpoints(steps)
    result = Result(config.name, steps, reference=reference)
    job = new_job(out, config.warm, job_env(steps, subnet, config.recovery, failpoints), settings)
    started = time.monotonic()
    job.up()
    logs = Logs(job)
    try:
        Driver(logs, result, failpoints, cycle, random.Random(seed), max_faults).run()
    except SoakFailure as failure:
        result.problems.append(str(failure))
    finally:
        logs.close()
        finish(job, out, result, timeout=600 if not result.problems else 30)
        result.minutes = (time.monotonic() - started) / 60
    return result


def soak(minutes: float, configs: list[Config], out: Path, reference: str | None = None, subnet: str | None = None,
         cycle=CYCLE, max_faults=math.inf, settings: dict[str, str] | None = None) -> list[Result]:
    """The reference run (unless given), then each configuration (its nodes with `settings` too); one line each."""
    steps = plan_steps(minutes)
    if reference is None:
        reference = reference_run(steps, subnet, out / "reference")
    results = []
    for config in configs:
        result = soak_config(config, minutes, reference, subnet, out / config.name.replace("/", "-"), cycle, max_faults,
                             settings=settings)
        print(result.line(), flush=True)
        results.append(result)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30, help="each faulted job's length in training time (default 30)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)} (default: all)")
    parser.add_argument("--reference", help="the uninterrupted run's checksum for these --minutes (skips the reference run)")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "soak" / time.strftime("%Y%m%d-%H%M%S"))
    parser.add_argument("--subnet", help="the compose network's first three octets (default: a free one)")
    args = parser.parse_args()
    unknown = [name for name in args.configs.split(",") if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}: expected {', '.join(CONFIGS)}")
    configs = [CONFIGS[name] for name in args.configs.split(",")]
    steps = plan_steps(args.minutes)
    print(f"soak: {len(configs)} configuration(s) of {steps} steps (about {args.minutes:g} min each"
          f"{'' if args.reference else ', and the uninterrupted reference run'}), failpoints at "
          f"{plan_failpoints(steps)}; logs in {args.out}", flush=True)
    try:
        results = soak(args.minutes, configs, args.out, args.reference, args.subnet)
    except SoakFailure as failure:
        print(f"soak: {failure}", file=sys.stderr)
        return 1
    if len(results) > 1:
        print("\nsoak, every configuration:\n" + "\n".join(result.line() for result in results))
    ok = all(result.ok for result in results)
    if ok:
        results_page.record("soak", "\n".join(result.line() for result in results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
