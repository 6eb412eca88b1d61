"""A straggler named on this host, as `trainpod run` runs a job: two nodes of cifar10-ddp (one process each), node 1's
rank doing each step's own work twice as long (TRAINPOD_FAILPOINTS=slow@1: it sleeps as long as its forward and
backward took). With --straggler-window 3, node 1's agent names its rank once, in its log and in its output's
stragglers.jsonl, while the job trains on; node 0 names nobody; both end with 0. The decision's edges (the window,
the others' median, a node named as the node, keeping pace again) are trainpod.agent.stragglers' unit tests."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from fixtures.processes import host_env, trainpod_run, wait_logged

pytestmark = pytest.mark.slow

WINDOW_S = 3
# 768 steps: the job trains past the naming (three looks of 2 s for the figures, then the window) on a fast machine too.
JOB = ("--example", "cifar10-ddp", "--", "--epochs", "1", "--batch-size", "16", "--synthetic-samples", "12288",
       "--workers", "0")


def test_a_rank_twice_as_slow_is_named_once_by_its_own_node_while_the_job_trains_on(tmp_path):
    argv = trainpod_run("--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--connect-timeout", "60",
                        "--straggler-window", str(WINDOW_S))
    nodes = []
    for rank in (0, 1):
        log = tmp_path / f"node{rank}.log"
        env = host_env(OMP_NUM_THREADS="1", **({"TRAINPOD_FAILPOINTS": "slow@1"} if rank else {}))
        with open(log, "w") as out:
            process = subprocess.Popen([*argv, "--node-rank", str(rank), *JOB[:3], "--output-dir", str(tmp_path / f"out{rank}"),
                                        *JOB[3:]], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        nodes.append((process, log))
    outputs = [wait_logged(process, log, timeout=300) for process, log in nodes]
    codes = [process.returncode for process, _ in nodes]
    assert codes == [0, 0], f"exit codes {codes}\n--- node 0\n{outputs[0][-3000:]}\n--- node 1\n{outputs[1][-3000:]}"

    named = [line for line in outputs[1].splitlines() if "trainpod: straggler:" in line]
    assert len(named) == 1, outputs[1]
    assert "straggler: rank 1 (node 1) spends " in named[0] and "the whole job runs at its pace" in named[0], named[0]
    assert "straggler" not in outputs[0], outputs[0]
    [event] = [json.loads(line) for line in (tmp_path / "out1" / "stragglers.jsonl").read_text().splitlines()]
    assert (event["event"], event["rank"], event["node"]) == ("straggler", 1, "1"), event
    assert event["busy_s"] >= 1.3 * event["others_s"] > 0, event
    assert event["time"] - event["since"] >= WINDOW_S, event
    assert not os.path.exists(tmp_path / "out0" / "stragglers.jsonl")
    metrics = json.loads((tmp_path / "out0" / "metrics.json").read_text())
    ended = metrics["first_step_unix"] + metrics["train_s"]
    assert ended > event["time"] + 2, f"the job ended {event['time'] - ended:.1f}s after the naming: not past the watch's next look"
    print(f"\n{named[0]}\n(the job trained on for {ended - event['time']:.0f}s after it)")
