"""torch's own `etcd` rendezvous backend under an elastic job in containers: compose/elastic (3 etcd members with the v2
API that backend needs, trainer nodes with --nnodes 2:3, a 45 s last call), on the real engine. Rank 0's node is lost,
and (a second run) another one; the other two meet at world 2 and finish from the shared checkpoint.

A module of its own, with its etcd cluster, beside test_compose_elastic's and test_compose_etcd's (see there).
"""

from __future__ import annotations

import pytest

from fixtures.compose_elastic import EXAMPLE_PACE_MS, LOSE, check_scaled_down, etcd_cluster, job_factory_for, scale_down

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.xdist_group("compose_torch_etcd")]


@pytest.fixture
def job_factory(cluster_v2, tmp_path):
    yield from job_factory_for(cluster_v2, tmp_path)


@pytest.fixture(scope="module")
def cluster_v2(docker_ready):
    """Another etcd cluster, with the v2 API that torch's `etcd` rendezvous needs."""
    yield from etcd_cluster(TRAINPOD_ETCD_ENABLE_V2="true")


@pytest.mark.parametrize("lost", LOSE)
def test_torchs_etcd_backend_losing_a_node_leaves_two_that_finish(job_factory, lost):
    # torch's etcd backend takes one endpoint (a list is a ValueError in its handler): etcd0 alone.
    job = job_factory("down-v2", pace_ms=EXAMPLE_PACE_MS, TRAINPOD_RDZV_BACKEND="etcd", TRAINPOD_RDZV_ENDPOINT="etcd0:2379")
    result = scale_down(job, lose=LOSE[lost])
    check_scaled_down(job, result)
    assert "etcd rendezvous" in job.text(result["holder"])
    print(f"\netcd (v2): {result['victim']} ({lost} node) killed -> world 2 formed after {result['formed_s']:.1f} s, "
          f"first step at world 2 after {result['recovery_s']:.1f} s")
