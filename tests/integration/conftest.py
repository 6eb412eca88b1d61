import pytest

from fixtures.docker_env import require_docker


@pytest.fixture(scope="session")
def docker_ready():
    require_docker()
