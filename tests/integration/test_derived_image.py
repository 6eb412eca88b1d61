"""A user's image FROM trainpod:cpu with a Python package added, run as a 2-node job with plain `docker run`-style
variables in the README's hardened container (read-only root, a tmpfs /tmp, no capabilities)."""

import re
import subprocess
import uuid

import pytest
from testcontainers.core.network import Network

from fixtures.docker_env import IMAGE, run
from fixtures.static_nodes import static_node

pytestmark = [pytest.mark.docker, pytest.mark.slow]

CONTEXT = __file__.rsplit("/", 1)[0] + "/derived"
# docker run --read-only --tmpfs /tmp --cap-drop ALL --security-opt no-new-privileges
HARDENED = {"read_only": True, "cap_drop": ["ALL"], "security_opt": ["no-new-privileges"], "shm_size": "512m"}


@pytest.fixture
def derived_image(docker_ready):
    tag = f"trainpod-derived-test:{uuid.uuid4().hex[:8]}"
    run("docker", "build", "--build-arg", f"TRAINPOD_IMAGE={IMAGE}", "-t", tag, CONTEXT, env={"DOCKER_BUILDKIT": "0"})
    yield tag
    subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True)


def node(image, network, rank):
    return (
        static_node(image, network, rank, nproc=2)
        .with_kwargs(**HARDENED)
        .with_tmpfs_mount("/tmp")
    )


def test_users_script_runs_as_a_two_node_job(derived_image):
    with Network() as network, node(derived_image, network, 0) as node0, node(derived_image, network, 1) as node1:
        results = [container.get_wrapped_container().wait(timeout=300) for container in (node0, node1)]
        logs = ["".join(part.decode() for part in container.get_logs()) for container in (node0, node1)]
    assert [r["StatusCode"] for r in results] == [0, 0], "\n".join(log[-2000:] for log in logs)
    lines = re.findall(r"user-script rank=(\d) world=4 node=(\d) weights=(\w+) (.*)", "".join(logs))
    assert sorted(int(rank) for rank, _, _, _ in lines) == [0, 1, 2, 3]
    assert len({digest for _, _, digest, _ in lines}) == 1
    # Every rank imported the package the image's pip installed, runs as uid 1000 and cannot change it (root's).
    assert {package for _, _, _, package in lines} == {"mypkg=1.0 uid=1000 owner=0 writable=False"}
    assert "[node1 rank3] user-script rank=3" in logs[1]
