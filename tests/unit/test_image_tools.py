"""The helpers of the image build: the venv split into layers, the wheel cache, Apex's source."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def fake_dist(site: Path, name: str, files: dict[str, str]) -> None:
    """An installed distribution as pip leaves it: its files and a dist-info with METADATA and RECORD."""
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    for path, text in files.items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_text(text)
    record = [f"{path},," for path in files] + [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")


@pytest.fixture
def venv(tmp_path) -> tuple[Path, Path]:
    root = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    fake_dist(site, "nvidia-cublas", {"nvidia/cu13/lib/libcublas.so.13": "cublas"})
    fake_dist(site, "nvidia-nccl-cu13", {"nvidia/cu13/lib/libnccl.so.2": "nccl", "nvidia/nccl/__init__.py": ""})
    fake_dist(site, "cuda-bindings", {"cuda/bindings/__init__.py": ""})
    fake_dist(site, "torch", {"torch/__init__.py": "", "torch/lib/libtorch.so": "torch", "../../../bin/torchrun": "#!"})
    fake_dist(site, "numpy", {"numpy/__init__.py": ""})
    return root, site


def files_under(tree: Path) -> set[str]:
    return {"/" + str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file() or p.is_symlink()}


@pytest.mark.slow
def test_the_venv_splits_into_layers_that_add_up_to_it(venv, tmp_path):
    root, site = venv
    script, python = str(REPO / "images" / "venv-layers.py"), str(root / "bin" / "python")
    layers = tmp_path / "layers"
    for command in (["group", str(root), str(layers / "cuda"), "nvidia-*", "cuda-*"],
                    ["group", str(root), str(layers / "torch"), "torch", "triton"],
                    ["rest", str(root), str(layers / "venv"), str(layers / "cuda"), str(layers / "torch")]):
        subprocess.run([python, script, *command], check=True, capture_output=True, text=True)
    cuda, torch, rest = (files_under(layers / name) for name in ("cuda", "torch", "venv"))
    manifests = {f"/opt/trainpod/layers.d/{name}.txt" for name in ("cuda", "torch", "venv")}
    assert manifests == {path for path in cuda | torch | rest if path.startswith("/opt/trainpod/layers.d/")}
    cuda, torch, rest = cuda - manifests, torch - manifests, rest - manifests
    assert (layers / "torch/opt/trainpod/layers.d/torch.txt").read_text().splitlines()[1:] == ["torch"]  # no triton here
    assert str(site / "nvidia/cu13/lib/libnccl.so.2") in cuda and str(site / "cuda/bindings/__init__.py") in cuda
    assert str(site / "torch/lib/libtorch.so") in torch and str(root / "bin/torchrun") in torch
    assert str(site / "numpy/__init__.py") in rest and str(root / "pyvenv.cfg") in rest
    assert not (cuda & torch or cuda & rest or torch & rest)
    everything = {"/" + str(p.relative_to("/")) for p in root.rglob("*") if p.is_file() or p.is_symlink()}
    assert cuda | torch | rest == everything
    # hard links, not copies: the split costs no space in the layer that installed the venv
    assert os.stat(layers / "cuda" / str(site / "nvidia/cu13/lib/libcublas.so.13").lstrip("/")).st_ino == \
        os.stat(site / "nvidia/cu13/lib/libcublas.so.13").st_ino
    # the venv's python is a symlink, and stays one
    assert (layers / "venv" / str(root / "bin/python").lstrip("/")).is_symlink()


@pytest.mark.slow
def test_a_group_with_no_distribution_is_a_tree_with_its_manifest_only(venv, tmp_path):
    # Never an empty tree: Docker's classic builder fails the COPY after a COPY of an empty folder.
    root, _ = venv
    subprocess.run([str(root / "bin" / "python"), str(REPO / "images" / "venv-layers.py"), "group", str(root),
                    str(tmp_path / "none"), "nothing-*"], check=True, capture_output=True)
    assert files_under(tmp_path / "none") == {"/opt/trainpod/layers.d/none.txt"}


def wheel_cache(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "wheel-cache.py"), *args], capture_output=True, text=True)


@pytest.mark.slow
def test_the_wheel_cache_seeds_only_pinned_wheels_and_keeps_new_ones(tmp_path):
    cache, house = tmp_path / "cache", tmp_path / "house"
    cache.mkdir()
    for name in ("torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl",
                 "nvidia_nccl_cu13-2.29.7-py3-none-manylinux_2_18_x86_64.whl", "numpy-2.4.5-cp311-cp311-any.whl"):
        (cache / name).write_text(name)
    (tmp_path / "common.txt").write_text("numpy==2.4.6\n")
    (tmp_path / "cuda.txt").write_text("-r common.txt\ntorch==2.13.0\nnvidia-nccl-cu13==2.29.7  # NCCL\n")
    assert wheel_cache("seed", str(cache), str(house), str(tmp_path / "cuda.txt")).returncode == 0
    assert sorted(p.name for p in house.iterdir()) == ["nvidia_nccl_cu13-2.29.7-py3-none-manylinux_2_18_x86_64.whl",
                                                      "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl"]
    (house / "torch").mkdir()
    (house / "torch" / "numpy-2.4.6-cp311-cp311-any.whl").write_text("new")
    assert wheel_cache("save", str(cache), str(house)).returncode == 0
    assert (cache / "numpy-2.4.6-cp311-cp311-any.whl").read_text() == "new"
    assert wheel_cache("seed", str(cache)).returncode == 64


def fetch(*args: str, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "images" / "fetch-source.sh"), *args], capture_output=True, text=True,
                          env={**os.environ, "GIT_CACHE": str(cache)})


def test_apex_source_from_a_tarball_or_a_directory_and_the_stamp_moves_only_on_change(tmp_path):
    source = tmp_path / "apex"
    (source / "csrc").mkdir(parents=True)
    (source / "setup.py").write_text("# setup\n")
    (source / "csrc" / "amp_C_frontend.cpp").write_text("// kernels\n")
    tarball = tmp_path / "apex-6424da3b4faa.tar.gz"
    with tarfile.open(tarball, "w:gz") as archive:
        archive.add(source, arcname="apex")  # one top folder, as `git archive --prefix=apex/`
    dest, stamp = tmp_path / "out" / "apex", tmp_path / "out" / "source.sha"
    assert fetch("Apex", "APEX_SOURCE", str(tarball), "", str(dest), str(stamp), cache=tmp_path / "git").returncode == 0
    assert (dest / "setup.py").exists() and (dest / "csrc" / "amp_C_frontend.cpp").exists()
    before = stamp.stat().st_mtime_ns
    time.sleep(0.01)
    assert fetch("Apex", "APEX_SOURCE", str(source), "", str(dest), str(stamp), cache=tmp_path / "git").returncode == 0  # the same tree
    assert stamp.stat().st_mtime_ns == before
    (source / "csrc" / "amp_C_frontend.cpp").write_text("// changed\n")
    assert fetch("Apex", "APEX_SOURCE", str(source), "", str(dest), str(stamp), cache=tmp_path / "git").returncode == 0
    assert stamp.stat().st_mtime_ns != before and (dest / "csrc" / "amp_C_frontend.cpp").read_text() == "// changed\n"


@pytest.mark.parametrize("source, ref, why", [
    ("/no/such/apex", "", "/no/such/apex does not exist"),
    ("", "", "APEX_SOURCE is empty"),
    ("file:///no/such/repo.git", "6424da3b", "cannot fetch file:///no/such/repo.git at 6424da3b"),
])
def test_no_reachable_apex_source_is_one_line_saying_what_to_pass(tmp_path, source, ref, why):
    result = fetch("Apex", "APEX_SOURCE", source, ref, str(tmp_path / "apex"), str(tmp_path / "sha"),
                   "../shared/vendor/apex-6424da3b4faa.tar.gz", cache=tmp_path / "git")
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"make: no Apex source: {why}")
    assert "APEX_SOURCE=URL APEX_REF=COMMIT (git), APEX_SOURCE=FILE.tar.gz or APEX_SOURCE=DIR" in lines[0]
    assert lines[0].endswith("e.g. APEX_SOURCE=../shared/vendor/apex-6424da3b4faa.tar.gz")
    assert not (tmp_path / "sha").exists()
