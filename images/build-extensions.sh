#!/usr/bin/env bash
# Build the extensions a flavour compiles from source, in the Dockerfile's extensions stage (on top of
# cuda-devel), and install them: today NVIDIA Apex, when the build context's ext/src/ holds its
# source (make puts it there for cuda-apex, from APEX_SOURCE).
#
#   - A wheel, with Apex's C++ and core CUDA extensions (APEX_CPP_EXT=1 APEX_CUDA_EXT=1) for
#     TORCH_CUDA_ARCH_LIST, MAX_JOBS compilers at a time (default: the CPUs); APEX_EXTENSIONS, when
#     set, builds only the extensions it names (e.g. "apex_C amp_C fused_layer_norm_cuda", what
#     the examples use), as Apex's setup.py has no switch for a part of APEX_CUDA_EXT.
#   - No debug information (-g0 after Python's -g, and --strip-debug at link time): 14 MB of
#     extensions instead of 138 MB, and less to compile.
#   - Installed into the venv with pip, then hard-linked into TREE (venv-layers.py), which the final
#     stage COPYs as one layer: the image gets the installed files and no compiler.
#   - The wheel stays in this stage at /opt/trainpod/wheels/, and a one-line report (time, peak memory,
#     wheel size) at /opt/trainpod/extensions-report.json; `make bench` reads it.
# Usage: build-extensions.sh SRC TREE
set -euo pipefail

src=${1:?usage: build-extensions.sh SRC TREE} tree=${2:?usage: build-extensions.sh SRC TREE}
venv=/opt/trainpod/venv
wheels=/opt/trainpod/wheels
report=/opt/trainpod/extensions-report.json
mkdir -p "$tree" "$wheels"

if [ ! -f "$src/apex/setup.py" ]; then
    echo "build-extensions: this flavour compiles no extension"
    echo '{}' > "$report"
    # Never an empty tree: the classic builder fails the COPY after an empty one (venv-layers.py).
    "$venv/bin/python" /opt/trainpod/tools/venv-layers.py group "$venv" "$tree" apex
    exit 0
fi

export CUDA_HOME=/opt/cuda
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:?set TORCH_CUDA_ARCH_LIST, e.g. 9.0 (H100) or "8.0;9.0"}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export APEX_CPP_EXT=1 APEX_CUDA_EXT=1
export APEX_EXTENSIONS=${APEX_EXTENSIONS:-}
# ninja (from the venv) is what compiles MAX_JOBS files at a time: torch looks for it on PATH.
export PATH=$venv/bin:$PATH
# No debug information: setuptools takes CFLAGS/CXXFLAGS instead of Python's own flags, so these are
# Python's flags (-O2, -DNDEBUG, -fwrapv, ...) with -g0 last; and the linker drops any that is left.
python_cflags=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("CFLAGS"))')
export CFLAGS="$python_cflags -g0" CXXFLAGS="$python_cflags -g0" LDFLAGS="-Wl,--strip-debug"

# Peak memory of the build: the summed resident memory of every process in this build container,
# sampled each second.
peak_file=$(mktemp)
echo 0 > "$peak_file"
(
    peak=0
    while sleep 1; do
        rss=$(ps -e -o rss= | awk '{ total += $1 } END { print total + 0 }')
        if [ "$rss" -gt "$peak" ]; then peak=$rss; echo "$peak" > "$peak_file"; fi
    done
) &
sampler=$!
trap 'kill "$sampler" 2>/dev/null || true' EXIT

echo "build-extensions: Apex for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS," \
    "extensions: ${APEX_EXTENSIONS:-all of APEX_CPP_EXT and APEX_CUDA_EXT}"
