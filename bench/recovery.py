"""Recovery time after SIGKILL of one rank, trainpod run vs bare torchrun --max-restarts (run by bench/run.py).

The three variants run the same CIFAR-10 example job (2 processes, synthetic data, checkpoints) on
this host, no Docker: `trainpod run` with its default supervision and restart backoff (the agent
restarts the worker group), `trainpod run --recovery in-process` (the survivor keeps its process and
re-forms the group with a replacement forked by the dead rank's keeper: trainpod.agent.keeper), and bare
`torchrun --max-restarts 3`, which restarts its workers inside its own agent. Once a chosen
checkpoint is on disk, one rank (a seeded choice, the same for both variants in a round) gets
SIGKILL; recovery is the time from the kill to the end of the first step after the "resumed from the
checkpoint" line, as rank 0 recorded it (the time in its progress record, trainpod.train.progress, which
the example writes as each step ends; bare torchrun's job gets a progress directory of its own for it).
Every output line is timestamped on arrival, and the process tree is sampled meanwhile, so that the time
can be split into phases. A line arrives when the job's output carries it here, later than the step: under
trainpod, torch's tee reads the ranks' log files every 0.1 s, while bare torchrun's ranks write to the
terminal directly; the step's line is what tells which step to look up, and its arrival is kept beside
(`shown_s`), the figure where a record is missing. Variants alternate over the
rounds; medians are reported. A recovery that hangs (no step within RECOVERY_TIMEOUT_S) or a job
that exits non-zero counts as a failed recovery and is reported as such; every job that recovers
(whichever rank died, whenever) must exit 0 with the same weights checksum.

    python3 bench/recovery.py [--rounds N] [--timeline] [--env NAME=VALUE ...]

--timeline also prints, for each variant's median run, every event and line between the kill
and the first step after it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import results_page

HERE = Path(__file__).resolve().parent
ENTRYPOINT = HERE.parent / "entrypoint"
sys.path.insert(0, str(HERE.parent / "tests"))

from fixtures.ports import free_port  # noqa: E402
from trainpod.contract import PROGRESS_DIR_VAR  # noqa: E402

ROUNDS = 3
SEED = 3  # 3 rounds: kills after checkpoints 40, 80, 120, of ranks 0, 1, 0
NPROC = 2
MAX_RESTARTS = 3
# 4 epochs of 2048 samples per rank in batches of 32: 256 steps, so a kill lands mid-run.
ARGS = ["--epochs", "4", "--synthetic-samples", "4096", "--batch-size", "32", "--checkpoint-every", "5", "--log-every", "1"]
KILL_AFTER = (40, 80, 120)  # the checkpoint steps a kill may follow
OMP_THREADS = "1"  # the same for both (bare torchrun would force 1 anyway)
JOB_TIMEOUT_S = 600
RECOVERY_TIMEOUT_S = 120  # no step this long after the kill: a failed recovery (counted, the job killed)
SAMPLE_S = 0.02  # process tree sampling period during recovery
STEP_POLL_S = 0.005  # how often rank 0's progress record is read: well within a step, so that no step's record is missed

STEP_LINE = re.compile(r"epoch \d+/\d+ step (\d+)/\d+")
RESUMED = re.compile(r"resumed from the checkpoint of step (\d+)")
REFORMED = "the group re-formed in-process"  # a survivor's line (trainpod.examples.harness)


def _create_time_offset() -> float:
    """What to subtract from psutil's create_time() to get time.monotonic().

    create_time() is the boot time, which /proc gives in whole seconds, plus the start in clock
    ticks: off from time.time() by up to a second. Calibrated on children whose start is known.
    """
    samples = []
    for _ in range(5):
        before = time.monotonic()
        child = subprocess.Popen(["sleep", "0.05"])
        samples.append(psutil.Process(child.pid).create_time() - before)
        child.wait()
    return statistics.median(samples)


CREATE_TO_MONO = 0.0  # set by bench()


def command(variant: str, port: int, out: Path) -> list[str]:
    job = [*ARGS, "--output-dir", str(out / "output"), "--checkpoint-dir", str(out / "ckpt")]
    if variant in ("trainpod", "in-process"):  # supervised, default --restart-backoff
        return [sys.executable, "-m", "trainpod", "run", "--nproc-per-node", str(NPROC), "--master-port", str(port),
                "--max-restarts", str(MAX_RESTARTS), "--recovery", "in-process" if variant == "in-process" else "restart",
                "--example", "cifar10-ddp", "--", *job]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC), "--master-port", str(port),
            "--max-restarts", str(MAX_RESTARTS), "-m", "trainpod.examples.cifar10", *job]


VARIANTS = ("trainpod", "in-process", "torchrun")
EXTRA_ENV: dict[str, str] = {}  # --env, for every variant alike


def environment(variant: str, out: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "PET_", "PAI_"))}
    pythonpath = [str(ENTRYPOINT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    # trainpod's agent gives its ranks a progress directory; bare torchrun's job gets one here, so that its steps are
    # timed as trainpod's are (the example reports where the variable is set, whoever set it).
    progress = {}
    if variant == "torchrun":
        (out / "progress").mkdir(exist_ok=True)
        progress[PROGRESS_DIR_VAR] = str(out / "progress")
    return {**env, "PYTHONPATH": os.pathsep.join(pythonpath), "OMP_NUM_THREADS": OMP_THREADS, **progress, **EXTRA_ENV}


class StepTimes:
    """When rank 0 ended each step after `since` (a time.time()), from its progress record (one fixed-width line it
    rewrites at each step's end, with its time.time()), read every STEP_POLL_S from a thread. A step ended twice (one
    that ended as the kill came, trained again after the resume) keeps its later end."""

    def __init__(self, record: Path):
        self.record, self.since, self.ended = record, float("inf"), {}  # step -> time.time() at its end
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = self.record.read_bytes().split()
                if float(fields[2]) >= self.since:
                    self.ended[int(fields[0])] = float(fields[2])
            self._stop.wait(STEP_POLL_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def kind_of(process: psutil.Process) -> str | None:
    """What a process of the job's tree is, by its command line (and a worker by its environment)."""
    try:
        if process.name().startswith("rank"):  # a warm rank (trainpod.agent.warm): the fork server's command line
            return f"worker rank {process.name()[4:]}"
        cmdline = " ".join(process.cmdline())
        if "trainpod.examples.cifar10" in cmdline and "torch.distributed.run" not in cmdline \
                and "trainpod.agent" not in cmdline and "LOCAL_RANK" in process.environ():
            return f"worker rank {process.environ().get('RANK')}"
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    for marker, kind in (("trainpod-keeper", "keeper"), ("trainpod.supervisor.job", "agent"),  # the job becomes the agent
                         ("trainpod.agent", "agent"), ("torch.distributed.run", "agent"),
                         ("trainpod.supervisor.supervisord", "supervisord"),
                         ("trainpod.supervisor.supervise", "policy"), ("-m trainpod run", "trainpod run")):
        if marker in cmdline:
            return kind
    return cmdline[:40] or None


