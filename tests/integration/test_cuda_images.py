"""The CUDA images without a GPU (CI has none): trainpod:cuda and trainpod:cuda-apex build, torch is
PyPI's CUDA 13 build with NCCL, a job falls back to gloo on the CPU with one line saying so, the
2-node compose job trains on them, and Apex (cuda-apex) imports and says it is unused without CUDA.

TRAINPOD_CUDA_IMAGES names the images (default: both, comma-separated). Each test skips when its
image is not built, and fails instead under CI=true. `make test-cuda` builds both images and runs these
tests (marked cuda_images); `make test` leaves them out.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from fixtures.docker_env import REPO, ComposeJob, _unavailable, require_docker, run
from trainpod.examples.reporting import parse_metrics_line

pytestmark = [pytest.mark.docker, pytest.mark.cuda_images]

IMAGES = [name.strip() for name in os.environ.get("TRAINPOD_CUDA_IMAGES", "trainpod:cuda,trainpod:cuda-apex").split(",") if name]
APEX_IMAGES = [image for image in IMAGES if "apex" in image]
COMPOSE = REPO / "compose" / "pai-2node" / "compose.yaml"
# The README's hardened run (as in test_image.py): read-only root, no capabilities, no new privileges.
HARDENED = ["--read-only", "--tmpfs", "/tmp", "--tmpfs", "/workspace/output:uid=1000,gid=1000", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--shm-size", "256m"]


def require(image: str) -> str:
    require_docker()
    if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode != 0:
        _unavailable(f"image {image} is not built (make image-{image.split(':', 1)[1]})")
    return image


@pytest.fixture(params=IMAGES)
def image(request) -> str:
    return require(request.param)


@pytest.fixture(params=APEX_IMAGES)
def apex_image(request) -> str:
    return require(request.param)


def python_in(image: str, code: str) -> dict:
    """Run `code` with the image's python (no GPU given) and return the JSON it prints last."""
    result = run("docker", "run", "--rm", image, "python", "-c", code, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_torch_is_the_cuda_13_build_with_nccl_and_finds_no_gpu(image):
    facts = python_in(image, "import json, torch, torch.distributed as dist; print(json.dumps({"
                             "'version': torch.__version__, 'cuda': torch.version.cuda, 'available': torch.cuda.is_available(),"
                             "'nccl': dist.is_nccl_available(), 'nccl_version': list(torch.cuda.nccl.version())}))")
    assert facts["version"] == "2.13.0+cu130" and facts["cuda"] == "13.0", facts
    assert facts["available"] is False, facts
    assert facts["nccl"] is True and facts["nccl_version"] == [2, 29, 7], facts


def test_a_hardened_job_without_a_gpu_falls_back_to_gloo_with_one_line(image):
    result = run("docker", "run", "--rm", *HARDENED, image, "trainpod", "run", "--nproc-per-node", "2", "--example",
                 "cifar10-ddp", "--", "--epochs", "1", "--synthetic-samples", "256", timeout=600, check=False)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    notes = [line for line in log.splitlines() if "no GPU visible: gloo instead of NCCL" in line]
    assert len(notes) == 1, notes
    assert "CUDA 13.0" in notes[0] and "--gpus all" in notes[0]
    metrics = parse_metrics_line(result.stdout)
    assert metrics["world_size"] == 2 and metrics["ranks_agree"], metrics
    assert metrics["metrics"] == "/workspace/output/metrics.json"
    assert "backend gloo" in log and "Traceback" not in log


def test_the_two_node_compose_job_trains_on_it_with_gloo(image):
    job = ComposeJob(COMPOSE, env={"TRAINPOD_IMAGE": image, "TRAINPOD_EPOCHS": "1"})
    try:
        job.up()
        codes = job.wait("node0", "node1")
        assert codes == {"node0": 0, "node1": 0}, job.logs("node0")[-3000:] + job.logs("node1")[-3000:]
        metrics = job.metrics()
        assert (metrics["world_size"], metrics["nnodes"], metrics["backend"]) == (4, 2, "gloo")
        assert len(set(metrics["rank_checksums"])) == 1
        assert metrics["loss_curve"][-1][1] < metrics["loss_curve"][0][1], metrics["loss_curve"]
        assert "no GPU visible: gloo instead of NCCL" in job.logs("node1")
    finally:
        job.down()


def layer_sizes(image: str) -> tuple[list[int], int]:
    """The sizes of the venv's layers (the COPYs to /, oldest first) and of trainpod's own layers."""
    out = subprocess.run(["docker", "history", "--no-trunc", "--human=false", "--format", "{{json .}}", image],
                         capture_output=True, text=True, check=True).stdout
    history = [(int(entry["Size"]), entry["CreatedBy"]) for entry in map(json.loads, out.splitlines())]  # newest first
    own = next(i for i, (_, created) in enumerate(history) if re.search(r"COPY .*/tmp/trainpod/", created))
    venv = [size for size, created in reversed(history[own + 1:]) if re.search(r"COPY (dir:\S+ in|\S+/layers/\S+) / ", created + " ")]
    return venv, sum(size for size, _ in history[:own + 1])


def test_cuda_torch_the_rest_and_trainpod_are_layers_of_their_own(image):
    venv, own = layer_sizes(image)
    cuda, torch, rest, extensions = venv  # NVIDIA's CUDA wheels, torch + triton, the rest, compiled extensions
    assert cuda > 2.5e9 and torch > 1.5e9, venv
    assert rest < 300e6, venv
    assert (extensions > 5e6) == ("apex" in image) and extensions < 60e6, venv
    assert own < 10e6, own  # a change to trainpod is a small layer here too


APEX_CHECK = """
import json, os, shutil
import apex, amp_C, fused_layer_norm_cuda
from apex.optimizers import FusedAdam, FusedSGD
from apex.normalization import FusedLayerNorm

def has_debug_info(path):
    with open(path, 'rb') as f:
        data = f.read()
    # ELF64: section headers at e_shoff, e_shentsize, e_shnum, names in section e_shstrndx
    shoff = int.from_bytes(data[0x28:0x30], 'little'); size = int.from_bytes(data[0x3A:0x3C], 'little')
    count = int.from_bytes(data[0x3C:0x3E], 'little'); names = int.from_bytes(data[0x3E:0x40], 'little')
    def header(i):
        start = shoff + i * size
        return int.from_bytes(data[start:start + 4], 'little'), int.from_bytes(data[start + 24:start + 32], 'little')
    table = header(names)[1]
    return any(data[table + header(i)[0]:].startswith(b'.debug_') for i in range(count))

so = [os.path.join(os.path.dirname(amp_C.__file__), f) for f in os.listdir(os.path.dirname(amp_C.__file__))
      if f.endswith('.so') and f.split('.')[0] in ('apex_C', 'amp_C', 'fused_layer_norm_cuda', 'syncbn', 'mlp_cuda')]
print(json.dumps({'apex': apex.__file__, 'optimizers': [FusedAdam.__name__, FusedSGD.__name__, FusedLayerNorm.__name__],
                  'debug_info': [os.path.basename(p) for p in so if has_debug_info(p)], 'extensions': len(so),
                  'compilers': [c for c in ('nvcc', 'gcc', 'g++', 'cc', 'c++') if shutil.which(c)]}))
"""


def test_apex_imports_without_a_gpu_stripped_and_with_no_compiler_in_the_image(apex_image):
    facts = python_in(apex_image, APEX_CHECK)
    assert facts["optimizers"] == ["FusedAdam", "FusedSGD", "FusedLayerNorm"], facts
    assert facts["extensions"] >= 3 and facts["debug_info"] == [], facts
    assert facts["compilers"] == [], facts


def test_cifar10_ddp_amp_says_apex_is_importable_but_unused_without_cuda(apex_image):
    result = run("docker", "run", "--rm", "--shm-size", "256m", apex_image, "trainpod", "run", "--nproc-per-node", "2",
                 "--example", "cifar10-ddp-amp", "--", "--epochs", "1", "--synthetic-samples", "256", "--batch-size", "32",
                 "--output-dir", "/tmp/out", timeout=600, check=False)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    assert re.search(r"cifar10-ddp-amp: world 2, backend gloo, torch-bf16 \(apex: importable, unused without CUDA\)", log), log[-3000:]
    assert parse_metrics_line(result.stdout)["precision"] == "torch-bf16"
