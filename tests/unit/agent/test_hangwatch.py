"""trainpod.agent.hangwatch on real processes (no torch): a 'rank' idle inside a torch.distributed file and
one sleeping elsewhere make a verdict within the timeout; both are killed and their stacks written."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_hang import BACKWARD, run, stopped, waiting

from trainpod.agent import hangwatch, stacks
from trainpod.contract import PROGRESS_DIR_VAR

pytestmark = pytest.mark.skipif(not stacks.pyspy_path(), reason="py-spy is not installed (requirements-dev.txt)")

COLLECTIVE = "import time\ndef all_reduce():\n    time.sleep(60)\n"
WAITER = "import sys; sys.path.insert(0, sys.argv[1]); print('ready', flush=True)\nfrom torch.distributed import fake\nfake.all_reduce()\n"
SLEEPER = "import time; print('ready', flush=True)\ndef load_batch():\n    time.sleep(60)\nload_batch()\n"


def spawn(code: str, *args: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    assert process.stdout.readline() == "ready\n"
    return process


@pytest.fixture
def ranks(tmp_path):
    package = tmp_path / "lib" / "torch" / "distributed"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "fake.py").write_text(COLLECTIVE)
    processes = [spawn(WAITER, str(tmp_path / "lib")), spawn(SLEEPER)]
    yield processes
    for process in processes:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_a_waiting_rank_and_an_idle_one_make_a_verdict_both_are_killed_and_their_stacks_written(ranks, tmp_path):
    lines = []
    env = {"TRAINPOD_PROGRESS_DIR": str(tmp_path / "progress"), "TRAINPOD_OUTPUT_DIR": str(tmp_path / "out")}
    watch = hangwatch.Watch(timeout=2.0, node="3", say=lines.append, env=env)
    watch.prepare()
    started = time.monotonic()
    watch.start([hangwatch.Worker(6, 0, ranks[0].pid), hangwatch.Worker(7, 1, ranks[1].pid)], world_size=8)
    while watch.verdict() is None:
        assert time.monotonic() - started < 15, lines
        time.sleep(0.1)
    elapsed = time.monotonic() - started
    watch.stop()

    assert elapsed >= 2.0, elapsed  # not before the timeout (and within the loop's 15 s)
    assert [p.wait(timeout=5) for p in ranks] == [-9, -9]
    assert len(lines) == 1, lines
    assert ("behind: rank 7 idle (no CPU, same stack) at <string>:3 in load_batch, no step reported; "
            "rank 6 waits for it in all_reduce") in lines[0]
    assert re.search(r"; stacks in \S+/out/hangs/\S+-node3$", lines[0]), lines[0]  # what follows is the policy's line
    [directory] = (tmp_path / "out" / "hangs").glob("*-node3")
    assert "fake.py:3" in (directory / "rank6.txt").read_text()
    assert "in load_batch" not in (directory / "rank6.txt").read_text() and "load_batch" in (directory / "rank7.txt").read_text()
    summary = json.loads((directory / "hang.json").read_text())
    assert [v["rank"] for v in summary["behind"]] == [7]


@pytest.mark.slow
def test_a_one_rank_job_idle_outside_a_collective_is_named_and_killed_after_the_timeout(tmp_path):
    rank = spawn(SLEEPER)
    try:
        lines = []
        watch = hangwatch.Watch(timeout=2.0, node="0", say=lines.append, env={"TRAINPOD_PROGRESS_DIR": str(tmp_path),
                                                                            "TRAINPOD_OUTPUT_DIR": str(tmp_path / "out")})
        watch.prepare()
        started = time.monotonic()
        watch.start([hangwatch.Worker(0, 0, rank.pid)], world_size=1)
        while watch.verdict() is None:
            assert time.monotonic() - started < 15, lines
            time.sleep(0.1)
        assert time.monotonic() - started >= 2.0
        watch.stop()
        assert rank.wait(timeout=5) == -9
        assert lines[0].startswith("hang: no progress for ") and ("; every rank is idle, none computing or in a "
                                                                  "collective: rank 0 idle (no CPU, same stack) at "
                                                                  "<string>:3 in load_batch, no step reported; ") in lines[0]
    finally:
        rank.kill()
        rank.wait()


@pytest.mark.slow
def test_busy_ranks_make_no_verdict(tmp_path):
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        watch = hangwatch.Watch(timeout=1.0, node="0", say=print, env={"TRAINPOD_PROGRESS_DIR": str(tmp_path)})
        watch.start([hangwatch.Worker(r, r, p.pid) for r, p in enumerate(busy)], world_size=2)
        time.sleep(3)
        assert watch.verdict() is None
        watch.stop()
    finally:
        for process in busy:
            process.kill()
            process.wait()


def test_the_agent_exports_where_the_ranks_report(tmp_path):
    watch = hangwatch.Watch.wanted(7.0, "0", print, {PROGRESS_DIR_VAR: str(tmp_path)})
    assert watch.timeout == 7 and watch.interval == 0.7
    assert watch.progress_dir == tmp_path
    assert hangwatch.Watch.wanted(0.0, "0", print) is None
    (tmp_path / "rank0").write_text("kept: the restart budget reads the last group's committed step")
    (tmp_path / "rank0.dump").write_text("")
    (tmp_path / "nccl-dump-3.pipe").write_text("")
    (tmp_path / "other").write_text("kept")
    watch.prepare()
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["other", "rank0"]


def test_reports_of_the_previous_worker_group_are_not_this_groups_steps(tmp_path):
    from trainpod.train import progress

    watch = hangwatch.Watch(timeout=5.0, node="0", say=print, env={"TRAINPOD_PROGRESS_DIR": str(tmp_path)})
    (tmp_path / "rank0").write_bytes(progress.encode(progress.Record(step=40, committed=40, time=time.time() - 60)))
    watch.prepare()
    watch._workers = [hangwatch.Worker(0, 0, os.getpid())]
    [view] = watch._look({0: hangwatch.Tracker(0, "0")}, lambda local: None)
    assert view.step == -1


class Store:
    """The part of torch's c10d Store API that hangwatch.Sharing uses, in memory (one store, several agents)."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(key in self.data for key in keys)

    def add(self, key, amount):
        self.data[key] = str(int(self.data.get(key, b"0")) + amount).encode()
        return int(self.data[key])


