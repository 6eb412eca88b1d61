import socket
import sys

import pytest

from trainpod.errors import ConfigError, UnreachableError, UsageError
from trainpod.launcher import preflight
from trainpod.launcher.launch import Target
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
    with pytest.raises(ConfigError, match="GLOO_SOCKET_IFNAME='nope0'"):
        preflight.check_interface(topology(interface="nope0", origins={"interface": "GLOO_SOCKET_IFNAME"}))
    preflight.check_interface(topology(interface="^docker", origins={"interface": "NCCL_SOCKET_IFNAME"}))
    with pytest.raises(ConfigError, match="NCCL_SOCKET_IFNAME='=nope0': NCCL reads it as exact names, and it matches no interface"):
        preflight.check_interface(topology(interface="=nope0", origins={"interface": "NCCL_SOCKET_IFNAME"}))


def test_what_the_job_imports_is_imported_first_and_named_when_missing(tmp_path, monkeypatch):
    missing = "raise ModuleNotFoundError(\"No module named 'fake_missing_dep'\", name='fake_missing_dep')"
    (tmp_path / "fake_missing_dep.py").write_text(missing)
    (tmp_path / "fake_broken.py").write_text("import no_such_inner_module_x")
    (tmp_path / "fake_crash.py").write_text("raise RuntimeError('the native library did not load')")
    monkeypatch.syspath_prepend(str(tmp_path))
    preflight.check_imports(["json"], "the job")
    with pytest.raises(ConfigError, match=r"^fake_missing_dep is not installed in .*: the example x needs it; pip install fake_\w+$"):
        preflight.check_imports(["fake_missing_dep"], "the example x")
    with pytest.raises(ConfigError, match="^fake_broken does not import in .*: it needs no_such_inner_module_x, which is not installed"):
        preflight.check_imports(["fake_broken"], "the job")
    with pytest.raises(ConfigError, match=r"^fake_crash does not import in .* \(RuntimeError: the native library did not load\)"):
        preflight.check_imports(["fake_crash"], "the job")
    with pytest.raises(ConfigError, match="pip install Pillow"):
        monkeypatch.setitem(sys.modules, "PIL", None)  # an import of PIL now fails as if missing
        preflight.check_imports(["PIL"], "the example imagenet-ddp")


def test_shm_matters_only_with_loader_workers_or_nccl_between_local_ranks():
    gloo = topology(nproc_per_node=2)
    assert preflight.shm_needed(gloo, Target.for_example("cifar10-ddp", env={})) == 0
    assert preflight.shm_needed(gloo, Target.for_example("imagenet-ddp", env={})) == 8192 * 2**20
    assert preflight.shm_needed(gloo, Target(command=("python", "x.py"))) == preflight.MIN_SHM_BYTES  # unknown: warn
    nccl = topology(nproc_per_node=2, backend="nccl")
    assert preflight.shm_needed(nccl, Target.for_example("cifar10-ddp", env={})) == preflight.MIN_SHM_BYTES


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


def test_nccl_on_a_cpu_torch_is_one_line_naming_where_nccl_came_from(monkeypatch):
    # The visible GPUs made nccl the default: the line names them and both fixes, not the ranks' TRAINPOD_BACKEND
    default = topology(backend="nccl", origins={"backend": "default (GPUs visible)"})
    with pytest.raises(ConfigError, match=r"^CUDA_VISIBLE_DEVICES='0,1' makes 2 GPU\(s\) visible, so the backend defaults to "
                                          r"nccl, but torch here \(.*\) is a CPU build: run a CUDA image \(trainpod:cuda\), or "
                                          r"set CUDA_VISIBLE_DEVICES= \(empty\) to train on the CPU with gloo$"):
        preflight.check_cuda_build(default, {"CUDA_VISIBLE_DEVICES": "0,1"}, cuda="")
    # asked for: the flag is a usage error (64), a variable a configuration error (78)
    with pytest.raises(UsageError, match=r"^--backend=nccl: torch here \(.*\) is a CPU build, without NCCL: run a CUDA"):
        preflight.check_cuda_build(topology(backend="nccl", origins={"backend": "--backend"}), {}, cuda="")
    with pytest.raises(ConfigError, match=r"^TRAINPOD_BACKEND=nccl: torch here"):
        preflight.check_cuda_build(topology(backend="nccl", origins={"backend": "TRAINPOD_BACKEND"}), {}, cuda="")
    preflight.check_cuda_build(default, {"CUDA_VISIBLE_DEVICES": "0"}, cuda="13.0")  # a CUDA build: the driver check's
    preflight.check_cuda_build(topology(), {"CUDA_VISIBLE_DEVICES": "0"}, cuda="")  # gloo on a CPU build
    # a ROCm build has no CUDA version but runs nccl (RCCL)
    from trainpod.launcher import devices

    monkeypatch.setattr(devices, "torch_cuda_version", lambda field="cuda": "6.4.43482" if field == "hip" else None)
    preflight.check_cuda_build(default, {"CUDA_VISIBLE_DEVICES": "0"})


