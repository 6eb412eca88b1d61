"""Elastic jobs in containers: compose/elastic (3 etcd members, trainer nodes with --nnodes 2:3, a 20 s last call), on the real engine.

One etcd cluster (without v2) serves the module; each job is a fresh set of trainer containers in
its project with a rendezvous id of its own. Every trainer runs cifar10-ddp, one process per node,
rank 0 logging every step; a node is lost with `docker kill` (SIGKILL of the container: no signal
reaches trainpod).

- etcd-v3, with the elastic example (imagenet-elastic): the node holding rank 0 is lost mid-epoch,
  and (a second run) another one; the other two meet at world 2 and finish with 0 from the shared
  checkpoint; their metrics say world 2, the membership timeline [3, 2], and the ledger: both epochs
  trained exactly once.
- torch's `etcd` backend (a second etcd cluster, with v2; one endpoint, all that backend takes):
  rank 0's node is lost, and (a second run) another one; the other two finish.
- c10d: the node that hosts the store (trainer0, the endpoint) is lost; the others, which cannot
  host it, wait --rejoin-timeout for it and end with 69 and one line each.
- A 4th node started mid-run joins at the next rendezvous: world 4, its rank lines appear, it
  trains to the end (imagenet-elastic: the epoch exactly once across worlds 3 and 4).
- Two jobs on one etcd at once (different rendezvous ids) train side by side, each at world 2.
- etcd faults: one member killed: the job goes on unaffected; a second one (no quorum): each node
  says in one line that etcd is unreachable and exits 69, its supervisor restarts it (69 is
  retried); once both members are back the job meets again and finishes from the checkpoint. (Or it
  splits: the nodes' next attempts may read different generations of the job's rendezvous, as the
  first agent to see etcd back advances the generation of a rendezvous it could not close. That
  race ends the test as xfail, naming the generations.)

Each test prints its figures (a node's kill to the survivors' first step at the smaller world).
"""

from __future__ import annotations

import random
import re
import time

import pytest

from fixtures.compose_elastic import (
    ELASTIC,
    ELASTIC_ARGS,
    ELASTIC_LONGER_ARGS,
    ETCD,
    LONGER_ARGS,
    STEP,
    TIMEOUT_S,
    TRAINERS,
    TRAINPOD_LINE,
    check_exactly_once,
    check_scaled_down,
    etcd_cluster,
    job_factory_for,
    scale_down,
    wait_step,
    world_line,
)
from fixtures.docker_env import ComposeJob, run

# One worker runs the module (make test: pytest-xdist, --dist loadgroup): its etcd clusters are module fixtures, each
# on a subnet of its own, that every test of it shares.
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.xdist_group("compose_elastic")]


@pytest.fixture(scope="module")
def cluster(docker_ready):
    yield from etcd_cluster()


@pytest.fixture
def job_factory(cluster, tmp_path):
    yield from job_factory_for(cluster, tmp_path)


# Which node is lost: rank 0's (its holder: the next round must give rank 0 to a survivor) or another one.
LOSE = {"rank 0's": lambda holder: holder,
        "another": lambda holder: random.choice([t for t in TRAINERS if t != holder])}


@pytest.mark.parametrize("lost", LOSE)
def test_etcd_v3_losing_a_node_leaves_two_nodes_that_finish(job_factory, lost):
    job = job_factory("down-v3", TRAINPOD_EXAMPLE=ELASTIC, TRAINPOD_EXAMPLE_ARGS=ELASTIC_ARGS)
    result = scale_down(job, lose=LOSE[lost])
    metrics = check_scaled_down(job, result)
    check_exactly_once(metrics, [1, 2], [3, 2])
    print(f"\netcd-v3: {result['victim']} ({lost} node) killed -> world 2 formed after {result['formed_s']:.1f} s, "
          f"first step at world 2 after {result['recovery_s']:.1f} s")


