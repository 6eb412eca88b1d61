"""trainpod.rendezvous.presence: a node whose agent's process ends leaves the rendezvous at once, seen by its peers.

The listeners that go away are real processes killed with SIGKILL; the rendezvous is torch's, over a TCPStore, with
heartbeats that would take ten minutes to lapse."""

import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest

from fixtures.ports import free_port
from trainpod.rendezvous import presence

LISTENER = """
import sys, time
from trainpod.rendezvous.presence import Presence
print(Presence("127.0.0.1", sys.argv[1], sys.argv[2]).address, flush=True)
time.sleep(600)
"""


@pytest.fixture(autouse=True)
def no_presence_left():
    yield
    presence.stop()


@pytest.fixture
def listener():
    """listener(run, node): a process whose agent-like listener says `run` and `node`; its address and the process."""
    started = []

    def start(run: str, node: str):
        proc = subprocess.Popen([sys.executable, "-c", LISTENER, run, node], stdout=subprocess.PIPE, text=True)
        started.append(proc)
        return proc.stdout.readline().strip(), proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def until(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_a_peer_killed_is_gone_at_once_and_only_its_older_heartbeats_expire(listener):
    watcher = presence.Presence("127.0.0.1", "job", "a")
    address, peer = listener("job", "b")
    watcher.watch({"b": address, "a": watcher.address})  # its own listener is not watched
    assert until(lambda: watcher.watching() == {"b"})
    assert watcher.gone() == set()
    before = datetime.now(timezone.utc)
    peer.send_signal(signal.SIGKILL)
    assert until(lambda: watcher.gone() == {"b"})
    heartbeats = {"b": before, "c": before}
    watcher.expire(heartbeats)
    assert heartbeats["b"] < before - timedelta(days=365) and heartbeats["c"] == before  # c: never seen to go
    later = {"b": datetime.now(timezone.utc) + timedelta(seconds=1)}  # written after the loss: a node started anew
    watcher.expire(later)
    assert later["b"] > before
    watcher.close()


@pytest.mark.slow
def test_only_a_greeting_of_the_same_run_and_node_makes_a_watch(listener, monkeypatch):
    """Another run's listener, another node's, a port that accepts and says nothing, a closed port: none of them is
    watched, and none of them is gone when it ends. The test runs past the timers: greetings given up and retried."""
    monkeypatch.setattr(presence, "CONNECT_S", 0.2)
    monkeypatch.setattr(presence, "RETRY_S", 0.2)
    other_run, other_run_proc = listener("other", "b")
    other_node, other_node_proc = listener("job", "x")
    silent = socket.create_server(("127.0.0.1", 0))  # its backlog accepts the connection; nobody greets
    closed = free_port()
    watcher = presence.Presence("127.0.0.1", "job", "a")
    watcher.watch({"b": other_run, "c": other_node, "d": f"127.0.0.1:{silent.getsockname()[1]}",
                   "e": f"127.0.0.1:{closed}", "f": "no port here"})
    time.sleep(1.5)
    assert watcher.watching() == set()
    other_run_proc.send_signal(signal.SIGKILL)
    other_node_proc.send_signal(signal.SIGKILL)
    silent.close()
    time.sleep(1.0)
    assert watcher.watching() == set() and watcher.gone() == set()
    watcher.close()


def test_a_node_no_longer_listed_is_let_go_and_its_end_says_nothing(listener):
    watcher = presence.Presence("127.0.0.1", "job", "a")
    address, peer = listener("job", "b")
    watcher.watch({"b": address})
    assert until(lambda: watcher.watching() == {"b"})
    watcher.watch({})  # left the rendezvous' state (its heartbeat lapsed, or it left)
    assert until(lambda: watcher.watching() == set())
    peer.send_signal(signal.SIGKILL)
    peer.wait()
    time.sleep(0.5)
    assert watcher.gone() == set()
    watcher.close()


def test_beyond_watched_max_an_agent_watches_the_nodes_after_it_on_a_ring(monkeypatch):
    monkeypatch.setattr(presence, "WATCHED_MAX", 2)
    nodes = {name: presence.Presence("127.0.0.1", "job", name) for name in "abcde"}
    listed = {name: node.address for name, node in nodes.items()}
    for watcher, after in ((nodes["b"], {"c", "d"}), (nodes["e"], {"a", "b"})):
        watcher.watch(listed)
        assert until(lambda watcher=watcher, after=after: watcher.watching() == after), watcher.watching()
    for node in nodes.values():
        node.close()


def test_publish_puts_only_this_agents_listener_and_seen_forgets_nodes_swept_from_the_state(listener):
    class Handler:
        _this_node = "a"

        @staticmethod
        def get_run_id():
            return "job"

    mine = presence.start(Handler(), "127.0.0.1")
    address, _ = listener("job", "b")
    state = SimpleNamespace(last_heartbeats={"a": 1, "b": 1})
    presence.publish(state, "a")
    presence.publish(state, "b")  # not this agent's node: it publishes its own
    assert state.trainpod_presence == {"a": mine.address}
    state.trainpod_presence["b"] = address
    state.trainpod_presence["gone"] = "127.0.0.1:1"
    presence.seen(state)
    assert state.trainpod_presence == {"a": mine.address, "b": address}  # "gone" has no heartbeat in the state
    assert until(lambda: mine.watching() == {"b"})


@pytest.mark.slow
def test_the_survivors_of_a_node_whose_agent_died_meet_without_waiting_for_its_heartbeat_to_lapse():
    """Three nodes of an elastic job (--nnodes 2:3) meet; the third, a process of its own with its listener, gets SIGKILL.
    Its heartbeat would lapse after 10 minutes; the two survivors meet at world 2 once the one with a listener saw it
    go (the other has none, as a node of bare torchrun), where meet() gives up after 100 s."""
    pytest.importorskip("torch")
    from fixtures.rendezvous_nodes import elastic_handler, meet, node_process, store_server

    server, port = store_server()
    made = [elastic_handler(port, "presence", 2, 3, keep_alive_max_attempt=600) for _ in range(2)]
    mine = presence.start(made[0], "127.0.0.1")
    third = node_process(port, "presence", 2, 3, keep_alive_max_attempt=600)
    try:
        worlds: dict = {}
        first = threading.Thread(target=lambda: worlds.update(meet(made)), daemon=True)
        first.start()
        assert third.stdout.readline() == "world 3\n", "the third node never joined"
        first.join(100)
        assert sorted(world for _, world in worlds.values()) == [3, 3], worlds
        assert until(lambda: len(mine.watching()) == 1)  # the third's listener, published as it joined
        third.send_signal(signal.SIGKILL)
        assert sorted(world for _, world in meet(made).values()) == [2, 2]
        assert len(mine.gone()) == 1
    finally:
        third.kill()
        third.wait()
        third.stdout.close()
        del server  # the TCPStore's server lived until here
