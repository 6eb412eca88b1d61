#!/usr/bin/env bash
# The compile environment for CUDA extensions, in the Dockerfile's cuda-devel stage (on top of the
# torch stage's venv; never in the image):
#   - the OS build packages of build-packages.txt (a C++ compiler, Python's headers), apt-installed
#     only when the builder base lacks them;
#   - nvcc, its back end and the CUDA headers from NVIDIA's PyPI wheels (requirements-devel.txt, from
#     the wheelhouse), at torch's CUDA version: every CUDA wheel installs into one folder,
#     site-packages/nvidia/cu<major>/, next to the runtime libraries torch came with;
#   - /opt/cuda, a CUDA_HOME that torch.utils.cpp_extension accepts: bin, include and nvvm linked to
#     those folders, lib64 with a link to every library plus the unversioned names the linker wants.
# A flavour that builds no extension has no requirements-devel.txt here: then nothing happens.
# Usage: cuda-devel.sh DIR (the build context's ext/devel/)
set -euo pipefail

dir=${1:?usage: cuda-devel.sh DIR}
venv=/opt/trainpod/venv
cuda_home=/opt/cuda
die() { echo "cuda-devel: error: $*" >&2; exit 1; }

if [ ! -f "$dir/requirements-devel.txt" ]; then
    echo "cuda-devel: this flavour compiles no extension: nothing to set up"
    exit 0
fi

bash "$dir/install-os-packages.sh" "$dir/build-packages.txt"
"$venv/bin/pip" install --no-cache-dir --no-index --find-links "$dir" --disable-pip-version-check \
    -r "$dir/requirements-devel.txt"

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
# torch's CUDA version, from torch/version.py (importing torch is slower and says the same)
cuda=$(sed -n "s/^cuda[^=]*= *'\([0-9.]*\)'.*/\1/p" "$site/torch/version.py")
[ -n "$cuda" ] || die "torch in $venv is a CPU build: there is no CUDA to compile extensions for"
root=$site/nvidia/cu${cuda%%.*}
[ -x "$root/bin/nvcc" ] || die "no nvcc in $root: requirements-devel.txt must hold CUDA ${cuda%%.*}'s nvcc wheels" \
    "(cuda-toolkit[nvcc,cccl,profiler] at torch's CUDA $cuda)"

mkdir -p "$cuda_home/lib64"
for folder in bin include nvvm; do
    ln -sfn "$root/$folder" "$cuda_home/$folder"
done
for lib in "$root"/lib/*; do
    ln -sfn "$lib" "$cuda_home/lib64/"
done
for name in cudart cublas cublasLt cusparse cusolver curand; do
    versioned=$(find "$root/lib" -maxdepth 1 -name "lib$name.so.*" -printf '%f\n' | sort -V | head -n 1)
    [ -n "$versioned" ] || die "no lib$name.so.* in $root/lib"
    ln -sfn "$versioned" "$cuda_home/lib64/lib$name.so"
done
echo "cuda-devel: CUDA_HOME=$cuda_home -> $root (torch $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))') for CUDA $cuda)," \
    "$("$cuda_home/bin/nvcc" --version | tail -n 2 | head -n 1), $(g++ --version | head -n 1)"