def workers(root: psutil.Process) -> dict[int, psutil.Process]:
    """RANK -> worker process, among root's descendants."""
    found = {}
    for child in root.children(recursive=True):
        kind = kind_of(child)
        if kind and kind.startswith("worker rank "):
            found[int(kind.split()[-1])] = child
    return found


class Job:
    """One run: the process, its output lines timestamped on arrival, and process tree samples."""

    def __init__(self, variant: str, out: Path):
        self.variant, self.out = variant, out
        self.lines: list[tuple[float, str]] = []
        self.process = subprocess.Popen(command(variant, free_port(), out), env=environment(variant, out), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, bufsize=0)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.events: list[tuple[float, str]] = []
        self.cpu: dict[int, list] = {}  # pid -> [kind, CPU seconds at its first sample, at its last]

    def _read(self) -> None:
        for raw in iter(self.process.stdout.readline, b""):
            self.lines.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))

    def sample_tree(self, until: threading.Event) -> None:
        """Record when each process of the tree appears (its create time), changes kind (exec) or goes."""
        root = psutil.Process(self.process.pid)
        seen: dict[int, str] = {}
        started: dict[int, int] = {}  # pid -> index of its "started" event
        first = True
        while not until.is_set():
            now = time.monotonic()
            try:
                current = {p.pid: p for p in [root, *root.children(recursive=True)]}
            except psutil.NoSuchProcess:
                break
            for pid, process in current.items():
                kind = kind_of(process)
                with contextlib.suppress(psutil.Error):
                    used = sum(process.cpu_times()[:2])
                    entry = self.cpu.setdefault(pid, [kind, 0.0 if pid not in seen and not first else used, used])
                    entry[0], entry[2] = kind or entry[0], used
                if kind is None or seen.get(pid) == kind:
                    continue
                if first:  # the tree before the kill: no events
                    pass
                elif pid not in seen:
                    try:
                        started[pid] = len(self.events)
                        self.events.append((process.create_time() - CREATE_TO_MONO, f"{kind} started (pid {pid})"))
                    except psutil.NoSuchProcess:
                        continue
                elif pid in started and kind.startswith("worker") and now - self.events[started[pid]][0] < 1.0:
                    # A worker caught between fork and exec, with its agent's command line.
                    self.events[started[pid]] = (self.events[started[pid]][0], f"{kind} started (pid {pid})")
                else:
                    self.events.append((now, f"pid {pid} became {kind} (exec; seen within {SAMPLE_S * 1e3:.0f} ms)"))
                seen[pid] = kind
            for pid in [pid for pid in seen if pid not in current]:
                self.events.append((now, f"{seen.pop(pid)} gone (pid {pid}; seen within {SAMPLE_S * 1e3:.0f} ms)"))
            first = False
            time.sleep(SAMPLE_S)

    def kill(self) -> None:
        """SIGKILL every process of the job's tree, by pid."""
        try:
            tree = [*psutil.Process(self.process.pid).children(recursive=True), psutil.Process(self.process.pid)]
        except psutil.NoSuchProcess:
            return
        for process in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()

    def finish(self, timeout: float = JOB_TIMEOUT_S) -> tuple[int, str]:
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.process.wait()
        self.reader.join(timeout=10)
        return self.process.returncode, "\n".join(line for _, line in self.lines)


