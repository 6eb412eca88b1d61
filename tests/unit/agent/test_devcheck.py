"""trainpod.agent.devcheck: the verdict over every node's devices, NVML read through the real pynvml's errors, the
work on torch's CPU device, and the child process on this host (no CUDA: it checks nothing and says so)."""

from __future__ import annotations

import sys
import threading
import types

import pynvml
import pytest
import torch

from trainpod.agent import devcheck
from trainpod.agent.devcheck import Device, NodeDevices, Nvml, verdict

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"


def gpu(index: int, name: str = H100, gemm: float = 660.0, memory: float = 2900.0, peer: float | None = 380.0,
        **health) -> Device:
    fields = {"ecc_uncorrected": 0, "retired_pending": None, "remap_pending": False, "remap_failure": False, "xids": (),
              **health}
    return Device(index=index, name=name, bus=f"00000000:{0x18 + index:02X}:00.0", gemm_tflops=gemm, memory_gbs=memory,
                  peer_gbs=peer, **fields)


def node(host: str, *devices: Device, **kw) -> NodeDevices:
    return NodeDevices(host=host, devices=devices, **kw)


def eight(host: str, **changed: Device) -> NodeDevices:
    """A node of 8 H100s, with some GPUs given as g3=gpu(3, ...)."""
    return node(host, *(changed.get(f"g{k}", gpu(k)) for k in range(8)))


# ---- the verdict ----

def test_a_healthy_job_has_no_verdict_and_one_line_of_figures():
    job = {0: eight("a"), 1: eight("b", g2=gpu(2, gemm=640.0, memory=2850.0))}
    assert verdict(job) is None
    assert devcheck.summary(job) == (f"16 GPU(s) on 2 node(s) checked: {H100} x16: GEMM 640-660 TFLOP/s, "
                                     "memory copy 2850-2900 GB/s, copy to the next GPU 380 GB/s")


def test_a_slow_gpu_is_named_against_its_peers_with_its_figures():
    job = {0: eight("a"), 1: eight("b", g5=gpu(5, gemm=210.0)), 2: eight("c")}
    found = verdict(job)
    assert found is not None and found.ranks == {1}
    assert found.line == (f"node 1 (b) GPU 5 ({H100}, 00000000:1D:00.0): GEMM 210 TFLOP/s, below 0.5 x the median "
                          "660 of the job's 24 GPUs of this model")
    assert verdict(job, slow_fraction=0.3) is None  # 210 is above 0.3 x 660


def test_a_slow_gpu_is_found_within_one_node_and_a_lone_gpu_is_compared_with_none():
    assert verdict({0: eight("a", g0=gpu(0, memory=900.0))}).ranks == {0}
    assert verdict({0: node("a", gpu(0, gemm=1.0, memory=1.0, peer=None))}) is None  # no peer: nothing to compare


def test_models_are_compared_with_their_own_kind_only():
    a100s = node("b", *(gpu(k, A100, gemm=280.0, memory=1700.0, peer=250.0) for k in range(8)))
    assert verdict({0: eight("a"), 1: a100s}) is None  # half the H100's figures, and no finding
    slow = node("b", *(gpu(k, A100, gemm=120.0 if k == 6 else 280.0, memory=1700.0, peer=250.0) for k in range(8)))
    found = verdict({0: eight("a"), 1: slow})
    assert found.ranks == {1} and "GPU 6 (NVIDIA A100" in found.line and "median 280 of the job's 8 GPUs" in found.line


def test_copies_to_the_next_gpu_are_compared_at_the_same_place_only():
    # In every node GPU 3's link to GPU 4 crosses the sockets: slow, but alike on every node.
    alike = {r: eight(h, g3=gpu(3, peer=20.0)) for r, h in enumerate("abc")}
    assert verdict(alike) is None
    alike[1] = eight("b", g3=gpu(3, peer=6.0))
    found = verdict(alike)
    assert found.ranks == {1}
    assert found.line.endswith("copy to the next GPU 6 GB/s, below 0.5 x the median 20 of the 3 at this place on nodes of 8 such GPUs")


