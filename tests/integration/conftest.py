import json
import statistics
from pathlib import Path

import pytest
from plugins.timeline import without_group

from fixtures import docker_env
from fixtures.docker_env import require_docker
from fixtures.etcd import etcd, etcd_v2  # noqa: F401 (pytest fixtures: one etcd per module that asks)

# Each test's seconds in a whole `make test` run (tests/plugins/timeline.py writes it with TP_DURATIONS).
DURATIONS = Path(__file__).with_name("durations.json")


@pytest.fixture(scope="session")
def docker_ready():
    require_docker()


def pytest_runtest_setup(item):
    docker_env._DESCRIBED.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report says what the containers it left running were doing (fixtures.container_stacks), before
    its fixtures take them down: a job that stopped making progress is seen as it was, not only by its last lines."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        text = docker_env.describe(docker_env.live_containers())
        if text:
            report.sections.append(("the test's containers as it failed", text))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: make test's last layer is `-m slow` (tests/README.md)
def pytest_collection_modifyitems(items):
    """Every integration test is slow (it runs jobs, containers, clusters): marked so, it runs in make test's last
    layer with the unit tests that are, `-m slow`.

    The longest work first: make test's workers (pytest-xdist, --dist loadgroup --no-loadscope-reorder) take the
    work units (an xdist_group's tests, else one test) in this order, so that no long test starts last while the other
    workers have run out (in collection order the soak, the longest, started near the end, and one worker ran on
    alone: docs/results.md, "The test suite"). A unit's length is its tests' seconds in durations.json; a test not in
    it counts as the median. The tests of a unit keep their order."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.slow)
    try:
        known = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return
    typical = statistics.median(known.values()) if known else 0.0
    units: dict[str, float] = {}
    unit_of = {}
    for item in items:
        group = item.get_closest_marker("xdist_group")
        name = (group.args[0] if group.args else group.kwargs.get("name")) if group else None
        unit_of[item] = unit = f"@{name}" if name else item.nodeid
        units[unit] = units.get(unit, 0.0) + known.get(without_group(item.nodeid) if name else item.nodeid, typical)
    order = {item: index for index, item in enumerate(items)}
    first = {}
    for item in items:
        first.setdefault(unit_of[item], order[item])
    items.sort(key=lambda item: (-units[unit_of[item]], first[unit_of[item]], order[item]))  # a unit's tests together