def run_once(variant: str, after_step: int, victim_rank: int) -> dict:
    """One job, one kill. A recovery that fails (no step within RECOVERY_TIMEOUT_S, a non-zero exit)
    comes back with "failure" set: the bench counts it instead of stopping."""
    out = Path(tempfile.mkdtemp(prefix=f"trainpod-bench-recovery-{variant}-"))
    try:
        job = Job(variant, out)
        manifest = out / "ckpt" / f"ckpt-{after_step:08d}.json"
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not manifest.exists():
            if job.process.poll() is not None or time.monotonic() > deadline:
                code, log = job.finish(timeout=0)
                sys.exit(f"bench-recovery: {variant} ended ({code}) before checkpoint {after_step}:\n{log[-3000:]}")
            time.sleep(0.01)
        ranks = workers(psutil.Process(job.process.pid))
        if sorted(ranks) != list(range(NPROC)):
            job.kill()
            sys.exit(f"bench-recovery: {variant}: expected ranks 0..{NPROC - 1}, found {sorted(ranks)}")
        record = next((Path(f.path) for f in ranks[0].open_files() if Path(f.path).name == "rank0"), None)
        if record is None:  # it holds its record open from its first step on (trainpod.train.progress)
            job.kill()
            sys.exit(f"bench-recovery: {variant}: rank 0 holds no progress record open (<{PROGRESS_DIR_VAR}>/rank0)")
        steps = StepTimes(record)
        sampled = threading.Event()
        sampler = threading.Thread(target=job.sample_tree, args=(sampled,), daemon=True)
        sampler.start()
        time.sleep(2 * SAMPLE_S)  # the tree as it is before the kill
        ranks[victim_rank].send_signal(signal.SIGKILL)
        t_kill, wall_kill = time.monotonic(), time.time()
        steps.since = wall_kill

        resumed_at = first_step_at = reformed_at = None
        resumed_step = first_step = None
        give_up = t_kill + RECOVERY_TIMEOUT_S
        while first_step_at is None and time.monotonic() < give_up and job.process.poll() is None:
            for at, line in list(job.lines):
                if at < t_kill:
                    continue
                if reformed_at is None and REFORMED in line:
                    reformed_at = at
                if resumed_at is None and (m := RESUMED.search(line)):
                    resumed_at, resumed_step = at, int(m.group(1))
                elif resumed_at is not None and at >= resumed_at and (m := STEP_LINE.search(line)):
                    first_step_at, first_step = at, int(m.group(1))
                    break
            time.sleep(0.01)
        sampled.set()
        sampler.join()
        steps.stop()
        hung = first_step_at is None and job.process.poll() is None
        code, log = job.finish(timeout=0 if hung else JOB_TIMEOUT_S)
        result = {"variant": variant, "after_step": after_step, "victim_rank": victim_rank, "failure": None}
        if first_step_at is None or code != 0:
            events = "\n".join(f"  {at - t_kill:+7.3f} {text}" for at, text in job.events)
            if hung:
                result["failure"] = f"no step within {RECOVERY_TIMEOUT_S}s of the kill (job killed)"
            elif first_step_at is None:
                result["failure"] = f"exited {code} without a step after a resume"
            else:
                result["failure"] = f"recovered, then exited {code}"
            print(f"bench-recovery: {variant}: {result['failure']}; killed rank {victim_rank} after checkpoint {after_step}"
                  f"\nprocess events:\n{events}\nlog:\n{log[-3000:]}\n", file=sys.stderr, flush=True)
            return result
        metrics = json.loads((out / "output" / "metrics.json").read_text())
        timeline = sorted([(at - t_kill, f"| {line}") for at, line in job.lines if t_kill <= at <= first_step_at]
                          + [(at - t_kill, f"* {event}") for at, event in job.events if at >= t_kill - 1.0]
                          + [(ended - wall_kill, f"* rank 0 recorded the end of step {step}")
                             for step, ended in steps.ended.items() if step <= first_step])
        cpu: dict[str, float] = {}
        for kind, first_seen, last_seen in job.cpu.values():
            kind = "workers" if kind and kind.startswith("worker") else kind or "other"
            cpu[kind] = cpu.get(kind, 0.0) + last_seen - first_seen
        timeline.append((first_step_at - t_kill, "* CPU seconds used meanwhile: "
                         + ", ".join(f"{kind} {seconds:.2f}" for kind, seconds in sorted(cpu.items()) if seconds >= 0.005)))
        starts = [at for at, event in job.events
                  if t_kill <= at <= resumed_at and event.startswith("worker rank") and "started" in event]
        return {
            **result,
            "resumed_step": resumed_step, "first_step": first_step,
            # The step's end as rank 0 recorded it, where its record was read (STEP_POLL_S: always, unless the host
            # starved this process for a whole step); else its line's arrival.
            "recovery_s": steps.ended[first_step] - wall_kill if first_step in steps.ended else first_step_at - t_kill,
            "shown_s": first_step_at - t_kill, "step_recorded": first_step in steps.ended,
            "to_workers_s": (max(starts) - t_kill) if starts else None,
            "to_resumed_s": resumed_at - t_kill,
            **({"to_reformed_s": reformed_at - t_kill} if reformed_at is not None else {}),
            # > 1: a restarted worker group failed and was restarted again (in-process: 1 is the replacement)
            "group_starts": -(-len(starts) // NPROC),
            # What the whole job's tree used from the kill to that step: on a host with fewer cores than ranks the
            # recovery's time is this shared by the cores, so this per rank is what says whether the work grows with
            # the world (bench/recovery_scale.py).
            "cpu_s": sum(cpu.values()),
            "checksum": metrics["checksum"], "rank_checksums_agree": len(set(metrics["rank_checksums"])) == 1,
            "step_s": metrics["global_batch_size"] / metrics["samples_per_sec"],  # the job's steady step
            "timeline": timeline,
        }
    finally:
        shutil.rmtree(out, ignore_errors=True)


def bench(rounds: int) -> dict:
    global CREATE_TO_MONO
    CREATE_TO_MONO = _create_time_offset()
    rng = random.Random(SEED)
    variants = VARIANTS
    runs: dict[str, list[dict]] = {variant: [] for variant in variants}
    for round_ in range(rounds):
        after_step, victim = rng.choice(KILL_AFTER), rng.randrange(NPROC)
        order = variants if round_ % 2 == 0 else variants[::-1]
        for variant in order:
            result = run_once(variant, after_step, victim)
            runs[variant].append(result)
            outcome = result["failure"] or (
                f"resumed from {result['resumed_step']}, next step {result['first_step']} {result['recovery_s']:.2f} s "
                f"after the kill" + (f" ({result['group_starts']} worker group starts)" if result["group_starts"] > 1 else ""))
            print(f"  round {round_ + 1} {variant:<10} kill rank {victim} after checkpoint {after_step}: {outcome}",
                  file=sys.stderr, flush=True)
    ok = {variant: [r for r in results if not r["failure"]] for variant, results in runs.items()}
    checksums = {r["checksum"] for results in ok.values() for r in results}
    median = statistics.median
    summary = {}
    for variant, results in ok.items():
        summary[variant] = {"runs": len(runs[variant]), "failed": len(runs[variant]) - len(results),
                            "failures": [r["failure"] for r in runs[variant] if r["failure"]]}
        if not results:
            continue
        by_recovery = sorted(results, key=lambda r: r["recovery_s"])
        summary[variant].update({
            "recovery_s": median(r["recovery_s"] for r in results),
            "to_workers_s": median(r["to_workers_s"] for r in results if r["to_workers_s"] is not None),
            "to_resumed_s": median(r["to_resumed_s"] for r in results),
            **({"to_reformed_s": median(r["to_reformed_s"] for r in results if "to_reformed_s" in r)}
               if any("to_reformed_s" in r for r in results) else {}),
            "runs_s": [r["recovery_s"] for r in results],
            "by_line": sum(not r["step_recorded"] for r in results),  # timed by the line's arrival: no record read
            # The runs whose first restarted worker group came up: the restart path itself, without
            # the failed attempts (torch's own restart bugs, timing dependent) mixed in.
            **({"first_group_recovery_s": median(r["recovery_s"] for r in results if r["group_starts"] == 1)}
               if any(r["group_starts"] == 1 for r in results) else {}),
            "group_starts": [r["group_starts"] for r in results],
            "median_timeline": by_recovery[len(by_recovery) // 2]["timeline"],
        })
    def ratio(variant: str) -> float | None:
        both = all("recovery_s" in summary[v] for v in (variant, "torchrun"))
        return summary[variant]["recovery_s"] / summary["torchrun"]["recovery_s"] if both else None

    return {
        "rounds": rounds,
        **{variant: summary[variant] for variant in variants},
        "ratio": ratio("trainpod"),
        "in_process_ratio": ratio("in-process"),
        "checksums_identical": len(checksums) == 1,
        "ranks_agree": all(r["rank_checksums_agree"] for results in ok.values() for r in results),
        "checksum": sorted(checksums)[0] if len(checksums) == 1 else sorted(checksums),
    }


def report(result: dict) -> str:
    t, i, b = result["trainpod"], result["in-process"], result["torchrun"]
    lines = [
        f"recovery from SIGKILL of one rank to the end of the next step as rank 0 recorded it (this host, {NPROC} "
        f"processes, CIFAR-10 example, median of {result['rounds']} alternating runs; the other phases: their lines' arrival)",
        f"  {'':30}{'trainpod run':>14}{'in-process':>12}{'bare torchrun':>15}{'ratios':>16}",
    ]

    def cell(summary: dict, key: str, width: int) -> str:
        return f"{summary[key]:>{width}.2f}" if key in summary else f"{'-':>{width}}"

    def ratio(summary: dict, key: str) -> str:
        return f"{summary[key] / b[key]:.3f}" if key in summary and key in b else "-"

    for key, label in (("to_workers_s", "kill to new workers (s)"), ("to_reformed_s", "kill to group re-formed (s)"),
                       ("to_resumed_s", "kill to resumed (s)"), ("recovery_s", "kill to next step (s)"),
                       ("first_group_recovery_s", "  the same, first restart held")):
        ratios = f"{ratio(t, key)} / {ratio(i, key)}"
        lines.append(f"  {label:30}{cell(t, key, 14)}{cell(i, key, 12)}{cell(b, key, 15)}{ratios:>16}")
    if result["ratio"] is not None:
        lines.append(f"  recovery ratio {result['ratio']:.3f} (goal <= 1.2), in-process "
                     + (f"{result['in_process_ratio']:.3f}" if result["in_process_ratio"] is not None else "-")
                     + " (goal: 0.3 s or less); runs: "
                     + "; ".join(f"{v} {', '.join(f'{x:.2f}' for x in result[v].get('runs_s', []))} s" for v in VARIANTS))
    for variant in VARIANTS:
        summary = result[variant]
        if summary["failed"]:
            lines.append(f"  {variant}: {summary['failed']} of {summary['runs']} recoveries FAILED: {'; '.join(summary['failures'])}")
        if summary.get("by_line"):
            lines.append(f"  {variant}: {summary['by_line']} of {summary['runs']} runs timed by their step's line, later than "
                         f"the step (rank 0's record of it not read)")
        if any(starts > 1 for starts in summary.get("group_starts", [])):
            lines.append(f"  {variant}: worker group starts until the resume, per run: {summary['group_starts']} "
                         "(more than 1: a restarted group failed too)")
    same = "identical" if result["checksums_identical"] and result["ranks_agree"] else "DIFFERENT"
    exited = "every recovered job exited 0" if any(result[v]["failed"] for v in VARIANTS) else "every job exited 0"
    lines.append(f"  {exited}; final checksums {same} across them: {str(result['checksum'])[:16]}...")
    return "\n".join(lines)


def timelines(result: dict) -> str:
    lines = []
    for variant in VARIANTS:
        if "median_timeline" not in result[variant]:
            continue
        lines.append(f"\n{variant}: the median run, seconds after the kill (* process tree, | output line)")
        for at, text in result[variant]["median_timeline"]:
            lines.append(f"  {at:+7.3f} {text[:160]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--timeline", action="store_true", help="print the median runs' events between kill and step")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an extra variable for both variants' jobs (a diagnosis: what would a setting change?)")
    args = parser.parse_args(argv)
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            parser.error(f"--env {item!r}: expected NAME=VALUE")
        EXTRA_ENV[name] = value
    result = bench(args.rounds)
    print(report(result))
    if args.timeline:
        print(timelines(result))
    print("bench-recovery: " + json.dumps(result), flush=True)
    # A failed recovery is a figure (reported above); no recovery at all, or different weights, is an error.
    ok = result["ratio"] is not None and result["checksums_identical"] and result["ranks_agree"]
    if ok:
        results_page.record("recovery", report(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
