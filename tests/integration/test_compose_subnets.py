"""fixtures.docker_env.ComposeJob on the real engine: a project whose subnet was taken after it was chosen (another
user of the engine) comes up on another one, and a project that `down` cannot remove fails the test that made it,
by name, and keeps its subnet reserved (fixtures.subnets says why)."""

import json
import uuid

import pytest

from fixtures import subnets
from fixtures.docker_env import IMAGE, REPO, ComposeJob, run

pytestmark = [pytest.mark.docker]

COMPOSE = REPO / "compose" / "pai-2node" / "compose.yaml"


def project_subnet(job: ComposeJob) -> str:
    network = f"{job.project}_cluster"
    return json.loads(run("docker", "network", "inspect", network).stdout)[0]["IPAM"]["Config"][0]["Subnet"]


def test_a_subnet_taken_since_it_was_chosen_is_left_for_another(docker_ready):
    job = ComposeJob(COMPOSE)
    chosen = job.prefix
    squatter = f"tp-squatter-{uuid.uuid4().hex[:8]}"
    run("docker", "network", "create", "--subnet", f"{chosen}.0/24", squatter)
    try:
        job.compose("up", "--no-start", "--no-build")
        assert job.prefix != chosen
        assert project_subnet(job) == f"{job.prefix}.0/24"
        assert not (subnets.RESERVED / chosen).exists()  # the refused one is not kept
    finally:
        job.down()
        run("docker", "network", "rm", squatter)
    assert not (subnets.RESERVED / job.prefix).exists()


def test_a_project_down_cannot_remove_fails_by_name(docker_ready):
    job = ComposeJob(COMPOSE)
    job.compose("up", "--no-start", "--no-build")
    stranger = f"tp-stranger-{uuid.uuid4().hex[:8]}"  # a container compose does not know holds the network
    run("docker", "run", "-d", "--name", stranger, "--network", f"{job.project}_cluster", "--entrypoint", "sleep", IMAGE, "600")
    try:
        with pytest.raises(AssertionError, match=rf"compose down left {job.project}_cluster of project {job.project}"):
            job.down()
        assert (subnets.RESERVED / job.prefix).exists()  # still taken: not given to the next project
    finally:
        run("docker", "rm", "-f", stranger)
        job.down()
    assert not (subnets.RESERVED / job.prefix).exists()
