"""The etcd-v3 rendezvous backend and store against a real etcd (started without --enable-v2)."""

import http.server
import threading
import time
import uuid
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.rendezvous import (  # noqa: E402
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler  # noqa: E402

from fixtures.etcd import SilentEndpoint, dead_endpoint  # noqa: E402
from trainpod.rendezvous import etcd_v3  # noqa: E402
from trainpod.rendezvous.etcd_http import EtcdClient  # noqa: E402


def params(endpoint, run_id=None, **conf):
    conf.setdefault("read_timeout", 5)
    return RendezvousParameters("etcd-v3", endpoint, run_id or f"test-{uuid.uuid4().hex[:8]}", 1, 2, **conf)


def backend(endpoint, run_id=None, **conf):
    return etcd_v3.create_backend(params(endpoint, run_id, **conf))[0]


def test_get_state_of_a_new_run_is_none(etcd):
    assert backend(etcd.endpoint).get_state() is None


def test_set_state_without_token_creates_once(etcd):
    b = backend(etcd.endpoint)
    state, token, done = b.set_state(b"first")
    assert (state, done) == (b"first", True)
    assert b.get_state() == (b"first", token)
    # Without a token only a missing state is set: the existing one comes back, unchanged.
    assert b.set_state(b"second") == (b"first", token, False)
    assert b.get_state() == (b"first", token)


def test_a_stale_token_fails_and_returns_the_current_state(etcd):
    run_id = f"stale-{uuid.uuid4().hex[:8]}"
    a, b = backend(etcd.endpoint, run_id), backend(etcd.endpoint, run_id)
    _, token1, _ = a.set_state(b"one")
    state, token2, done = b.set_state(b"two", token1)
    assert (state, done) == (b"two", True) and token2 > token1
    assert a.set_state(b"three", token1) == (b"two", token2, False)  # token1 is stale now
    assert a.set_state(b"three", "not-a-token") == (b"two", token2, False)
    assert a.set_state(b"three", token2)[2] is True


def test_the_state_lives_in_one_key_per_run_id(etcd):
    run_id = f"key-{uuid.uuid4().hex[:8]}"
    backend(etcd.endpoint, run_id).set_state(b"mine")
    value, _ = EtcdClient(etcd.endpoint, 5).get(f"/trainpod/rdzv/{run_id}/state".encode())
    assert value == b"mine"
    assert backend(etcd.endpoint).get_state() is None  # another run id sees nothing of it


def test_two_handlers_race_and_exactly_one_wins(etcd):
    run_id = f"race-{uuid.uuid4().hex[:8]}"
    racers = [backend(etcd.endpoint, run_id) for _ in range(2)]
    racers[0].set_state(b"start")

    def race(i, round_, token, barrier, results):
        barrier.wait()
        results[i] = racers[i].set_state(f"round {round_} by {i}".encode(), token)

    for round_ in range(20):
        _, token = racers[0].get_state()
        barrier, results = threading.Barrier(2), [None, None]
        threads = [threading.Thread(target=race, args=(i, round_, token, barrier, results)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i in range(2) if results[i][2]]
        assert len(winners) == 1, results
        # The loser got the winner's state and token back.
        assert results[1 - winners[0]][:2] == results[winners[0]][:2] == racers[0].get_state()


def test_compare_and_set_loses_no_update_under_contention(etcd):
    run_id = f"count-{uuid.uuid4().hex[:8]}"
    workers, increments = 3, 30

    def count(b):
        for _ in range(increments):
            while True:
                current = b.get_state()
                value, token = current if current else (b"0", None)
                if b.set_state(str(int(value) + 1).encode(), token)[2]:
                    break

    threads = [threading.Thread(target=count, args=(backend(etcd.endpoint, run_id),)) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert backend(etcd.endpoint, run_id).get_state()[0] == str(workers * increments).encode()


def test_unreachable_endpoint_is_a_connection_error_naming_it():
    endpoint = dead_endpoint()
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=f"{endpoint}: connection refused"):
        backend(endpoint).get_state()
    assert time.monotonic() - started < 30  # refused at once, not retried until the read timeout (60 s by default)


def test_an_endpoint_that_never_answers_fails_within_the_read_timeout():
    with SilentEndpoint() as silent:
        b = backend(silent.endpoint, read_timeout=1)
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError) as raised:
            b.set_state(b"x")
        elapsed = time.monotonic() - started
    assert f"{silent.endpoint}: timed out after 1 s" in str(raised.value)
    assert "\n" not in str(raised.value)
    assert 0.9 < elapsed < 30  # the 1 s read timeout, not a wait without end (bounds far apart: a loaded machine)


def test_the_next_endpoint_is_tried_when_the_first_is_down(etcd):
    dead = dead_endpoint()
    b = backend(f"{dead},{etcd.endpoint}")
    assert b.set_state(b"via the second")[2] is True
    assert b.client.endpoint == etcd.endpoint  # and it sticks to the one that answered
    assert b.get_state()[0] == b"via the second"


@pytest.mark.slow
def test_the_state_expires_with_its_lease(etcd):
    b = backend(etcd.endpoint, ttl=2)
    b.set_state(b"abandoned")
    deadline = time.monotonic() + 10
    while b.get_state() is not None:
        assert time.monotonic() < deadline, "the state outlived its 2 s lease"
        time.sleep(0.2)


def test_the_lease_is_renewed_after_half_its_ttl_and_replaced_once_gone(etcd):
    client = EtcdClient(etcd.endpoint, 5)
    lease = etcd_v3.Lease(client, ttl=60)
    first = lease.id()
    assert lease.id() == first
    lease._renewed -= 31  # older than ttl/2: renewed, the same lease
    assert lease.id() == first and time.monotonic() - lease._renewed < 1
    client.call("/v3/lease/revoke", {"ID": str(first)})
    lease._renewed -= 31
    assert lease.id() != first  # gone: a new one
    # A put with a lease etcd no longer knows is retried once with a new one.
    b = etcd_v3.EtcdV3Backend(client, f"revoked-{uuid.uuid4().hex[:8]}", lease)
    client.call("/v3/lease/revoke", {"ID": str(lease.id())})
    assert b.set_state(b"after revoke")[2] is True


def test_read_timeout_and_endpoint_are_checked():
    with pytest.raises(ValueError, match="read_timeout"):
        etcd_v3.create_backend(params("127.0.0.1:2379", read_timeout=0))
    with pytest.raises(ValueError, match="endpoint"):
        etcd_v3.create_backend(params(""))


# --- the store ---------------------------------------------------------------------------------


def test_store_set_get_add_wait_check_through_a_prefix_store(etcd):
    _, store = etcd_v3.create_backend(params(etcd.endpoint))
    s = dist.PrefixStore("torch.rendezvous.x.0", store)  # as the handler hands it out
    s.set("a", "1")
    s.set("b", b"\x00\xff")
    assert s.get("a") == b"1" and s.get("b") == b"\x00\xff"
    assert s.multi_get(["a", "b"]) == [b"1", b"\x00\xff"]
    s.multi_set(["c", "d"], ["x", "y"])
    assert s.get("d") == b"y"
    assert s.add("n", 3) == 3 and s.add("n", -1) == 2
    assert s.check(["a", "c"]) and not s.check(["a", "missing"])
    s.wait(["a", "b"], timedelta(seconds=1))


def test_store_get_waits_for_the_key_and_times_out(etcd):
    _, store = etcd_v3.create_backend(params(etcd.endpoint))
    threading.Timer(0.3, store.set, args=("late", "here")).start()
    assert store.get("late") == b"here"
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timed out after 0.5 s"):
        store.wait(["never"], timedelta(seconds=0.5))
    assert time.monotonic() - started < 10  # the 0.5 s, not a wait without end


def test_store_add_is_atomic(etcd):
    run_id = f"add-{uuid.uuid4().hex[:8]}"
    stores = [etcd_v3.create_backend(params(etcd.endpoint, run_id))[1] for _ in range(3)]
    threads = [threading.Thread(target=lambda s=s: [s.add("k", 1) for _ in range(20)]) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stores[0].add("k", 0) == 60


# --- the handler -------------------------------------------------------------------------------


def test_register_is_idempotent_and_creates_dynamic_handlers(etcd):
    etcd_v3.register()
    etcd_v3.register()
    handler = rendezvous_handler_registry.create_handler(params(etcd.endpoint))
    assert isinstance(handler, DynamicRendezvousHandler)
    assert handler.get_backend() == "etcd-v3"


@pytest.mark.slow
def test_two_handlers_form_a_world_of_two(etcd):
    run_id = f"world-{uuid.uuid4().hex[:8]}"
    handlers = [etcd_v3.create_handler(RendezvousParameters("etcd-v3", etcd.endpoint, run_id, 2, 2, read_timeout=5,
                                                            local_addr="127.0.0.1", join_timeout=30))
                for _ in range(2)]  # fmt: skip
    infos = [None, None]

    def join(i):
        infos[i] = handlers[i].next_rendezvous()

    threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(info is not None for info in infos)
    assert sorted(info.rank for info in infos) == [0, 1]
    assert {info.world_size for info in infos} == {2}
    # Both got the same bootstrap store (rank 0's TCPStore), published through the etcd store.
    assert len({(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}) == 1
    assert time.monotonic() - started < 10
    client = EtcdClient(etcd.endpoint, 5)
    assert etcd_v3.closed(client, run_id) is False  # open while the run lasts: the agent keeps its generation
    for h in handlers:
        h.shutdown()
    assert handlers[0].is_closed()
    assert etcd_v3.closed(client, run_id) is True  # closed: the job's next run needs the next generation
    assert etcd_v3.closed(client, "no-such-run") is None


def test_the_store_waits_as_long_as_the_read_timeout(etcd):
    _, store = etcd_v3.create_backend(params(etcd.endpoint, read_timeout=7))
    assert store.timeout == timedelta(seconds=7)


class _Garbled(http.server.BaseHTTPRequestHandler):
    answer = b"{}"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.answer)))
        self.end_headers()
        self.wfile.write(self.answer)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("answer,match", [
    (b'{"kvs": [{"value": "not base64!", "mod_revision": "3"}]}', "not base64"),
    (b'{"kvs": [{"value": "YQ=="}]}', "would not give"),
])  # fmt: skip
def test_an_answer_etcd_would_not_give_is_a_state_error(answer, match):
    handler = type("Answer", (_Garbled,), {"answer": answer})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(RendezvousStateError, match=match):
            backend(f"127.0.0.1:{server.server_address[1]}").get_state()
    finally:
        server.shutdown()
        server.server_close()
