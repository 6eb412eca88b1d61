"""The agent relies on torch's private API (see trainpod/agent/agent.py): a torch upgrade that removes it fails here."""

import time
from argparse import Namespace

import pytest

torch = pytest.importorskip("torch")

from trainpod.agent import agent  # noqa: E402


def test_the_private_torch_api_the_agent_uses_is_there():
    missing = agent.torch_internals_missing()
    assert not missing, (
        f"torch {torch.__version__} lacks what trainpod.agent relies on: {'; '.join(missing)}. "
        f"It was checked with torch {', '.join(agent.CHECKED_WITH)}: adapt agent.py, then add this version to CHECKED_WITH"
    )


def test_the_installed_torch_is_one_the_agent_was_checked_with():
    assert torch.__version__.split("+")[0] in agent.CHECKED_WITH, (
        f"torch {torch.__version__} is not in trainpod.agent.agent.CHECKED_WITH {agent.CHECKED_WITH}: read the agent's use of "
        "torch's private API against it, then add it"
    )


def test_keep_alive_ttl_sets_torchs_etcd_backend_constant_and_a_bad_value_is_one_line(monkeypatch):

    from torch.distributed.elastic.rendezvous import etcd_rendezvous

    monkeypatch.setattr(etcd_rendezvous, "CONST_WORKER_KEEPALIVE_TTL", 10)  # torch's value, restored afterwards
    assert agent._set_etcd_keep_alive_ttl(Namespace(rdzv_backend="etcd-v3", rdzv_conf="keep_alive_ttl=3")) is None
    assert etcd_rendezvous.CONST_WORKER_KEEPALIVE_TTL == 10  # the key is torch's etcd backend's only
    assert agent._set_etcd_keep_alive_ttl(Namespace(rdzv_backend="etcd", rdzv_conf="last_call_timeout=3")) is None
    assert etcd_rendezvous.CONST_WORKER_KEEPALIVE_TTL == 10
    assert agent._set_etcd_keep_alive_ttl(Namespace(rdzv_backend="etcd", rdzv_conf="timeout=300,keep_alive_ttl=4")) is None
    assert etcd_rendezvous.CONST_WORKER_KEEPALIVE_TTL == 4
    for bad in ("1", "0.5", "x", "3601"):
        line = agent._set_etcd_keep_alive_ttl(Namespace(rdzv_backend="etcd", rdzv_conf=f"keep_alive_ttl={bad}"))
        assert line == f"--rdzv-conf keep_alive_ttl={bad!r}: expected whole seconds from 2 to 3600"
    assert etcd_rendezvous.CONST_WORKER_KEEPALIVE_TTL == 4


def test_a_waiting_node_polls_the_rendezvous_faster_than_torchs_second_and_skews_its_first_join_less(monkeypatch):
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    from trainpod.agent import policy

    assert [policy.rendezvous_poll_s(n) for n in (1, 2, 10, 50, 100, 1000)] == [0.02, 0.02, 0.1, 0.5, 1.0, 1.0]
    assert [policy.rendezvous_skew_s(n) for n in (1, 2, 10, 30, 1000)] == [0.01, 0.02, 0.1, 0.3, 0.3]
    store = dist.HashStore()
    handler = dynamic_rendezvous.DynamicRendezvousHandler.from_backend(
        "poll", store, C10dRendezvousBackend(store, "poll"), 2, 4)
    assert handler._state_holder._cache_duration == 1  # torch's
    monkeypatch.setattr(dynamic_rendezvous, "_delay", dynamic_rendezvous._delay)  # restored after the test
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)  # what torch's _delay sleeps
    policy._poll_rendezvous_faster(handler, 4)
    policy._poll_rendezvous_faster(handler, 4)  # a second agent in this process wraps torch's, not ours
    assert handler._state_holder._cache_duration == 0.04
    dynamic_rendezvous._delay(seconds=1)  # the executor's poll while a node waits
    dynamic_rendezvous._delay(seconds=(0.2, 0.2))  # the first round's skew: at most 0.04 s for 4 nodes
    dynamic_rendezvous._delay(seconds=0.5)  # any other delay: torch's
    assert slept == [0.04, 0.04, 0.5]


@pytest.mark.slow
def test_each_rendezvous_round_gives_the_workers_a_new_store_hosted_by_the_agent(monkeypatch):
    # torch's handler keeps its first round's workers' store for the agent's life: restarted ranks read the
    # dead ones' keys (pytorch#135712). Each round here has a new one, and the last round's closes.
    import socket
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    from fixtures.ports import free_port
    from trainpod.agent import policy

    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    handler = dynamic_rendezvous.DynamicRendezvousHandler.from_backend(
        "fresh", store, C10dRendezvousBackend(store, "fresh"), 1, 1, local_addr="127.0.0.1")
    assert handler.use_agent_store  # torch's default: the workers use the agent's store
    policy._fresh_workers_store(handler)
    policy._fresh_workers_store(handler)  # a second agent in this process wraps torch's, not ours
    ports = []
    for _ in range(2):
        info = handler.next_rendezvous().bootstrap_store_info
        ports.append(info.master_port)
        with socket.create_connection((info.master_addr, info.master_port), timeout=5):
            pass  # the agent hosts it already: no worker waits for rank 0's process to start one
    assert ports[0] != ports[1]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", ports[0]), timeout=5).close()  # the first round's store is gone
    handler.shutdown()
