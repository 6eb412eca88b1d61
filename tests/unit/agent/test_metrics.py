"""trainpod.agent.metrics: the node's figures from the ranks' progress records and the agent's events, as
Prometheus reads them (prometheus_client's own text format, parsed back with its parser), and served over HTTP."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from fixtures.ports import free_port
from trainpod.agent import metrics
from trainpod.agent.metrics import METRICS, Recorder
from trainpod.train import progress


def write(directory, local: int, step: int, at: float, samples: int = 0, committed: int = -1, busy: float = 0.0) -> None:
    record = progress.Record(step=step, committed=committed, time=at, busy=busy, samples=samples)
    (directory / f"rank{local}").write_bytes(progress.encode(record))


def scrape(recorder: Recorder) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry()
    registry.register(recorder)
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_steps_samples_step_times_and_the_committed_step_from_the_ranks_records(tmp_path):
    recorder = Recorder(tmp_path)
    recorder.group_started({0: 4, 1: 5}, world_size=8, nodes=4)
    start = time.time() + 1
    for look in range(5):  # a step every 0.5 s on rank 4, two per look of 1 s on rank 5
        write(tmp_path, 0, look, start + look * 0.5, samples=16 * look, busy=0.25)
        write(tmp_path, 1, 2 * look, start + look, samples=32 * look, committed=4 if look > 2 else -1)
        recorder.sample()
    found = scrape(recorder)
    assert found[("trainpod_step", (("rank", "4"),))] == 4
    assert found[("trainpod_steps_total", (("rank", "4"),))] == 4
    assert found[("trainpod_steps_total", (("rank", "5"),))] == 8
    assert found[("trainpod_samples_total", (("rank", "5"),))] == 128
    assert found[("trainpod_step_seconds", (("quantile", "0.5"), ("rank", "4")))] == pytest.approx(0.5)
    assert found[("trainpod_step_seconds", (("quantile", "0.9"), ("rank", "5")))] == pytest.approx(0.5)
    assert found[("trainpod_own_work_seconds", (("rank", "4"),))] == 0.25
    assert found[("trainpod_committed_step", ())] == 4
    assert (found[("trainpod_world_size", ())], found[("trainpod_nodes", ())]) == (8, 4)
    assert not [key for key in found if key[0] == "trainpod_restarts_total"], found  # none yet: no sample of any cause


def test_a_restart_is_counted_by_cause_and_the_recovery_timed_to_the_first_step_after_it(tmp_path):
    recorder = Recorder(tmp_path)
    recorder.group_started({0: 0}, world_size=1, nodes=1)
    write(tmp_path, 0, 10, time.time() + 0.01)
    recorder.sample()
    recorder.group_failed("failure", restarting=True)
    failed_at = recorder.failed_at
    write(tmp_path, 0, 11, failed_at - 0.5)  # the failed group's last step, read after the failure: no recovery
    recorder.sample()
    assert ("trainpod_recovery_seconds", ()) not in recorder.gauges
    recorder.group_started({0: 0}, world_size=1, nodes=1)
    recorder.sample()  # the last group's record: no step of this group yet
    assert ("trainpod_recovery_seconds", ()) not in recorder.gauges
    write(tmp_path, 0, 7, failed_at + 2.5)  # resumed from a checkpoint of step 6: its first step is 7
    recorder.sample()
    found = scrape(recorder)
    assert found[("trainpod_restarts_total", (("cause", "failure"),))] == 1
    assert found[("trainpod_recoveries_total", ())] == 1
    assert found[("trainpod_recovery_seconds", ())] == pytest.approx(2.5, abs=0.01)  # the record's time: ms
    assert found[("trainpod_hangs_total", ())] == 0  # an unlabelled counter is there from the start


def test_every_metric_follows_prometheus_naming():
    for metric in METRICS:
        assert metric.name.startswith("trainpod_") and metric.name.islower(), metric
        assert metric.name.endswith("_total") == (metric.kind == "counter"), metric
        assert not metric.name.endswith(("_milliseconds", "_ms", "_minutes")), metric


def test_the_endpoint_serves_the_figures_over_http(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "_recorder", None)
    port = free_port()
    recorder = metrics.serve(port, tmp_path, address="127.0.0.1")
    recorder.group_started({0: 0}, world_size=2, nodes=2)
    recorder.count("trainpod_hangs_total")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "# TYPE trainpod_hangs_total counter" in text and "trainpod_hangs_total 1.0" in text, text
    assert "trainpod_world_size 2.0" in text
    assert metrics.recorder() is recorder
    with pytest.raises(OSError):  # the port is taken: the agent ends with one line and 78
        metrics.serve(port, tmp_path, address="127.0.0.1")
