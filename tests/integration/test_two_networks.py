"""A node whose default route does not reach the master: trainpod must pick the other interface."""

import re
from pathlib import Path

import pytest

from fixtures.docker_env import ComposeJob

pytestmark = [pytest.mark.docker, pytest.mark.slow]

COMPOSE = Path(__file__).parent / "compose" / "two-networks.yaml"


@pytest.fixture
def job(docker_ready):
    job = ComposeJob(COMPOSE)
    yield job
    job.down()


def test_interface_follows_the_route_to_the_master(job):
    job.up()
    codes = job.wait("node0", "node1")
    log = job.logs("node1")
    assert codes == {"node0": 0, "node1": 0}, job.logs("node0")[-2000:] + log[-3000:]

    default_dev = re.search(r"^default via \S+ dev (\S+)", log, re.M).group(1)
    chosen = re.search(r"gloo over (\S+)$", log, re.M).group(1)
    assert chosen != default_dev, log[:2000]
    assert len(set(job.metrics()["rank_checksums"])) == 1
