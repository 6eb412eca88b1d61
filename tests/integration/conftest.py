import pytest

from fixtures.docker_env import require_docker
from fixtures.etcd import etcd, etcd_v2  # noqa: F401 (pytest fixtures: one etcd per module that asks)


@pytest.fixture(scope="session")
def docker_ready():
    require_docker()
