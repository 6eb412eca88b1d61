"""A straggler named on this host, as `trainpod run` runs a job: two nodes of cifar10-ddp (one process each), node 1's
rank doing each step's own work twice as long (TRAINPOD_FAILPOINTS=slow@1: it sleeps as long as its forward and
backward took). With --straggler-window 3, node 1's agent names its rank once, in its log and in its output's
stragglers.jsonl, while the job trains on; node 0 names nobody; both end with 0. The decision's edges (the window,
the others' median, a node named as the node, keeping pace again) are trainpod.agent.stragglers' unit tests.

With --replace-stragglers, in an elastic job on etcd-v3 with a spare waiting, the straggler's node leaves the job
(69, one line) and the spare takes its place: the job finishes at the same world size."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from fixtures.elastic_host import Node, clean_env, first_to_print, trainpod_argv
from fixtures.processes import host_env, trainpod_run, wait_logged

pytestmark = pytest.mark.slow

WINDOW_S = 3
TIMEOUT_S = 240
# 768 steps of a world of 2: the job trains past the naming (three looks of 2 s for the figures, then the window) on a
# fast machine too. At 384 the job ended first on an idle 2-core host once a step was one gradient collective
# (trainpod.train.distributed.reproducible_ddp): the naming came under load only, as the suite's other tests slowed it.
JOB = ("--example", "cifar10-ddp", "--", "--epochs", "1", "--batch-size", "16", "--synthetic-samples", "24576",
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


def test_with_replace_stragglers_the_slow_node_leaves_and_a_spare_takes_its_place(etcd, tmp_path):
    """Two nodes of an elastic cifar10-ddp job (--nnodes 1:2, etcd-v3), b's rank twice as slow (slow@1); a third node,
    c, starts once they train and waits as a spare. b's agent names its rank, finds the spare and leaves the job: its
    ranks stop as on SIGTERM (the stop vote: every rank at one checkpoint), it ends with 69 and one line, excluded;
    a and the spare c meet at world 2 and finish with 0."""
    def argv():  # 400 steps at world 2: past the naming (three looks of 2 s, the window) and the spare's start
        return trainpod_argv("etcd-v3", etcd.endpoint, tmp_path, "--rdzv-conf", "last_call_timeout=30", "--spares", "1",
                             "--replace-stragglers", "--straggler-window", str(WINDOW_S)) + ["--epochs", "100"]

    logs = tmp_path / "logs"
    a = Node("a", argv(), clean_env(), logs)
    b = Node("b", argv(), clean_env(TRAINPOD_FAILPOINTS="slow@1"), logs)
    nodes = [a, b]
    try:
        assert first_to_print(nodes, r"world 2, backend", TIMEOUT_S), "\n---\n".join(n.text()[-3000:] for n in nodes)
        c = Node("c", argv(), clean_env(), logs)
        nodes.append(c)
        assert c.wait_for(r"trainpod: this node waits as a spare: ", TIMEOUT_S), c.text()[-3000:]
        codes = {node.name: node.wait(TIMEOUT_S) for node in nodes}
        assert codes == {"a": 0, "b": 69, "c": 0}, "\n---\n".join(f"{n.name}:\n{n.text()[-3000:]}" for n in nodes)
        errors = [line for line in b.text().splitlines() if "trainpod: error:" in line]
        assert len(errors) == 1 and "of this node paces the job" in errors[0], b.text()[-3000:]
        assert "this node leaves the elastic job (--replace-stragglers); a spare takes its place" in errors[0], errors[0]
        left = b.find(r"this node leaves the elastic job")[0]
        assert any(n.find(r"world 2, backend", after=left) for n in (a, c)), a.text()[-3000:]  # the spare in b's place
        assert "1 node(s) took the place of one that left" in a.text(), a.text()[-3000:]
        metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
        assert metrics["world_size"] == 2 and len(set(metrics["rank_checksums"])) == 1, metrics
        print(f"\n{errors[0]}")
    finally:
        for node in nodes:
            node.stop()