def test_a_node_whose_ranks_only_wait_learns_from_the_store_which_rank_on_another_node_is_behind():
    store = Store()
    node0, node1 = hangwatch.Sharing(store, 0, 2), hangwatch.Sharing(store, 1, 2)
    busy = [run(0, lambda t: ("R", float(t), t, None), 3), run(1, lambda t: ("R", float(t), t, None), 3)]
    assert node0.exchange(busy) == ([], None) and store.data["trainpod/hang/node0"] == b"[]"

    mine = [run(0, waiting(BACKWARD), 15), run(1, waiting(BACKWARD), 15)]
    theirs = [run(2, stopped, 15, node="1"), run(3, waiting(BACKWARD), 15, node="1")]
    assert node1.exchange(theirs)[0] == []  # node0 has published nothing noteworthy yet
    remote, verdict = node0.exchange(mine)
    assert verdict is None and [v.rank for v in remote] == [2, 3] and node0.involved == 2
    found = hangwatch.decide(mine + remote, 15.0, timeout=10, world_size=4)
    assert [v.rank for v in found.behind] == [2] and found.behind[0].node == "1"

    node0.announce(found)
    _, told = node1.exchange(theirs)  # node1 acts on node0's verdict: the same ranks named
    assert [v.rank for v in told.behind] == [2] and told.stalled_for == found.stalled_for
    node1.acknowledge(timeout=0.1)
    started = time.monotonic()
    node0.acknowledge(timeout=5)
    assert time.monotonic() - started < 4  # both nodes have written their stacks: not the 5 s bound


def test_a_store_that_fails_leaves_the_node_to_judge_alone():
    class Gone:
        def __getattr__(self, name):
            raise RuntimeError("Connection reset by peer")

    sharing = hangwatch.Sharing(Gone(), 1, 2)
    assert sharing.exchange([run(2, stopped, 3)]) == ([], None) and sharing.failed


def test_a_verdict_becomes_a_failed_worker_group_with_124_for_the_first_rank_behind():
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    class Torch:
        def _monitor_workers(self, worker_group):
            return RunResult(state=WorkerState.HEALTHY)

    class Verdicts:
        def __init__(self, verdict):
            self.value = verdict

        def verdict(self):
            return self.value

    class Agent(hangwatch.WatchedAgent, Torch):
        pass

    group = SimpleNamespace(workers=[SimpleNamespace(global_rank=2, local_rank=0, id=11),
                                     SimpleNamespace(global_rank=3, local_rank=1, id=12)])
    agent = Agent()
    agent.hang_watch = Verdicts(None)
    assert agent._monitor_workers(group).state == WorkerState.HEALTHY
    agent.hang_watch = Verdicts(hangwatch.Verdict(behind=(run(3, stopped, 12, node="1"),),
                                                  waiting=(run(2, waiting(), 12, node="1"),), stalled_for=12.0))
    result = agent._monitor_workers(group)
    assert result.is_failed() and list(result.failures) == [3] and hangwatch.said(result)
    assert (result.failures[3].exitcode, result.failures[3].local_rank, result.failures[3].pid) == (124, 1, 12)
