import importlib.machinery
import importlib.util

from trainpod.launcher.devices import nvidia_driver_version, parse_driver_version, torch_cuda_version, visible_gpu_count


def test_cuda_visible_devices_counts():
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1,3"}) == 3
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "-1"}) == 0
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == 1
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "GPU-8f2c,GPU-11ab"}) == 2


def test_device_nodes_are_counted(tmp_path):
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert visible_gpu_count({}, dev_glob=str(tmp_path / "nvidia[0-9]*")) == 2
    assert visible_gpu_count({}, dev_glob=str(tmp_path / "none[0-9]*")) == 0


def test_torch_cuda_version_is_read_without_importing_torch(tmp_path, monkeypatch):
    # A torch whose import fails: reading its version.py must not import it.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    version = tmp_path / "torch" / "version.py"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: importlib.machinery.PathFinder.find_spec(name, [str(tmp_path)]))
    version.write_text("from typing import Optional\n__version__ = '2.13.0+cu130'\ncuda: Optional[str] = '13.0'\n")
    assert torch_cuda_version() == "13.0"
    version.write_text("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\n")
    assert torch_cuda_version() is None
    # a ROCm build: no CUDA, a HIP version (its nccl backend is RCCL)
    version.write_text("__version__ = '2.9.1+rocm6.4'\ncuda: Optional[str] = None\nhip: Optional[str] = '6.4.43482-0f2d60242'\n")
    assert torch_cuda_version() is None and torch_cuda_version("hip") == "6.4.43482"


def test_driver_versions_are_parsed_from_the_kernel_module_file_and_nvidia_smi():
    closed = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 06:54:38 UTC 2025\nGCC version:  gcc 12.2.0\n"
    opened = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  575.57.08  Release Build  (dvs-builder@U16-I3-B03-4-3)\n"
    assert parse_driver_version(closed) == (580, 65, 6)
    assert parse_driver_version(opened) == (575, 57, 8)
    assert parse_driver_version("550.54.15\n") == (550, 54, 15)
    assert parse_driver_version("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.") is None


def test_the_driver_version_file_comes_first(tmp_path):
    version_file = tmp_path / "version"
    version_file.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  Thu Sep 25 2025\n")
    assert nvidia_driver_version(str(version_file)) == ((580, 95, 5), str(version_file))
