"""The stop key in the rendezvous store: one node stops, every node learns it; a lost master is noticed."""

import contextlib
import threading
import time

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from fixtures.ports import free_port  # noqa: E402
from fixtures.stores import store_host, until  # noqa: E402
from trainpod.agent import control  # noqa: E402
from trainpod.agent.control import JobControl  # noqa: E402


def store(port, host=False):
    from datetime import timedelta

    return dist.TCPStore("127.0.0.1", port, is_master=host, wait_for_workers=False, timeout=timedelta(seconds=10))


def nodes(port, nnodes=2, committed=(lambda: -1, lambda: -1)):
    lines = []
    made = [JobControl(store(port, host=rank == 0), node_rank=rank, nnodes=nnodes, is_host=rank == 0, master=("127.0.0.1", port),
                       committed=committed[rank], say=lines.append) for rank in range(nnodes)]
    return made, lines


def test_a_stop_announced_by_one_node_is_seen_by_the_others_and_counted():
    (node0, node1), _ = nodes(free_port())
    try:
        stop = node0.announce(143, "node 0 received SIGTERM")
        assert stop == control.Stop(143, 0, "node 0 received SIGTERM") and node0.announced
        until(lambda: node1.stop is not None)
        assert node1.stop == stop and not node1.announced
        started = time.monotonic()
        node0.wait_seen(timeout=5)  # node 1 counted itself: no need to wait the whole bound
        assert time.monotonic() - started < 4  # not the whole 5 s bound
        assert node1.announce(3, "too late") == stop  # the first stop wins
    finally:
        node0.close()
        node1.close()


def test_node_zero_keeps_the_store_up_at_most_the_bound_when_nobody_acknowledges():
    (node0,), _ = nodes(free_port(), nnodes=1)
    node0.nnodes = 3  # two other nodes that never look
    node0.announce(143, "stop")
    started = time.monotonic()
    node0.wait_seen(timeout=1.0)
    assert 0.9 <= time.monotonic() - started < 10  # the bound, not a wait without end
    node0.close()


@pytest.mark.slow
def test_the_committed_step_of_the_writers_node_reaches_the_others():
    committed = [-1]
    (node0, node1), _ = nodes(free_port(), committed=(lambda: committed[0], lambda: 4))
    try:
        committed[0] = 12
        until(lambda: node1.job_committed == 12)
        until(lambda: node0.job_committed == 12)
    finally:
        node0.close()
        node1.close()


@pytest.mark.slow
def test_a_master_that_went_away_is_noticed_and_waited_for_a_bounded_time():
    port = free_port()
    with store_host(port) as server:
        node1 = JobControl(store(port), node_rank=1, nnodes=2, is_host=False, master=("127.0.0.1", port), say=lambda line: None)
        assert node1.reachable_now() and node1.unreachable_s() == 0
        server.kill()  # the master's agent killed: its store goes with it
        server.wait()
        assert not node1.reachable_now()
        until(lambda: node1.unreachable_s() > 0)
        started = time.monotonic()
        assert not control.wait_for_port(node1.master, 1.5)
        assert 1.4 <= time.monotonic() - started < 10  # the bound, not a wait without end
        node1.close()


@pytest.mark.slow
def test_a_stop_is_seen_while_the_agent_waits_on_the_same_store_for_another_node():
    # The agent's main thread waits on the job's store as long as the slowest node takes (torch's rank assignment
    # after a round, its exit barrier). Node 1's control was given that client: its polls must not queue behind the
    # wait, or node 0's stop (and the master's liveness) reach it only once the wait is over.
    port = free_port()
    node0 = JobControl(store(port, host=True), node_rank=0, nnodes=2, is_host=True, master=("127.0.0.1", port),
                       say=lambda line: None)
    agents = store(port)
    node1 = JobControl(agents, node_rank=1, nnodes=2, is_host=False, master=("127.0.0.1", port), say=lambda line: None)
    waited = threading.Thread(target=_wait, args=(agents, 8))
    try:
        waited.start()
        time.sleep(0.5)  # the wait is on: a request on its client would queue behind it
        stop = node0.announce(143, "node 0 received SIGTERM")
        until(lambda: node1.stop is not None, timeout=6)  # its polls, once a second, not after the 8 s wait
        assert node1.stop == stop and waited.is_alive()
        assert node1.unreachable_s() == 0
    finally:
        waited.join()
        node1.close()
        node0.close()


def _wait(client, seconds: float) -> None:
    from datetime import timedelta

    with contextlib.suppress(Exception):  # the wait times out: nobody sets the key
        client.wait(["trainpod/test/never"], timedelta(seconds=seconds))


def test_a_fresh_look_after_a_failure_finds_a_stop_set_a_moment_ago():
    (node0, node1), _ = nodes(free_port())
    try:
        time.sleep(0.2)  # both threads just polled: the next poll is a second away
        stop = node1.announce(143, "node 1 received SIGTERM")
        assert node0.reachable_now() and node0.stop == stop  # at once, not at the thread's next poll
    finally:
        node0.close()
        node1.close()