@pytest.mark.parametrize("health, words", [
    ({"ecc_uncorrected": 2}, "2 uncorrected ECC error(s) since the driver loaded or the GPU was reset"),
    ({"xids": (79, 43)}, "Xid 79 during the check"),
    ({"retired_pending": True}, "memory pages wait for a reset to be retired"),
    ({"remap_pending": True}, "a row remapping waits for a reset"),
    ({"remap_failure": True, "remap_pending": True}, "a row remapping failed"),
    ({"faults": ("memory copy returned other data",)}, "memory copy returned other data"),
])
def test_errors_the_gpu_reports_name_it(health, words):
    found = verdict({0: eight("a"), 1: eight("b", g4=gpu(4, **health))})
    assert found is not None and found.ranks == {1}
    assert found.line == f"node 1 (b) GPU 4 ({H100}, 00000000:1C:00.0): {words}"


def test_what_is_not_a_finding():
    quiet = {"xids": (13, 31, 43, 45), "ecc_uncorrected": None, "remap_pending": None, "remap_failure": None}
    assert verdict({0: eight("a", g1=gpu(1, **quiet))}) is None  # a program's Xids; fields NVML could not read
    line = devcheck.summary({0: eight("a", g1=gpu(1, **quiet))})
    assert line.endswith("; not read: ECC on 1 GPU(s), memory retirement on 1 GPU(s)")


def test_cpu_nodes_check_nothing_and_say_so():
    note = "nothing checked: torch 2.13.0+cpu is a build without CUDA"
    job = {0: node("a", note=note), 1: node("b", note=note)}
    assert verdict(job) is None
    assert devcheck.summary(job) == "no GPU checked: torch 2.13.0+cpu is a build without CUDA on nodes 0 (a), 1 (b)"
    mixed = {0: eight("a"), 1: node("b", note=note)}
    assert verdict(mixed) is None and devcheck.summary(mixed).endswith(f"380 GB/s; {note} on node 1 (b)")


def test_a_node_whose_check_failed_is_named_and_every_finding_counts():
    job = {0: eight("a", g0=gpu(0, ecc_uncorrected=1), g1=gpu(1, ecc_uncorrected=1)),
           1: node("b", failed="the device check did not finish in 60 s (timing the GEMM on every device)"), 2: eight("c")}
    found = verdict(job)
    assert found.ranks == {0, 1} and len(found.findings) == 3
    assert found.findings[2] == "node 1 (b): the device check did not finish in 60 s (timing the GEMM on every device)"
    many = {r: eight(f"n{r}", g0=gpu(0, xids=(48,))) for r in range(10)}
    assert verdict(many).line.endswith("; and 2 more") and verdict(many).ranks == set(range(10))


def test_the_result_survives_the_store_as_json():
    result = node("a", gpu(0, xids=(79,), faults=("GEMM failed: RuntimeError: CUDA error",)),
                  gpu(1, xids=None, ecc_uncorrected=None, peer=None), note="NVML not read: NVMLError_LibraryNotFound")
    assert NodeDevices.from_json(result.to_json()) == result
    newer = result.to_json().replace('"xids": null', '"xids": null, "power_w": 700')  # a newer trainpod's field
    assert NodeDevices.from_json(newer) == result


