"""The rendezvous generation against a real etcd: each run of a job gets a fresh rendezvous id."""

import threading

from trainpod.rendezvous import generation
from trainpod.rendezvous.etcd_http import EtcdClient


def test_a_job_starts_at_zero_and_each_closed_run_moves_it_once(etcd):
    client = EtcdClient(etcd.endpoint, 5)
    assert generation.current(client, "job-a") == 0
    assert generation.advance(client, "job-a", 0) == 1
    assert generation.advance(client, "job-a", 0) == 1  # the second node of the same run finds it moved
    assert generation.current(client, "job-a") == 1
    assert generation.current(client, "job-b") == 0  # another job: its own
    assert generation.run_id("job-a", 1) == "job-a.g1"


def test_nodes_ending_at_once_advance_it_by_one(etcd):
    client = EtcdClient(etcd.endpoint, 5)
    results = []
    threads = [threading.Thread(target=lambda: results.append(generation.advance(client, "job-c", 0))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [1] * 8 and generation.current(client, "job-c") == 1


def test_a_run_that_ends_while_a_node_waits_is_told_from_one_closed_before_it_came(etcd):
    client = EtcdClient(etcd.endpoint, 5)
    assert generation.ended_after(client, "job-d", 0, wait_s=0.3) is None  # closed before: its move was lost
    timer = threading.Timer(0.3, generation.advance, (client, "job-d", 0))  # the closing node moves it as it ends
    timer.start()
    try:
        assert generation.ended_after(client, "job-d", 0, wait_s=10) == 1
    finally:
        timer.cancel()
    assert generation.ended_after(client, "job-d", 0, wait_s=0) == 1  # moved already
    assert generation.ended_after(client, "job-d", 1, wait_s=0) is None