def test_no_driver_check_without_gpus_or_for_a_cpu_torch():
    absent = (None, "nothing")
    preflight.check_cuda_driver(topology(), {"CUDA_VISIBLE_DEVICES": ""}, cuda="13.0", driver=absent)  # gloo, no GPU: the CPU path
    preflight.check_cuda_driver(topology(backend="nccl"), {}, cuda="", driver=absent)  # a CPU build: torch.version.cuda is None
    preflight.check_cuda_driver(topology(backend="nccl"), {}, cuda="99.0", driver=absent)  # a CUDA the table does not know


def test_the_host_name_and_shm_warnings_only_where_they_can_matter(monkeypatch, tmp_path):
    # The examples' output directory is ./output, which the preflight creates to check it is writable: here, in
    # tmp_path, not in the checkout, where a job of another test (pytest-xdist runs them side by side, in the same
    # working directory) would find it, or hold its lock (trainpod.supervisor.dirlock).
    monkeypatch.chdir(tmp_path)
    said = []
    monkeypatch.setattr(preflight, "check_shm", lambda log, **kwargs: said.append(("shm", kwargs["minimum"])))
    monkeypatch.setattr(preflight, "check_hostname", lambda log: said.append(("hostname",)))
    monkeypatch.setattr(preflight, "check_port_free", lambda topology: None)
    single = topology(nnodes=1, node_rank=0, nproc_per_node=2)
    preflight.run_preflight(single, {}, connect_timeout=1, log=print, target=Target.for_example("cifar10-ddp", env={}))
    assert said == []  # one node: nobody looks this host up by name; no DataLoader workers
    preflight.run_preflight(single, {}, connect_timeout=1, log=print, target=Target.for_example("imagenet-ddp", env={}))
    assert said == [("shm", 8192 * 2**20)]
    said.clear()
    preflight.run_preflight(topology(nnodes=2, node_rank=0), {}, connect_timeout=1, log=print,
                            target=Target.for_example("cifar10-ddp", env={}))
    assert said == [("hostname",)]


# --- etcd: asked for its version and API (a real etcd, Debian's etcd-server, started here) ---

def etcd_topology(backend, endpoint):
    from trainpod.topology import Rendezvous

    return topology(node_rank=None, origins={"rdzv_endpoint": "--rdzv-endpoint", "rdzv_backend": "--rdzv-backend"},
                    rendezvous=Rendezvous(backend=backend, endpoint=endpoint, id="t", min_nodes=1, max_nodes=2))


@pytest.fixture(scope="module")
def etcd_without_v2(tmp_path_factory):
    from fixtures.etcd import EtcdProcess

    with EtcdProcess(tmp_path_factory.mktemp("etcd")) as server:
        yield server


def test_torchs_etcd_backend_without_v2_is_78_naming_the_endpoint_and_both_fixes(etcd_without_v2):
    with pytest.raises(ConfigError) as caught:
        preflight.check_etcd(etcd_topology("etcd", etcd_without_v2.endpoint), 5, lambda m: None)
    line = str(caught.value)
    assert "\n" not in line and etcd_without_v2.endpoint in line
    assert "--enable-v2" in line and "--rdzv-backend etcd-v3" in line
    # etcd-v3 needs nothing more than the v3 API
    assert preflight.check_etcd(etcd_topology("etcd-v3", etcd_without_v2.endpoint), 5, lambda m: None).version.startswith("3.")


@pytest.mark.slow
def test_an_unreachable_etcd_is_a_bounded_wait_then_69_naming_the_endpoints():
    import time

    from fixtures.etcd import dead_endpoint

    endpoints = f"{dead_endpoint()},{dead_endpoint()}"
    started = time.monotonic()
    with pytest.raises(UnreachableError) as caught:
        preflight.check_etcd(etcd_topology("etcd-v3", endpoints), 2, lambda m: None)
    assert time.monotonic() - started < 30  # the 2 s bound, not a wait without end
    line = str(caught.value)
    assert "\n" not in line and all(e in line for e in endpoints.split(",")) and "--connect-timeout" in line


def test_a_wait_retries_every_tenth_of_a_second_at_first_then_once_a_second():
    assert [preflight._pause(s) for s in (0.0, 9.9, 10.0, 250.0)] == [0.1, 0.1, 1.0, 1.0]
    # the master's port: a connect that a closed port refuses at once
    assert [preflight._pause(s, preflight.PORT_RETRY_S) for s in (0.0, 9.9, 10.0)] == [0.02, 0.02, 1.0]


def test_an_output_directory_that_is_a_dangling_link_is_said_so(tmp_path):
    (tmp_path / "out").symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match=r"is not writable by uid \d+: it is a link to .*/gone, which does not exist; mount"):
        preflight.check_writable(str(tmp_path / "out"), "output directory {path}")
