"""Which numeric path runs: torch's mixed precision, and Apex where it can run (never an error when absent)."""

import pytest

torch = pytest.importorskip("torch")

from trainpod.errors import ConfigError, UsageError  # noqa: E402
from trainpod.examples import precision  # noqa: E402

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_paths_by_device_and_amp():
    assert precision.choose(False, "off", CPU).name == "fp32"
    assert precision.choose(True, "off", CPU).name == "torch-bf16"
    assert precision.choose(True, "off", CUDA).name == "torch-fp16"
    assert precision.choose(True, "auto", CUDA, status="importable").name == "torch-fp16+apex-fused"
    assert precision.choose(True, "off", CUDA, dtype="bfloat16").name == "torch-bf16"
    assert precision.choose(False, "off", CUDA, dtype="bfloat16").name == "fp32"


def test_apex_absent_is_never_an_error_with_auto():
    path = precision.choose(True, "auto", CUDA, status="not importable (ModuleNotFoundError: No module named 'apex')")
    assert path.name == "torch-fp16" and path.apex_note.startswith("not importable")


def test_apex_on_the_cpu_is_importable_but_unused():
    path = precision.choose(True, "auto", CPU, status="importable")
    assert path.name == "torch-bf16" and path.apex_note == "importable, unused without CUDA"


def test_apex_on_where_it_cannot_run_names_the_origin():
    with pytest.raises(UsageError, match=r"^--apex=on: Apex cannot run here: its kernels need CUDA"):
        precision.choose(True, "on", CPU, status="importable")
    with pytest.raises(ConfigError, match=r"^TRAINPOD_APEX=on: Apex cannot run here: not importable"):
        precision.choose(True, "on", CUDA, origin="TRAINPOD_APEX", status="not importable (ImportError: x)")


def test_only_float16_scales_gradients():
    assert not precision.choose(True, "off", CPU).grad_scaler().is_enabled()
    assert not precision.choose(False, "off", CPU).grad_scaler().is_enabled()


def test_torch_optimizers_and_norms_without_apex():
    path = precision.choose(True, "off", CPU)
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert isinstance(path.optimizer("sgd", params, 0.1), torch.optim.SGD)
    assert isinstance(path.optimizer("adam", params, 0.1), torch.optim.Adam)
    assert isinstance(path.layer_norm(8), torch.nn.LayerNorm)


def test_apex_status_says_why_here():
    assert precision.apex_status().startswith(("importable", "not importable ("))