def test_c10d_losing_the_stores_host_ends_the_others_with_69_and_one_line(job_factory):
    rejoin = 10
    job = job_factory("c10d", TRAINPOD_RDZV_BACKEND="c10d", TRAINPOD_RDZV_ENDPOINT="trainer0:29400",
                      TRAINPOD_REJOIN_TIMEOUT=str(rejoin), TRAINPOD_MAX_RESTARTS="3")
    job.up(*TRAINERS)
    job.rank0_at_step(3, 4)
    killed_at = job.kill("trainer0")  # its agent hosts the store
    survivors = ("trainer1", "trainer2")
    codes = job.wait(*survivors, timeout=TIMEOUT_S)
    elapsed = time.monotonic() - killed_at
    assert codes == {"trainer1": 69, "trainer2": 69}, job.tails()
    bound = rejoin + 30  # noticing, the wait, the exit; not --connect-timeout per restart
    assert elapsed < bound, (elapsed, job.tails())
    for survivor in survivors:
        lines = [line for line in job.text(survivor).splitlines() if TRAINPOD_LINE.match(line)]
        errors = [line for line in lines if "trainpod: error:" in line]
        assert len(errors) == 1, lines
        assert f"went away after the job started and did not come back within {rejoin}s (--rejoin-timeout)" in errors[0]
    print(f"\nc10d: the store's host killed -> both others exited 69 after {elapsed:.1f} s "
          f"(--rejoin-timeout {rejoin}; bound {bound} s)")


def test_a_fourth_node_joins_a_running_job(job_factory):
    # At least 3: the first round waits for every trainer however late one starts (then 3 s for a 4th), so the
    # timeline is [3, 4] on any machine; the 4th makes the maximum, and its round closes as it joins.
    job = job_factory("up", TRAINPOD_EXAMPLE=ELASTIC, TRAINPOD_EXAMPLE_ARGS=ELASTIC_LONGER_ARGS, TRAINPOD_NNODES="3:4",
                      TRAINPOD_RDZV_CONF="last_call_timeout=3")
    job.up(*TRAINERS)
    job.rank0_at_step(3, 4)
    joined_at = job.up("trainer3")  # profile scale-up: named, it starts
    node, formed = job.wait_for(world_line(4), after=joined_at)
    _, first = job.wait_for(STEP, after=formed)
    assert re.search(r"^\[node\S* rank[0-3]\] ", job.text("trainer3"), re.M), job.tails()  # its rank lines
    codes = job.wait(*TRAINERS, "trainer3")
    assert codes == dict.fromkeys((*TRAINERS, "trainer3"), 0), job.tails()
    metrics = job.metrics(*TRAINERS)
    assert (metrics["world_size"], metrics["nnodes"]) == (4, 4), metrics
    assert len(set(metrics["rank_checksums"])) == 1 and len(metrics["rank_checksums"]) == 4
    assert [s.world for s in job.segments()] == [3, 4]
    check_exactly_once(metrics, [1], [3, 4])
    print(f"\nscale up: trainer3 started -> world 4 formed after {formed - joined_at:.1f} s, "
          f"its first step after {first - joined_at:.1f} s")


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
    job = job_factory("etcd-faults", TRAINPOD_EXAMPLE_ARGS=LONGER_ARGS)
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


# torch's `etcd` backend last: its etcd cluster (a module fixture, three more members, about 0.05 of a core while
# idle) then runs only from its first test to the module's end, not through the tests before.
@pytest.fixture(scope="module")
def cluster_v2(docker_ready):
    """Another etcd cluster, with the v2 API that torch's `etcd` rendezvous needs."""
    yield from etcd_cluster(TRAINPOD_ETCD_ENABLE_V2="true")


@pytest.mark.parametrize("lost", LOSE)
def test_torchs_etcd_backend_losing_a_node_leaves_two_that_finish(job_factory, cluster_v2, lost):
    # torch's etcd backend takes one endpoint (a list is a ValueError in its handler): etcd0 alone.
    job = job_factory("down-v2", on=cluster_v2, TRAINPOD_RDZV_BACKEND="etcd", TRAINPOD_RDZV_ENDPOINT="etcd0:2379")
    result = scale_down(job, lose=LOSE[lost])
    check_scaled_down(job, result)
    assert "etcd rendezvous" in job.text(result["holder"])
    print(f"\netcd (v2): {result['victim']} ({lost} node) killed -> world 2 formed after {result['formed_s']:.1f} s, "
          f"first step at world 2 after {result['recovery_s']:.1f} s")
