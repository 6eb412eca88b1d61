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


def test_a_cuda_13_torch_needs_driver_580_when_gpus_are_asked_for():
    nccl = topology(backend="nccl")
    preflight.check_cuda_driver(nccl, {}, cuda="13.0", driver=((580, 65, 6), "/proc/driver/nvidia/version"))
    with pytest.raises(ConfigError, match=r"built for CUDA 13.0, which needs an NVIDIA driver >= 580, and this host's is "
                                          r"575.57.8 \(/proc/driver/nvidia/version\): upgrade"):
        preflight.check_cuda_driver(nccl, {}, cuda="13.0", driver=((575, 57, 8), "/proc/driver/nvidia/version"))
    with pytest.raises(ConfigError, match=r">= 580, and none was found \(no /proc/driver/nvidia/version"):
        preflight.check_cuda_driver(nccl, {}, cuda="13.0", driver=(None, "no /proc/driver/nvidia/version, no nvidia-smi answer"))
    # GPUs given to a gloo job count as asked for too; a CUDA 12 torch needs 525.60.13
    with pytest.raises(ConfigError, match=">= 525.60.13"):
        preflight.check_cuda_driver(topology(), {"CUDA_VISIBLE_DEVICES": "0"}, cuda="12.8", driver=((520, 1), "nvidia-smi"))


def test_no_driver_check_without_gpus_or_for_a_cpu_torch():
    absent = (None, "nothing")
    preflight.check_cuda_driver(topology(), {"CUDA_VISIBLE_DEVICES": ""}, cuda="13.0", driver=absent)  # gloo, no GPU: the CPU path
    preflight.check_cuda_driver(topology(backend="nccl"), {}, cuda="", driver=absent)  # a CPU build: torch.version.cuda is None
    preflight.check_cuda_driver(topology(backend="nccl"), {}, cuda="99.0", driver=absent)  # a CUDA the table does not know
