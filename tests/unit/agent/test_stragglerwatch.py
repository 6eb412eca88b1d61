"""trainpod.agent.stragglerwatch: two nodes' agents, each with a rank reporting its steps, sharing a real c10d store
(torch's HashStore). The slow rank's own agent names it once, then says when it keeps pace; the other agent says
nothing; both record nothing but what concerns their own ranks."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch.distributed as dist

from trainpod.agent.stragglerwatch import StragglerWatch
from trainpod.contract import OUTPUT_DIR_VAR, PROGRESS_DIR_VAR, STRAGGLERS_FILE
from trainpod.train import progress


def report(directory, step: int, busy: float) -> None:
    (directory / "rank0").write_bytes(progress.encode(progress.Record(step=step, committed=-1, time=time.time(), busy=busy)))


@pytest.mark.slow
def test_the_slow_ranks_own_agent_names_it_once_then_says_it_keeps_pace(tmp_path):
    store = dist.HashStore()
    busy = {0: 0.1, 1: 0.25}
    said: dict[int, list[str]] = {0: [], 1: []}
    watches, dirs = [], []
    for node in (0, 1):
        directory = tmp_path / f"progress{node}"
        directory.mkdir()
        dirs.append(directory)
        env = {PROGRESS_DIR_VAR: str(directory), OUTPUT_DIR_VAR: str(tmp_path / f"out{node}")}
        watches.append(StragglerWatch(window=1.0, node=str(node), say=said[node].append, env=env, interval=0.1, span=1.0))
    done = threading.Event()

    def ranks() -> None:
        step = 0
        while not done.wait(0.05):
            step += 1
            for node in (0, 1):
                report(dirs[node], step, busy[node])

    writer = threading.Thread(target=ranks, daemon=True)
    writer.start()
    try:
        for node, watch in enumerate(watches):
            watch.start({0: node}, world_size=2, store=store, group_rank=node, group_world_size=2)
        deadline = time.monotonic() + 20
        while not said[1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(said[1]) == 1, said
        assert said[1][0].startswith("straggler: rank 1 (node 1) spends 0.25s of its own work per step, the other ranks 0.1s"
                                     " (+150%), for "), said[1]
        time.sleep(1.0)  # past the window again: named once
        busy[1] = 0.1
        while len(said[1]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert said[1][1] == "straggler: rank 1 (node 1) keeps pace again: 0.1s of its own work per step, the other ranks 0.1s"
    finally:
        done.set()
        for watch in watches:
            watch.stop()
    assert said[0] == []
    events = [json.loads(line) for line in (tmp_path / "out1" / STRAGGLERS_FILE).read_text().splitlines()]
    assert [(e["event"], e["rank"], e["busy_s"]) for e in events] == [("straggler", 1, 0.25), ("keeps pace", 1, 0.1)]
    assert not (tmp_path / "out0" / STRAGGLERS_FILE).exists()


def test_a_watch_without_figures_names_nobody(tmp_path):
    said: list[str] = []
    watch = StragglerWatch(window=0.2, node="0", say=said.append, env={PROGRESS_DIR_VAR: str(tmp_path)}, interval=0.05)
    for step in range(1, 8):  # a script that does not call measure(): busy 0
        report(tmp_path, step, 0.0)
    watch.start({0: 0, 1: 1}, world_size=2)
    time.sleep(0.5)
    watch.stop()
    assert said == []