def test_nodes_exchange_their_results_in_a_real_tcp_store():
    from torch.distributed import TCPStore

    host = TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    results = {0: eight("a"), 1: eight("b", g7=gpu(7, gemm=100.0)), 2: node("c", note="nothing checked: no CUDA")}
    seen: dict[int, dict] = {}

    def member(rank: int) -> None:
        store = host if rank == 0 else TCPStore("127.0.0.1", host.port, 3, is_master=False)
        seen[rank] = devcheck.exchange(store, rank, 3, results[rank], wait_s=30)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in (2, 1, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert seen == {0: results, 1: results, 2: results}  # every node reads the same, so reaches the same verdict
    assert verdict(seen[2]).ranks == {1}


# ---- NVML, through the real pynvml's errors ----

def test_a_host_without_nvidias_library_reads_no_nvml_and_says_why():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this host has NVIDIA's library")
    nvml = Nvml()
    assert nvml.nv is None and nvml.note == "NVML not read: NVMLError_LibraryNotFound: NVML Shared Library Not Found"
    assert nvml.health("00000000:3B:00.0") == {"ecc_uncorrected": None, "retired_pending": None, "remap_pending": None,
                                               "remap_failure": None, "xids": None, "faults": ()}
    nvml.close()


def test_without_pynvml_nothing_is_read(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert Nvml().note == "NVML not read: pynvml (the nvidia-ml-py package) is not installed"


def fails(code: int):
    def call(*args):
        raise pynvml.NVMLError(code)  # the real class for the code, e.g. NVMLError_NotSupported
    return call


def events(*xids: int, then: int = pynvml.NVML_ERROR_TIMEOUT):
    """nvmlEventSetWait_v2 that returns these Xid events, then raises NVML's error `then`."""
    waiting = [types.SimpleNamespace(eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=x) for x in xids]

    def wait(event_set, timeout_ms):
        assert timeout_ms == 0  # never blocks
        if waiting:
            return waiting.pop(0)
        raise pynvml.NVMLError(then)
    return wait


BUS = "00000000:3B:00.0"


def fake_nvml(**calls) -> types.SimpleNamespace:
    """The real pynvml's constants and error classes, with its calls answered here: one healthy GPU at BUS."""
    handle = object()
    answers = {
        "nvmlInit": lambda: None, "nvmlShutdown": lambda: setattr(module, "shut", True),
        "nvmlDeviceGetCount": lambda: 1, "nvmlDeviceGetHandleByIndex": lambda i: handle,
        "nvmlDeviceGetPciInfo": lambda h: types.SimpleNamespace(domain=0, bus=0x3B, device=0),
        "nvmlEventSetCreate": lambda: "event set", "nvmlDeviceRegisterEvents": lambda h, kinds, s: None,
        "nvmlEventSetFree": lambda s: None,
        "nvmlDeviceGetTotalEccErrors": lambda h, kind, counter: 0,
        "nvmlDeviceGetRetiredPagesPendingStatus": lambda h: pynvml.NVML_FEATURE_DISABLED,
        "nvmlDeviceGetRemappedRows": lambda h: (0, 0, 0, 0), "nvmlEventSetWait_v2": events(),
    }
    module = types.SimpleNamespace(**{k: v for k, v in vars(pynvml).items() if not k.startswith("__")}, shut=False)
    for name, answer in {**answers, **calls}.items():
        setattr(module, name, answer)
    return module


def test_a_healthy_gpu_through_nvml():
    nvml = Nvml(fake_nvml())
    assert nvml.note == "" and nvml.count() == 1
    assert nvml.health(BUS) == {"ecc_uncorrected": 0, "retired_pending": False, "remap_pending": False,
                                "remap_failure": False, "xids": (), "faults": ()}


def test_errors_read_through_nvml():
    def ecc(handle, kind, counter):
        assert (kind, counter) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        return 3
    nvml = Nvml(fake_nvml(nvmlDeviceGetTotalEccErrors=ecc, nvmlDeviceGetRemappedRows=lambda h: (5, 1, 1, 0),
                          nvmlEventSetWait_v2=events(79, 13)))
    assert nvml.health(BUS) == {"ecc_uncorrected": 3, "retired_pending": False, "remap_pending": True,
                                "remap_failure": False, "xids": (79, 13), "faults": ()}


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_NO_PERMISSION,
                                  pynvml.NVML_ERROR_UNINITIALIZED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                                  pynvml.NVML_ERROR_UNKNOWN])
def test_a_field_nvml_cannot_read_is_none(code):
    nvml = Nvml(fake_nvml(nvmlDeviceGetTotalEccErrors=fails(code), nvmlDeviceGetRetiredPagesPendingStatus=fails(code),
                          nvmlDeviceGetRemappedRows=fails(code), nvmlDeviceRegisterEvents=fails(code)))
    assert nvml.health(BUS) == {"ecc_uncorrected": None, "retired_pending": None, "remap_pending": None,
                                "remap_failure": None, "xids": None, "faults": ()}


def test_an_old_pynvml_without_a_function_and_a_wait_that_fails():
    module = fake_nvml(nvmlEventSetWait_v2=events(79, then=pynvml.NVML_ERROR_UNKNOWN))
    del module.nvmlDeviceGetRemappedRows
    health = Nvml(module).health(BUS)
    assert health["remap_pending"] is None and health["xids"] == (79,)  # what it read before the error
    assert Nvml(fake_nvml(nvmlEventSetWait_v2=events(then=pynvml.NVML_ERROR_UNKNOWN))).health(BUS)["xids"] is None


@pytest.mark.parametrize("code, text", [(pynvml.NVML_ERROR_GPU_IS_LOST, "NVML: GPU is lost"),
                                        (pynvml.NVML_ERROR_RESET_REQUIRED, "NVML: GPU requires restart")])
def test_nvml_saying_the_gpu_is_lost_is_a_fault(code, text):
    health = Nvml(fake_nvml(nvmlDeviceGetTotalEccErrors=fails(code))).health(BUS)
    assert health["ecc_uncorrected"] is None and health["faults"] == (text,)


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_DRIVER_NOT_LOADED, pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
                                  pynvml.NVML_ERROR_NO_PERMISSION])
