"""trainpod.agent.committed: every node's budget sees the job's newest committed checkpoint, through real stores (the
raw c10d store, and the run's store of each rendezvous backend: c10d, etcd-v3, torch's etcd on a real etcd)."""

import signal
import threading
import time
import uuid
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from fixtures.ports import free_port  # noqa: E402
from fixtures.stores import store_host, until  # noqa: E402
from trainpod.agent.committed import SharedCommitted  # noqa: E402
from trainpod.rendezvous import exclusions  # noqa: E402


@pytest.fixture(params=["c10d", "etcd-v3", "etcd"])
def run_store(request):
    """Two clients of one run's store (two nodes), as exclusions.job_store() gives it to an elastic job's agent."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    run_id = f"committed-{uuid.uuid4().hex[:8]}"
    if request.param == "c10d":
        port = free_port()
        host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
        return host, dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    if request.param == "etcd-v3":
        from trainpod.rendezvous import etcd_v3

        endpoint = request.getfixturevalue("etcd").endpoint
        return tuple(exclusions.job_store(etcd_v3.create_handler(RendezvousParameters("etcd-v3", endpoint, run_id, 1, 2,
                                                                                        read_timeout=5))) for _ in range(2))
    pytest.importorskip("etcd")
    from torch.distributed.elastic.rendezvous import etcd_rendezvous

    endpoint = request.getfixturevalue("etcd_v2").endpoint
    return tuple(exclusions.job_store(etcd_rendezvous.create_rdzv_handler(RendezvousParameters("etcd", endpoint, run_id, 1, 2,
                                                                                                timeout=30))) for _ in range(2))


@pytest.mark.slow
def test_the_saving_node_s_commit_reaches_the_other_node_and_an_older_one_never_lowers_it(run_store):
    saving, other = [-1], [-1]
    node0 = SharedCommitted(run_store[0], lambda: saving[0]).start(poll_s=0.05)
    node1 = SharedCommitted(run_store[1], lambda: other[0]).start(poll_s=0.05)
    try:
        saving[0] = 4
        until(lambda: node1.job == 4)  # the other node's ranks never reported step 4: they resume from it later
        other[0] = 4  # they did resume from it
        saving[0] = 8
        until(lambda: node1.job == 8 and node0.job == 8)
        other[0] = 6  # a node whose ranks report an older step (they resumed before the newer commit)
        time.sleep(0.3)
        assert node0.publish() == node1.publish() == 8
    finally:
        node0.close()
        node1.close()


def test_a_fresh_look_at_a_failure_finds_a_commit_the_thread_has_not_polled_yet():
    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    other = SharedCommitted(dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False), lambda: -1)
    assert other.fresh() == -1
    SharedCommitted(host, lambda: 12).publish()  # the saving node, a moment before this node's failure
    assert other.job == -1 and other.fresh() == 12  # no poll since: the failure's own look finds it


@pytest.mark.slow
def test_a_store_that_stopped_answering_holds_a_failure_at_most_the_fresh_look_s_bound():
    port = free_port()
    with store_host(port, timeout_s=60) as server:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
        node = SharedCommitted(client, lambda: 4)
        assert node.publish() == 4
        server.send_signal(signal.SIGSTOP)  # its host frozen: requests wait for an answer that does not come
        started = time.monotonic()
        assert node.fresh(wait=1.0) == 4  # this node's own step, at least
        assert time.monotonic() - started < 30  # the 1 s bound, not the store's 60 s timeout
    for thread in threading.enumerate():  # its request fails as the store goes: c10d's warning is this test's output,
        if thread.name == "trainpod-committed-fresh":  # not written into a later test's on this worker (CI, fresh94)
            thread.join(10)
