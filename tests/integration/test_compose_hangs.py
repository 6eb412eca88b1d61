"""The hang cases in the 2-node compose job (compose/pai-2node, 4 ranks, --hang-timeout 10): the rank
behind is on node1 (ranks 2 and 3; node0 holds 0 and 1), so node0's agent, whose ranks only wait,
learns from the rendezvous store which rank is behind. Each node's agent names it in one line
within the timeout + 15 s and writes its own ranks' stacks to the shared output volume; the
job ends with 124 (a rank asleep before init_process_group, a skipped collective) or recovers from
its checkpoint with the weights of an uninterrupted run (a SIGSTOPped rank)."""

import re
import time

import pytest
from test_faults import CHECKPOINTS, COMPOSE, FAULTS, NODES, STEPS, Follower, in_volume
from test_hangs import STOPPED_AT

from fixtures.docker_env import REPO, ComposeJob, find_rank

# One worker runs the module (make test: pytest-xdist, --dist loadgroup): its jobs one after another.
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.xdist_group("compose_hangs")]

HANGS = REPO / "tests" / "integration" / "compose" / "pai-2node-hangs.yaml"
HANG_JOB = REPO / "tests" / "integration" / "compose" / "pai-2node-hang-job.yaml"
SCRIPTS = str(REPO / "tests" / "integration" / "hangs")
TIMEOUT = 10
MARK = re.compile(r"hang-job: rank (\d+) hang starts.* at ([0-9.]+)")
STACKS = re.compile(r"stacks in (\S+)$")


def hang_line(job: ComposeJob, node: str) -> str:
    lines = [line for line in job.logs(node).splitlines() if f"[{node}] trainpod: hang: " in line]
    assert len(lines) == 1, job.logs(node)[-3000:]
    return lines[0]


def stacks_written(job: ComposeJob, line: str, ranks: tuple[int, ...]) -> str:
    directory = STACKS.search(line).group(1)
    listing = in_volume(job, f"import os; print(sorted(os.listdir('{directory}')))")
    assert listing.strip() == str(sorted([f"rank{r}.txt" for r in ranks] + ["hang.json"])), listing
    return directory


def timestamps(job: ComposeJob, node: str, pattern: str) -> list[float]:
    """Docker's arrival time (UTC, seconds) of each line of `node` that contains `pattern`."""
    out = job.compose("logs", "--timestamps", "--no-color", "--no-log-prefix", node).stdout
    stamps = []
    for line in out.splitlines():
        if pattern in line:
            stamp = line.split()[0]  # 2026-11-23T00:36:12.305123456Z
            stamps.append(time.mktime(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone + float("0." + stamp[20:29]))
    return stamps


def within_the_bound(job: ComposeJob, started: float) -> None:
    for node in NODES:
        [reported] = timestamps(job, node, "trainpod: hang: ")
        assert reported - started <= TIMEOUT + 15, (node, reported - started)


@pytest.fixture
def hang_job(docker_ready, tmp_path):
    jobs = []

    def make(args: str) -> ComposeJob:
        job = ComposeJob(COMPOSE, env={"TRAINPOD_HANG_SCRIPTS": SCRIPTS, "HANG_ARGS": args}, overrides=(HANGS, HANG_JOB))
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        for node in NODES:
            (tmp_path / f"{node}.log").write_text(job.compose("logs", "--timestamps", "--no-color", node, check=False).stdout)
        job.down()


def test_a_rank_asleep_before_init_on_node1_is_named_by_both_nodes_and_the_job_ends_124(hang_job):
    job = hang_job("sleep-before-init --rank 3")
    job.up()
    assert job.wait(*NODES, timeout=300) == {"node0": 124, "node1": 124}, job.logs("node0")[-3000:] + job.logs("node1")[-3000:]
    node0, node1 = hang_line(job, "node0"), hang_line(job, "node1")
    assert "behind: rank 3 on node1 idle (no CPU, same stack) at hangs/hang_job.py:" in node0, node0
    assert "ranks 0, 1, 2 wait for it in init_process_group" in node0
    assert "behind: rank 3 idle (no CPU, same stack) at hangs/hang_job.py:" in node1, node1
    [started] = [float(m.group(2)) for m in MARK.finditer(job.logs("node1"))]
    within_the_bound(job, started)
    stacks_written(job, node0, (0, 1))
    directory = stacks_written(job, node1, (2, 3))
    assert "init_process_group" in in_volume(job, f"print(open('{directory}/rank2.txt').read())")


def test_a_collective_skipped_on_node1_is_named_by_both_nodes_and_the_job_ends_124(hang_job):
    job = hang_job("skip --rank 3 --at 3")
    job.up()
    assert job.wait(*NODES, timeout=300) == {"node0": 124, "node1": 124}, job.logs("node0")[-3000:] + job.logs("node1")[-3000:]
    for node in NODES:
        line = hang_line(job, node)
        assert "the ranks wait in different collectives (ranks 0, 1, 2 in all_reduce at hangs/hang_job.py:" in line, line
        assert "rank 3 in barrier at hangs/hang_job.py:" in line
        assert line.split("; stacks in")[0].endswith("out of step: rank 3" + (" on node1" if node == "node0" else "") + " (step 6)")
    [started] = [float(m.group(2)) for m in MARK.finditer(job.logs("node1"))]
    within_the_bound(job, started)


@pytest.fixture
def example_job(docker_ready, tmp_path):
    def make() -> ComposeJob:
        return ComposeJob(COMPOSE, env={"TRAINPOD_HANG_SCRIPTS": SCRIPTS},
                          overrides=(FAULTS, HANGS))
    return make


def finish(job: ComposeJob) -> dict:
    assert job.wait(*NODES, timeout=400) == {"node0": 0, "node1": 0}, job.logs("node0")[-4000:] + job.logs("node1")[-4000:]
    return job.metrics()


def stop_rank(job: ComposeJob, rank: int) -> float:
    """SIGSTOP the process of global rank `rank` on node1 (fixtures.docker_env.find_rank); when it was sent."""
    find = find_rank(rank)
    [pid] = job.compose("exec", "-T", "node1", "sh", "-c", find).stdout.split()
    job.compose("exec", "-T", "node1", "kill", "-STOP", pid)
    return time.time()


def test_a_sigstopped_rank_on_node1_is_named_killed_and_the_job_resumes_bit_identical(example_job, tmp_path):
    reference = example_job()
    try:
        reference.up()
        expected = finish(reference)
    finally:
        reference.down()
    assert expected["steps"] == STEPS

    job = example_job()
    try:
        job.up()
        follower = Follower(job)
        try:
            follower.wait_for_step(10, resumes=0)
        finally:
            follower.close()
        stopped_at = stop_rank(job, 2)
        metrics = finish(job)
        node0, node1 = hang_line(job, "node0"), hang_line(job, "node1")
        assert re.search(rf"behind: rank 2 on node1 stopped at {STOPPED_AT}, step \d+; ranks 0, 1, 3 wait for it", node0), node0
        assert re.search(rf"behind: rank 2 stopped at {STOPPED_AT}", node1), node1
        within_the_bound(job, stopped_at)
        stacks_written(job, node1, (2, 3))
        assert "resumed from the checkpoint of step" in job.logs("node0")
        assert metrics["checksum"] == expected["checksum"] and len(set(metrics["rank_checksums"])) == 1
        assert in_volume(job, f"import os; print(len(os.listdir('{CHECKPOINTS}')) > 0)").strip() == "True"
    finally:
        for node in NODES:
            (tmp_path / f"{node}.log").write_text(job.compose("logs", "--timestamps", "--no-color", node, check=False).stdout)
        job.down()
