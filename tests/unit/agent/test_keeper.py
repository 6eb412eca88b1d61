"""trainpod.agent.keeper: which ends of a rank are replaced, and a real keeper process forking real ranks."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from fixtures.ports import free_port
from trainpod.agent import keeper
from trainpod.contract import INPROCESS_MAX_VAR

pytest.importorskip("torch")

ENTRYPOINT = str(Path(__file__).resolve().parents[3] / "entrypoint")


def test_only_a_rank_killed_by_a_signal_that_is_no_stop_request_is_replaced():
    assert keeper.replaces(signal.SIGKILL, declared=True, left=1)
    assert keeper.replaces(signal.SIGSEGV, declared=True, left=1)
    assert not keeper.replaces(None, declared=True, left=1)  # an exit code is the agent's to judge
    for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        assert not keeper.replaces(stop, declared=True, left=1)  # the job is being stopped
    assert not keeper.replaces(signal.SIGKILL, declared=False, left=1)  # its script cannot re-form a group
    assert not keeper.replaces(signal.SIGKILL, declared=True, left=0)  # replaced often enough


# A keeper of global rank 0 (it hosts the store) whose rank does what BEHAVIOUR says in each generation.
KEEPER = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from trainpod.agent import keeper
    from trainpod.train import inprocess

    out = Path(sys.argv[1])
    behaviour = sys.argv[2]

    def counted(generation):  # whether the keeper said in the store that it counted this generation
        if not generation or os.environ.get("KEEPER_RANK", "0") != "0":
            return "-"
        from datetime import timedelta
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), timeout=timedelta(seconds=10))
        return str(store.check([inprocess.COUNTED_KEY.format(generation)]))

    def rank():
        generation = inprocess.generation()
        with open(out / "ranks", "a") as f:  # and the threads its keeper had when it forked this rank
            f.write(f"{generation} {os.getpid()} {os.getppid()} {len(os.listdir(f'/proc/{os.getppid()}/task'))} "
                    f"{counted(generation)}\\n")
        if behaviour != "undeclared":
            inprocess._declared[0] = 1  # what inprocess.init_process_group() does
        if behaviour == "sleep":
            (out / "ready").touch()
            time.sleep(60)
        if behaviour == "exit3":
            raise SystemExit(3)
        if behaviour == "always" or generation == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    def name(title):
        (out / "title").write_text(title)
        with open("/proc/self/comm", "w") as comm:
            comm.write(title)

    keeper.keep(rank, int(os.environ.get("KEEPER_RANK", "0")), name)
""")