start=$(date +%s)
# setup.py bdist_wheel, as pip's setuptools backend runs it, with its ext_modules filtered when
# APEX_EXTENSIONS names some.
usage_file=$(mktemp)
(cd "$src/apex" && "$venv/bin/python" - "$wheels" "$usage_file" <<'PY'
import os
import resource
import runpy
import sys

import setuptools

keep = os.environ["APEX_EXTENSIONS"].replace(",", " ").split()
setup = setuptools.setup


def filtered_setup(**kwargs):
    if keep:
        names = [ext.name for ext in kwargs.get("ext_modules", [])]
        unknown = sorted(set(keep) - set(names))
        if unknown:
            sys.exit(f"build-extensions: APEX_EXTENSIONS names {', '.join(unknown)}, which this Apex does not build "
                     f"(it builds: {', '.join(names)})")
        kwargs["ext_modules"] = [ext for ext in kwargs["ext_modules"] if ext.name in keep]
    return setup(**kwargs)


setuptools.setup = filtered_setup
usage_file = sys.argv[2]
sys.argv = ["setup.py", "bdist_wheel", "--dist-dir", sys.argv[1]]
sys.path.insert(0, os.getcwd())
runpy.run_path("setup.py", run_name="__main__")
# CPU time of the build (this process and every compiler it waited for): unlike the wall time, it
# does not grow when other work shares the machine.
mine, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
with open(usage_file, "w") as file:
    file.write(f"{mine.ru_utime + mine.ru_stime + children.ru_utime + children.ru_stime:.0f} {children.ru_maxrss}\n")
PY
)
seconds=$(($(date +%s) - start))
kill "$sampler" 2>/dev/null || true
peak_kb=$(cat "$peak_file")
rm -rf "$src/apex/build" "$src"/apex/*.egg-info  # the objects: hundreds of MB this layer need not keep

wheel=$(find "$wheels" -name 'apex-*.whl' | head -n 1)
[ -n "$wheel" ] || { echo "build-extensions: error: no Apex wheel in $wheels" >&2; exit 1; }
"$venv/bin/pip" install --no-cache-dir --no-index --no-deps --disable-pip-version-check "$wheel"
"$venv/bin/python" /opt/trainpod/tools/venv-layers.py group "$venv" "$tree" apex

read -r cpu_seconds largest_kb < "$usage_file"
"$venv/bin/python" - "$wheel" "$seconds" "$peak_kb" "$report" "$cpu_seconds" "$largest_kb" <<'PY'
import json
import os
import sys
import zipfile

wheel, seconds, peak_kb, report = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cpu_seconds, largest_kb = int(sys.argv[5]), int(sys.argv[6])
with zipfile.ZipFile(wheel) as archive:
    so = [info for info in archive.infolist() if info.filename.endswith(".so")]
figures = {
    "what": "apex",
    "wheel": os.path.basename(wheel),
    "extensions": sorted(info.filename.split(".")[0] for info in so),
    "torch_cuda_arch_list": os.environ["TORCH_CUDA_ARCH_LIST"],
    "max_jobs": int(os.environ["MAX_JOBS"]),
    "cpus": os.cpu_count(),
    "build_seconds": seconds,
    "cpu_seconds": cpu_seconds,
    "load_average": os.getloadavg()[0],
    "peak_memory_bytes": peak_kb * 1024,
    "largest_process_bytes": largest_kb * 1024,
    "wheel_bytes": os.path.getsize(wheel),
    "extensions_installed_bytes": sum(info.file_size for info in so),
}
with open(report, "w") as file:
    json.dump(figures, file)
print(f"build-extensions: Apex wheel {figures['wheel']} with {len(so)} extensions ({' '.join(figures['extensions'])}) "
      f"for {figures['torch_cuda_arch_list']}: {seconds // 60} min {seconds % 60} s on {figures['cpus']} CPUs "
      f"({cpu_seconds // 60} min of CPU time; load average {figures['load_average']:.1f} at the end), "
      f"peak memory {figures['peak_memory_bytes'] / 2**30:.1f} GiB (largest process "
      f"{figures['largest_process_bytes'] / 2**30:.1f} GiB), wheel {figures['wheel_bytes'] / 1e6:.1f} MB, "
      f"extensions {figures['extensions_installed_bytes'] / 1e6:.1f} MB installed")
PY
