"""trainpod.agent.round_gather on a real TCPStore: the node that hosts the store returns only once every node has read."""

import threading
import time

from torch.distributed import TCPStore

from trainpod.agent import round_gather

PREFIX = "test/"


def store_pair():
    host = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    return host, TCPStore("127.0.0.1", host.port, 2, is_master=False)


def gather_in_thread(store, rank: int, wait_s: float = 30) -> tuple[threading.Thread, dict]:
    seen: dict = {}
    thread = threading.Thread(target=lambda: seen.update(round_gather.all_gather(store, PREFIX, rank, 2, f"v{rank}", wait_s)))
    thread.start()
    return thread, seen


def test_the_store_host_stays_until_the_other_node_has_read():
    host, other = store_pair()
    thread, seen = gather_in_thread(host, 0)
    other.set(f"{PREFIX}1", "v1")  # node 1 published but has not read yet (a slower node)
    time.sleep(1.0)
    assert thread.is_alive()  # had it returned, its agent could exit 78 and take the store with it
    assert other.get(f"{PREFIX}0") == b"v0"
    other.set(f"{PREFIX}read/1", "1")
    thread.join(10)
    assert not thread.is_alive() and seen == {0: b"v0", 1: b"v1"}


def test_every_node_reads_the_same_values():
    host, other = store_pair()
    threads = [gather_in_thread(host, 0), gather_in_thread(other, 1)]
    for thread, _ in threads:
        thread.join(30)
    assert [seen for _, seen in threads] == [{0: b"v0", 1: b"v1"}] * 2


def test_a_node_that_only_publishes_does_not_hold_the_others():
    host, other = store_pair()
    thread, seen = gather_in_thread(host, 0)
    round_gather.publish(other, PREFIX, 1, "v1")
    thread.join(10)
    assert not thread.is_alive() and seen == {0: b"v0", 1: b"v1"}


def test_a_node_that_never_marks_costs_the_wait_and_what_was_read_stands():
    host, other = store_pair()
    other.set(f"{PREFIX}1", "v1")  # an older trainpod: it publishes, reads, and marks nothing
    started = time.monotonic()
    thread, seen = gather_in_thread(host, 0, wait_s=1.0)
    thread.join(10)
    assert seen == {0: b"v0", 1: b"v1"} and 1.0 <= time.monotonic() - started < 5