def run_keeper(tmp_path, behaviour, limit="3", start_only=False, rank=0, port=None, agent_store=False):
    """A keeper of global rank `rank`; with `agent_store`, the store at `port` is the agent's (torch's agent sets
    TORCHELASTIC_USE_AGENT_STORE=True), else rank 0's keeper hosts one there."""
    env = {**os.environ, "PYTHONPATH": ENTRYPOINT, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port or free_port()),
           INPROCESS_MAX_VAR: limit, "KEEPER_RANK": str(rank)}
    env.pop(keeper.AGENT_STORE_VAR, None)
    if agent_store:
        env[keeper.AGENT_STORE_VAR] = "True"
    process = subprocess.Popen([sys.executable, "-c", KEEPER, str(tmp_path), behaviour], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if start_only:
        return process
    _, err = process.communicate(timeout=120)
    ranks = (tmp_path / "ranks").read_text().splitlines() if (tmp_path / "ranks").exists() else []
    return process.returncode, err, [line.split() for line in ranks]


def sleeping_keeper(tmp_path) -> subprocess.Popen:
    """A keeper whose rank sleeps, once the rank runs."""
    process = run_keeper(tmp_path, "sleep", start_only=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()
        time.sleep(0.05)
    return process


@pytest.mark.slow
def test_a_killed_rank_is_forked_again_in_the_next_generation_and_the_keeper_ends_as_it_did(tmp_path):
    code, err, ranks = run_keeper(tmp_path, "once")
    assert code == 0, err
    assert [r[0] for r in ranks] == ["0", "1"]
    assert ranks[0][1] != ranks[1][1] and ranks[0][2] == ranks[1][2]  # a new process, the same keeper parent
    assert ranks[1][4] == "True"  # every rank's watch wakes (trainpod.train.inprocess._watch)
    assert "trainpod: rank 0 (pid" in err and "was killed by SIGKILL: its replacement joins the other ranks in-process " \
        "(generation 1, 2 replacement(s) left)" in err
    assert (tmp_path / "title").read_text() == "keeper0"


@pytest.mark.slow
def test_rank_0s_keeper_forks_with_one_thread_and_its_store_serves_from_a_child_that_ends_with_it(tmp_path):
    # A TCPStore serves on a thread of its own. A keeper with that thread could fork a replacement that
    # holds a copy of a lock the thread held, and hangs: the store is a child.
    process = sleeping_keeper(tmp_path)
    _, rank, parent, threads, _ = (tmp_path / "ranks").read_text().split()
    assert (int(parent), threads) == (process.pid, "1")
    children = {child.pid: child for child in psutil.Process(process.pid).children()}
    store = [child for pid, child in children.items() if pid != int(rank)]
    assert sorted(children) == sorted([int(rank), store[0].pid]) and store[0].name() == "store0"
    assert keeper.rank_pid(process.pid) == int(rank)  # the rank, not the store (the hang watch reads its stack)
    assert store[0].num_threads() > 1  # it serves
    store[0].send_signal(signal.SIGTERM)  # ignored: the ranks may use the store until they end
    time.sleep(0.3)
    assert store[0].is_running() and store[0].status() != psutil.STATUS_ZOMBIE
    process.kill()
    process.wait(timeout=30)
    store[0].wait(timeout=10)  # gone with its keeper


@pytest.mark.slow
def test_where_the_agent_hosts_the_store_rank_0s_keeper_hosts_none_and_counts_the_generation_there(tmp_path):
    from datetime import timedelta

    import torch.distributed as dist

    port = free_port()
    agents = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    code, err, ranks = run_keeper(tmp_path, "once", port=port, agent_store=True)  # a second store there would not start
    assert code == 0, err
    assert [r[0] for r in ranks] == ["0", "1"] and ranks[1][4] == "True"
    assert int(agents.add(keeper.inprocess.GENERATION_KEY, 0)) == 1  # counted in the agent's store


@pytest.mark.slow
def test_replacements_stop_at_the_limit_and_the_keeper_dies_by_the_ranks_signal(tmp_path):
    code, err, ranks = run_keeper(tmp_path, "always", limit="2")
    assert code == -signal.SIGKILL, err
    assert [r[0] for r in ranks] == ["0", "1", "2"]


@pytest.mark.slow
def test_a_rank_that_cannot_recover_or_exits_with_a_code_is_not_replaced(tmp_path):
    code, err, ranks = run_keeper(tmp_path, "undeclared")
    assert (code, len(ranks)) == (-signal.SIGKILL, 1), err
    (tmp_path / "ranks").unlink()
    code, err, ranks = run_keeper(tmp_path, "exit3")
    assert (code, len(ranks)) == (3, 1), err


@pytest.mark.slow
def test_a_stop_request_reaches_the_rank_and_ends_both(tmp_path):
    process = sleeping_keeper(tmp_path)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == -signal.SIGTERM
    assert len((tmp_path / "ranks").read_text().splitlines()) == 1  # not replaced


@pytest.mark.slow
def test_a_store_that_cannot_listen_ends_rank_0s_keeper_with_one_line_before_any_rank(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, err, ranks = run_keeper(tmp_path, "once", port=taken.getsockname()[1])
    assert (code, ranks) == (1, []), err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainpod: rank 0: the workers' store at 127.0.0.1:"), err
    assert "did not start: " in lines[0] and "Traceback" not in err


@pytest.mark.slow
def test_without_rank_0s_keeper_and_its_store_a_killed_rank_is_not_replaced(tmp_path):
    code, err, ranks = run_keeper(tmp_path, "once", rank=1)  # rank 1's keeper: no store answers at MASTER_PORT
    assert (code, len(ranks)) == (-signal.SIGKILL, 1), err
    assert "trainpod: rank 1 (pid" in err and "was killed by SIGKILL; not replaced in-process: the workers' store at " \
        "127.0.0.1:" in err and "does not answer" in err
