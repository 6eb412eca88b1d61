"""The metrics endpoint on this host, as `trainpod run --metrics-port` serves it: a 2-rank CIFAR-10 job whose rank is
killed once (TRAINPOD_FAILPOINTS=checkpoint-write@20: a SIGKILL mid-checkpoint), scraped every half second with a
real HTTP client and parsed with prometheus_client's parser. While it trains: each rank's step, steps, samples and
step-time quantiles, the world and node count. After the kill: one restart of cause `failure`, one recovery, timed,
and the checkpoint figures; the run's records (trainpod.records) hold the same events. A port that is taken ends the
node with 78 and one line. The figures' arithmetic is test_metrics' (unit)."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fixtures.ports import free_port
from fixtures.processes import host_env, trainpod_run, wait_logged
from trainpod import records

pytestmark = pytest.mark.slow

# Each step at least PACE_MS: step 10's commit to the kill at step 20 outlasts the agent's 1 s between two looks, so one
# of them sees the commit's figures. Unpaced, an idle machine ran those ten steps in a fifth of a second, no look saw
# them, and the scrape after the recovery had no checkpoint figures (the resumed attempt had committed none yet).
PACE_MS = 150
JOB = ["--example", "cifar10-ddp", "--", "--epochs", "1", "--synthetic-samples", "8192", "--batch-size", "16",
       "--max-steps", "160", "--checkpoint-every", "10", "--workers", "0"]


def scrape(port: int) -> dict[tuple[str, tuple], float] | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None  # not serving yet, or no more
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_jobs_steps_samples_restart_and_recovery_are_served_while_it_runs(tmp_path):
    port = free_port()
    log = tmp_path / "log"
    with open(log, "w") as out:
        process = subprocess.Popen([*trainpod_run("--nproc-per-node", "2", "--metrics-port", str(port), "--max-restarts", "2"),
                                    *JOB[:3], "--output-dir", str(tmp_path / "out"), "--checkpoint-dir", str(tmp_path / "ckpt"),
                                    *JOB[3:]], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=host_env(OMP_NUM_THREADS="1", TRAINPOD_FAILPOINTS=f"checkpoint-write@20,pace@{PACE_MS}"))
    training = recovered = None
    deadline = time.monotonic() + 300
    # Until both are seen: a group training (either attempt; a rank's steps count from its second look on), and the
    # recovery.
    while process.poll() is None and time.monotonic() < deadline and (training is None or recovered is None):
        found = scrape(port)
        # While a group trains: between the kill and the restart the world is 0.
        if found and training is None and found.get(("trainpod_world_size", ()), 0) == 2 \
                and all(found.get(("trainpod_steps_total", (("rank", r),)), 0) > 0
                                              and found.get(("trainpod_samples_total", (("rank", r),)), 0) >= 16
                                              and ("trainpod_step_seconds", (("quantile", "0.5"), ("rank", r))) in found
                                              for r in ("0", "1")):
            training = found  # both ranks seen training (a rank's steps count from its second look on)
        if found and recovered is None and found.get(("trainpod_recoveries_total", ()), 0) >= 1:
            recovered = found
        time.sleep(0.5)
    output = wait_logged(process, log, timeout=300)
    assert process.returncode == 0, output[-3000:]
    assert training is not None and recovered is not None, f"training: {training}\nrecovered: {recovered}\n{output[-3000:]}"
    for rank in ("0", "1"):
        assert training[("trainpod_steps_total", (("rank", rank),))] > 0, training
        assert training[("trainpod_samples_total", (("rank", rank),))] >= 16, training
        assert training[("trainpod_step_seconds", (("quantile", "0.5"), ("rank", rank)))] > 0, training
    assert (training[("trainpod_world_size", ())], training[("trainpod_nodes", ())]) == (2, 1), training
    assert recovered[("trainpod_restarts_total", (("cause", "failure"),))] == 1, recovered
    assert 0 < recovered[("trainpod_recovery_seconds", ())] < 120, recovered
    assert recovered[("trainpod_committed_step", ())] >= 10, recovered
    saves = {labels: value for (name, labels), value in recovered.items() if name == "trainpod_checkpoint_save_seconds"}
    stalls = {labels: value for (name, labels), value in recovered.items() if name == "trainpod_checkpoint_stall_seconds"}
    assert saves and all(value > 0 for value in saves.values()) and set(stalls) == set(saves), recovered  # step 10's
    assert recovered[("trainpod_world_size", ())] == 2, recovered
    # The same events and the ranks' progress, as the run's records `trainpod report` draws (trainpod.records).
    found = records.read(tmp_path / "out")
    kinds = [r.kind for r in found]
    assert kinds.count("started") == 2 and kinds.count("failed") == 1 and kinds.count("recovered") == 1, kinds
    assert found[kinds.index("failed")].fields == {"cause": "failure", "restarting": True}, found
    assert {r.get("rank") for r in found if r.kind == "progress"} == {0, 1}, kinds
    assert max(r.get("step") for r in found if r.kind == "progress") == 160
    assert any(r.kind == "checkpoint" and r.get("save_s") > 0 for r in found), kinds
    assert [p.name for p in (tmp_path / "out" / "records").iterdir()] == [records.node_file(tmp_path, socket.gethostname()).name]
    print(f"\nrecovery {recovered[('trainpod_recovery_seconds', ())]:.2f} s; "
          f"step time p50 {training[('trainpod_step_seconds', (('quantile', '0.5'), ('rank', '0')))]:.3f} s")


def test_a_taken_port_ends_the_node_with_78_and_one_line(tmp_path):
    with socket.create_server(("0.0.0.0", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([*trainpod_run("--nproc-per-node", "1", "--metrics-port", str(port)), "--", "true"], cwd=tmp_path,
                              env=host_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 78, done.stdout + done.stderr
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "error:" in line]
    assert len(errors) == 1 and f"--metrics-port {port}: cannot serve the metrics there" in errors[0], done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