def test_nvml_that_does_not_start_reads_nothing(code):
    nvml = Nvml(fake_nvml(nvmlInit=fails(code)))
    assert nvml.nv is None and nvml.note.startswith(f"NVML not read: {type(pynvml.NVMLError(code)).__name__}: ")
    assert nvml.health(BUS)["ecc_uncorrected"] is None


def test_a_gpu_nvml_does_not_know_has_no_health():
    health = Nvml(fake_nvml()).health("00000000:AF:00.0")  # not the GPU NVML sees (vGPU, another address)
    assert set(health.values()) == {None, ()}


# ---- the work and the child process ----

def test_the_work_on_two_devices_gives_every_figure():
    cpu = torch.device("cpu")
    steps: list[str] = []
    found = devcheck.work(torch, [cpu, cpu], budget_s=0.05, gemm_n=32, copy_bytes=1 << 12, say=steps.append)
    assert [sorted(f) for f in found] == [["faults", "gemm_tflops", "memory_gbs", "peer_gbs"]] * 2
    assert all(f["faults"] == () and f["gemm_tflops"] > 0 and f["memory_gbs"] > 0 and f["peer_gbs"] > 0 for f in found)
    assert steps[-2:] == ["timing the copy from device 0 to device 1", "timing the copy from device 1 to device 0"]
    alone = devcheck.work(torch, [cpu], budget_s=0.05, gemm_n=32, copy_bytes=1 << 12)
    assert alone[0]["peer_gbs"] is None and alone[0]["memory_gbs"] > 0


def test_a_device_whose_work_fails_gets_a_fault_and_the_others_go_on():
    cpu = torch.device("cpu")

    def broken():
        raise RuntimeError("CUDA error: uncorrectable ECC error encountered\nmore detail")
    faults = {0: [], 1: []}
    took = devcheck._per_step(torch, {0: (cpu, lambda: None), 1: (cpu, broken)}, 0.01, 0.0, faults, "GEMM")
    assert list(took) == [0] and took[0] >= 0
    assert faults == {0: [], 1: ["GEMM failed: RuntimeError: CUDA error: uncorrectable ECC error encountered"]}


def test_a_copy_that_differs_from_its_source_is_a_fault():
    source, faults = torch.arange(64, dtype=torch.uint8), []
    assert devcheck._intact(torch, source, source.clone(), faults, "memory copy") and faults == []
    broken = source.clone()
    broken[7] = 0
    assert not devcheck._intact(torch, source, broken, faults, "copy to device 1")
    assert faults == ["copy to device 1 returned other data"]


def test_measure_without_torch_or_cuda_checks_nothing(monkeypatch):
    module = fake_nvml()
    result = devcheck.measure(nvml_module=module)
    if torch.version.cuda is None:
        assert result.devices == () and result.note == f"nothing checked: torch {torch.__version__} is a build without CUDA"
    assert module.shut  # NVML is closed whatever happened
    monkeypatch.setitem(sys.modules, "torch", None)
    assert devcheck.measure().note == "nothing checked: torch is not installed"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a host with CUDA checks its GPUs")
def test_run_on_a_cpu_host_checks_nothing_through_the_child(tmp_path, monkeypatch):
    # No timed assertion (a loaded host took 30 s to import torch): failed == "" says the child ended in its time.
    (tmp_path / "json.py").write_text("raise SystemExit('the working directory was imported')\n")
    monkeypatch.chdir(tmp_path)  # the job's working directory: none of its files is imported by the check
    result = devcheck.run(timeout_s=120)
    assert result.devices == () and result.failed == "" and result.note.startswith("nothing checked: torch ")


def test_a_check_that_does_not_finish_names_its_node():
    result = devcheck.run(timeout_s=0.05)  # the child is still importing
    assert result.devices == () and result.failed.startswith("the device check did not finish in 0.05 s")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run natively on a GPU host")
def test_the_gpus_of_this_host_are_measured():
    result = devcheck.run()
    assert result.failed == "" and len(result.devices) == torch.cuda.device_count(), result
    for device in result.devices:
        assert device.faults == () and device.gemm_tflops > 1 and device.memory_gbs > 10, device
        assert (device.peer_gbs is None) == (torch.cuda.device_count() == 1), device
    assert verdict({0: result}) is None, verdict({0: result}).line
    print(devcheck.summary({0: result}))
