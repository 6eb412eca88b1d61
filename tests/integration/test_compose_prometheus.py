"""compose/pai-2node's `prometheus` profile on the real engine: Debian's Prometheus (compose/prometheus) scrapes
both nodes' agents (--metrics-port) while the job trains, and after a rank is killed its HTTP API has the restart
the agents counted and the recovery they timed; the job then ends with 0 on both nodes. The metrics' names and
meanings are trainpod.agent.metrics' (docs/metrics.md); their values are its unit tests'."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request

import pytest
from test_faults import COMPOSE, FAULTS, NODES

from fixtures.docker_env import ComposeJob, find_rank

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.xdist_group("compose_prometheus")]

PORT = "9400"


@pytest.fixture
def job(docker_ready, tmp_path):
    # 48 steps of at least 0.25 s (the failpoint pace): the job outlasts the scrapes the test waits for, the kill and
    # the scrapes after its recovery (Prometheus scrapes every second). Unpaced, an idle machine ran the 48 steps in 3 s:
    # the kill landed after rank 2's last collective, node0's ranks had finished, and node1's restarts had no one to
    # meet (its agent gave up with 69, node0's waited at torch's exit barrier).
    job = ComposeJob(COMPOSE, env={"COMPOSE_PROFILES": "prometheus", "TRAINPOD_METRICS_PORT": PORT,
                                   "TRAINPOD_SYNTHETIC_SAMPLES": "1536", "TRAINPOD_EPOCHS": "1",
                                   "TRAINPOD_FAILPOINTS": "pace@250"}, overrides=(FAULTS,))
    job.compose("build", "prometheus", timeout=900)
    yield job
    for service in (*NODES, "prometheus"):
        (tmp_path / f"{service}.log").write_text(job.compose("logs", "--timestamps", "--no-color", service, check=False).stdout)
    job.down()


def query(address: str, expr: str) -> dict[str, float]:
    """An instant query through Prometheus' HTTP API: {instance: value} (one series per instance)."""
    url = f"http://{address}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return {series["metric"].get("instance", ""): float(series["value"][1]) for series in body["data"]["result"]}


def wait_for(address: str, expr: str, holds, job: ComposeJob, timeout: float = 300) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while not holds(found := query(address, expr)):
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {node}\n{job.logs(node)[-2500:]}" for node in NODES)
            raise AssertionError(f"{expr} = {found} within {timeout} s:\n{logs}")
        time.sleep(1)
    return found


def test_prometheus_scrapes_both_nodes_and_sees_a_killed_ranks_restart_and_recovery(job):
    job.compose("up", "-d", "--no-build", "--wait", "prometheus", timeout=180)
    address = job.compose("port", "prometheus", "9090").stdout.strip()
    job.up(*NODES)
    instances = {f"{node}:{PORT}" for node in NODES}

    # During the run: every node's agent is scraped, and its ranks' steps are there.
    wait_for(address, "sum by (instance) (trainpod_steps_total)", lambda found: set(found) == instances
             and min(found.values()) >= 5, job)
    assert query(address, 'up{job="trainpod"}') == dict.fromkeys(instances, 1.0)
    assert query(address, "trainpod_world_size") == dict.fromkeys(instances, 4.0)

    # A rank of node1 killed: the agents count the restart and time the recovery, to the first step after it.
    [pid] = job.compose("exec", "-T", "node1", "sh", "-c", find_rank(2)).stdout.split()
    job.compose("exec", "-T", "node1", "kill", "-KILL", pid)
    restarts = wait_for(address, 'sum by (instance) (trainpod_restarts_total{cause="failure"})',
                        lambda found: found.get(f"node1:{PORT}", 0) >= 1, job)
    recoveries = wait_for(address, "trainpod_recoveries_total", lambda found: found and max(found.values()) >= 1, job)
    seconds = query(address, "trainpod_recovery_seconds")
    recovered = [instance for instance, count in recoveries.items() if count >= 1]
    assert all(seconds[instance] > 0 for instance in recovered), (recoveries, seconds)

    assert job.wait(*NODES, timeout=600) == dict.fromkeys(NODES, 0), "\n".join(job.logs(n)[-3000:] for n in NODES)
    # After the job: Prometheus keeps what it scraped, the restart with it.
    kept = query(address, 'sum by (instance) (max_over_time(trainpod_restarts_total{cause="failure"}[10m]))')
    assert kept.get(f"node1:{PORT}", 0) >= 1, kept
    print(f"\nrestarts {restarts}, recoveries {recoveries}, recovery seconds {seconds}")
