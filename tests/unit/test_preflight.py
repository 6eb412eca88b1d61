import socket

import pytest

from trainpod import preflight
from trainpod.errors import ConfigError, UnreachableError
from trainpod.topology import Topology


def topology(**changes):
    values = dict(source="torchrun", nnodes=2, node_rank=1, nproc_per_node=1, master_addr="127.0.0.1",
                  master_port=1, backend="gloo", interface="lo", origins={"master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT"})
    values.update(changes)
    return Topology(**values)


def test_wait_for_master_returns_once_the_port_listens():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        preflight.wait_for_master(topology(master_port=port), "127.0.0.1", 5, {}, lambda m: None)


def test_port_in_use_on_the_master():
    with socket.socket() as server:
        server.bind(("", 0))
        server.listen()
        port = server.getsockname()[1]
        with pytest.raises(UnreachableError, match=f"master port {port} .MASTER_PORT. is already in use"):
            preflight.check_port_free(topology(node_rank=0, master_port=port))


def test_small_shm_warns_with_the_fix():
    messages = []
    preflight.check_shm(messages.append, path="/", minimum=2**62)
    assert messages and "--shm-size" in messages[0] and "--ipc=host" in messages[0]
    messages.clear()
    preflight.check_shm(messages.append, path="/", minimum=1)
    assert not messages


def test_proxy_summary():
    assert preflight.proxy_summary({}) == "no proxy variables set"
    summary = preflight.proxy_summary({"HTTPS_PROXY": "http://p:1", "NO_PROXY": "10.0.0.1"})
    assert "HTTPS_PROXY=http://p:1" in summary and "NO_PROXY=10.0.0.1" in summary


def test_a_configured_interface_must_exist():
    with pytest.raises(Exception, match="GLOO_SOCKET_IFNAME='nope0'"):
        preflight.check_interface(topology(interface="nope0", origins={"interface": "GLOO_SOCKET_IFNAME"}))
    preflight.check_interface(topology(interface="^docker", origins={"interface": "NCCL_SOCKET_IFNAME"}))


def test_launching_needs_torch(monkeypatch):
    preflight.check_torch()  # installed here
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="torch is not installed"):
        preflight.check_torch()
