"""trainpod.agent.metrics: the node's figures from the ranks' progress records and the agent's events, as
Prometheus reads them (prometheus_client's own text format, parsed back with its parser), and served over HTTP."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from fixtures.ports import free_port
from trainpod import records
from trainpod.agent import metrics
from trainpod.agent.metrics import METRICS, Recorder
from trainpod.train import progress


def write(directory, local: int, step: int, at: float, samples: int = 0, committed: int = -1, busy: float = 0.0,
          save: float = 0.0, stall: float = 0.0) -> None:
    record = progress.Record(step=step, committed=committed, time=at, busy=busy, samples=samples, save=save, stall=stall)
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
        write(tmp_path, 1, 2 * look, start + look, samples=32 * look, committed=4 if look > 2 else -1,
              save=1.5 if look > 2 else 0.0, stall=0.25 if look > 2 else 0.0)
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
    assert found[("trainpod_checkpoint_save_seconds", (("rank", "5"),))] == 1.5
    assert found[("trainpod_checkpoint_stall_seconds", (("rank", "5"),))] == 0.25
    assert ("trainpod_checkpoint_save_seconds", (("rank", "4"),)) not in found  # rank 4 saved none
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
    recorder = metrics.start(tmp_path, port, address="127.0.0.1")
    recorder.group_started({0: 0}, world_size=2, nodes=2)
    recorder.count("trainpod_hangs_total")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "# TYPE trainpod_hangs_total counter" in text and "trainpod_hangs_total 1.0" in text, text
    assert "trainpod_world_size 2.0" in text
    assert metrics.recorder() is recorder
    with pytest.raises(OSError):  # the port is taken: the agent ends with one line and 78
        metrics.start(tmp_path, port, address="127.0.0.1")


def test_the_same_events_and_each_ranks_progress_become_the_runs_records(tmp_path):
    progress_dir, output = tmp_path / "progress", tmp_path / "out"
    progress_dir.mkdir()
    recorder = Recorder(progress_dir, records.Writer(output, host="node-a"))
    recorder.group_started({0: 2, 1: 3}, world_size=4, nodes=2)
    start = time.time() + 1
    write(progress_dir, 0, 1, start)
    write(progress_dir, 1, 1, start)
    recorder.sample()
    write(progress_dir, 0, 3, start + 1, samples=48, busy=0.2, committed=2, save=0.5, stall=0.01)
    recorder.sample()
    recorder.sample()  # nothing new: no record
    recorder.group_failed("failure", restarting=True)
    recorder.event("membership", nodes=1, before=2)
    recorder.group_started({0: 0}, world_size=2, nodes=1)
    write(progress_dir, 0, 3, recorder.started + 2, committed=2)  # resumed from step 2's checkpoint: saved by no rank here
    recorder.sample()
    lines = (output / "records" / "node-a.jsonl").read_text().splitlines()
    found = [records.Record(r.pop("time"), r.pop("node"), r.pop("kind"), r) for r in map(json.loads, lines)]  # as written
    assert [r.kind for r in found] == ["started", "progress", "progress", "progress", "checkpoint", "failed", "membership",
                                       "started", "recovered", "progress"], found
    assert sorted(records.read(output), key=lambda r: r.kind) == sorted(found, key=lambda r: r.kind)  # read() gives them all
    assert {r.node for r in found} == {"node-a"} and (output / "records" / "node-a.jsonl").exists()
    assert found[0].fields == {"world": 4, "nodes": 2, "ranks": [2, 3]}
    assert found[3].fields == {"rank": 2, "step": 3, "samples": 48, "own_s": 0.2, "step_s": 0.5}  # 2 steps in 1 s
    assert found[4].fields == {"rank": 2, "step": 2, "save_s": 0.5, "stall_s": 0.01}
    assert found[5].fields == {"cause": "failure", "restarting": True}
    assert found[8].get("seconds") > 0 and found[8].get("step") == 3


def test_an_output_directory_that_cannot_be_written_loses_the_records_never_the_run(tmp_path):
    (tmp_path / "file").write_text("")
    said = []
    recorder = Recorder(tmp_path, records.Writer(tmp_path / "file" / "out", said.append, host="n"))
    recorder.group_started({0: 0}, world_size=1, nodes=1)
    recorder.group_failed("hang", restarting=False)
    assert len(said) == 1 and said[0].startswith(f"warning: {tmp_path / 'file' / 'out' / 'records' / 'n.jsonl'}: "), said
