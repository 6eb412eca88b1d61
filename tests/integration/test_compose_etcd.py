"""etcd under elastic jobs in containers: compose/elastic (3 etcd members, trainer nodes with --nnodes 2:3, a 45 s
last call), on the real engine. (Nodes lost and joining: test_compose_elastic.py; torch's `etcd` backend:
test_compose_torch_etcd.py.)

- etcd faults: one member killed: the job goes on unaffected; a second one (no quorum): each node
  says in one line that etcd is unreachable and exits 69, its supervisor restarts it (69 is
  retried); once both members are back the job meets again and finishes from the checkpoint. (Or it
  splits: the nodes' next attempts may read different generations of the job's rendezvous, as the
  first agent to see etcd back advances the generation of a rendezvous it could not close. That
  race ends the test as xfail, naming the generations.)
- Two jobs on one etcd at once (different rendezvous ids) train side by side, each at world 2.

A module of its own, beside test_compose_elastic's and test_compose_torch_etcd's: each runs its etcd cluster and its
tests one after another on one worker (make test: pytest-xdist, --dist loadgroup), and the three go side by side.
"""

from __future__ import annotations

import re
import time

import pytest

from fixtures.compose_elastic import (
    ETCD,
    LONGER_ARGS,
    STEP,
    TIMEOUT_S,
    TRAINERS,
    etcd_cluster,
    job_factory_for,
    wait_step,
    world_line,
)
from fixtures.docker_env import ComposeJob, run

# One worker runs the module: its etcd cluster, on a subnet of its own, is a module fixture that its tests share.
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.xdist_group("compose_etcd")]


@pytest.fixture(scope="module")
def cluster(docker_ready):
    yield from etcd_cluster()


@pytest.fixture
def job_factory(cluster, tmp_path):
    yield from job_factory_for(cluster, tmp_path)


def test_two_jobs_on_one_etcd_do_not_meet(job_factory):
    args = "--epochs 1 --synthetic-samples 4096 --log-every 1"
    a = job_factory("a", TRAINPOD_EXAMPLE_ARGS=args)
    b = job_factory("b", TRAINPOD_EXAMPLE_ARGS=args)
    a.up("trainer0", "trainer1")
    b.run("trainer2", "b0")
    b.run("trainer2", "b1")
    assert a.wait("trainer0", "trainer1") == {"trainer0": 0, "trainer1": 0}, a.tails()
    assert b.wait("b0", "b1") == {"b0": 0, "b1": 0}, b.tails()
    for job, nodes in ((a, ("trainer0", "trainer1")), (b, ("b0", "b1"))):
        assert job.metrics("trainer0")["world_size"] == 2, job.tails()
        for node in nodes:
            assert f"etcd-v3 rendezvous {job.id}.g0 " in job.text(node), job.tails()
        assert [s.world for s in job.segments()] == [2], job.tails()


def etcd_container(cluster: ComposeJob, member: str) -> str:
    return cluster.compose("ps", "-a", "-q", member).stdout.strip()


def test_etcd_losing_one_member_is_nothing_losing_quorum_ends_the_attempt_and_quorum_back_resumes(cluster, job_factory):
    job = job_factory("etcd-faults", pace_ms=250, TRAINPOD_EXAMPLE_ARGS=LONGER_ARGS)
    job.up(*TRAINERS)
    holder = job.rank0_at_step(3, 4)
    try:
        one_at = time.monotonic()
        run("docker", "kill", etcd_container(cluster, "etcd1"))
        # 20 more steps at world 3 and no failure anywhere: one member of three is nothing to the job.
        step = int(re.findall(STEP, job.text(holder))[-1])
        wait_step(job.follow[holder], step + 20, after=one_at)
        assert job.find(r"trainpod: (error|restarting|the job now has)", after=one_at) is None, job.tails()

        lost_at = time.monotonic()
        run("docker", "kill", etcd_container(cluster, "etcd2"))
        said = {}
        for trainer in TRAINERS:
            hit = job.follow[trainer].wait_for(r"trainpod: error: rendezvous at \S+ failed: .*etcd unreachable", TIMEOUT_S,
                                               after=lost_at)
            assert hit is not None, job.tails()
            said[trainer] = hit[0] - lost_at
        run("docker", "start", etcd_container(cluster, "etcd1"), etcd_container(cluster, "etcd2"))
        back_at = time.monotonic()
        # Each node's next attempt reads the job's generation once etcd answers again, and says where it meets;
        # a node that gave up first may have started it (and read etcd's old answer) while etcd came back.
        meets = {t: job.follow[t].wait_for(rf"etcd-v3 rendezvous {re.escape(job.id)}\.g(\d+) at ", TIMEOUT_S,
                                           after=lost_at + said[t])
                 for t in TRAINERS}  # fmt: skip
        assert all(meets.values()), job.tails()
        generations = {t: re.search(r"\.g(\d+) at ", line).group(1) for t, (_, line) in meets.items()}
        if len(set(generations.values())) > 1:
            # The run that lost quorum could not close its rendezvous (etcd refused the write), yet the first
            # agent to find etcd back advances the job's generation: nodes that read it before meet in the
            # old, still open, rendezvous, the others in the new one, and the job splits.
            pytest.xfail(f"quorum back: the nodes split across generations {generations} (a node's agent advanced "
                         "the generation of a rendezvous it could not close)")
        _, formed = job.wait_for(world_line(3), after=back_at)
        codes = job.wait(*TRAINERS)
    finally:
        cluster.compose("up", "-d", "--no-build", "--wait", *ETCD, timeout=120)  # whatever happened: a whole cluster again
    assert codes == dict.fromkeys(TRAINERS, 0), job.tails()
    segments = job.segments()
    assert [s.world for s in segments] == [3, 3] and segments[1].resumed_from > 0, segments
    assert job.metrics(*TRAINERS)["world_size"] == 3
    for trainer in TRAINERS:
        assert "the job exited with 69: restart 1 of" in job.text(trainer), job.tails()
    print(f"\netcd faults: quorum lost -> each node's error line after {min(said.values()):.1f}-{max(said.values()):.1f} s; "
          f"quorum back -> world 3 again after {formed - back_at:.1f} s")
