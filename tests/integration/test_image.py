"""The image as users run it: a hardened `docker run` trains, and a code change is a small layer."""

import json
import re
import subprocess

import pytest

from fixtures.docker_env import IMAGE, run
from trainpod.examples.reporting import parse_metrics_line

pytestmark = [pytest.mark.docker]

# The README's hardened run: read-only root, no capabilities, no new privileges, writable tmpfs
# only where the job writes, owned by the image's user (uid 1000).
LOCKED = ["--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--shm-size", "256m"]
HARDENED = [*LOCKED, "--tmpfs", "/workspace/output:uid=1000,gid=1000"]


def test_a_hardened_run_trains_and_writes_its_metrics(docker_ready):
    result = run("docker", "run", "--rm", *HARDENED, IMAGE, "trainpod", "run", "--nproc-per-node", "2", "--example",
                 "cifar10-ddp", "--", "--epochs", "1", "--synthetic-samples", "512", timeout=300, check=False)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    metrics = parse_metrics_line(result.stdout)
    assert metrics["ranks_agree"] and metrics["metrics"] == "/workspace/output/metrics.json"
    assert "Traceback" not in result.stdout + result.stderr


def test_a_read_only_output_directory_is_78_at_once_with_the_mounts_that_fix_it(docker_ready):
    result = run("docker", "run", "--rm", *LOCKED, IMAGE, "trainpod", "run", "--nproc-per-node", "2", "--example",
                 "cifar10-ddp", timeout=120, check=False)
    assert result.returncode == 78, (result.stdout + result.stderr)[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == ["[node0] trainpod: error: the output directory /workspace/output (--output-dir, TRAINPOD_OUTPUT_DIR) "
                      "is not writable by uid 1000: Read-only file system; mount a writable directory there (docker run -v "
                      "HOSTDIR:/workspace/output, or --tmpfs /workspace/output:uid=1000,gid=1000) or choose another one"], result.stderr
    assert "rank" not in result.stderr and "restarting" not in result.stderr


def layers(image: str) -> list[tuple[int, str]]:
    """(size in bytes, the instruction) of each layer, the newest first."""
    out = subprocess.run(["docker", "history", "--no-trunc", "--human=false", "--format", "{{json .}}", image],
                         capture_output=True, text=True, check=True).stdout
    return [(int(entry["Size"]), entry["CreatedBy"]) for entry in map(json.loads, out.splitlines())]


def test_trainpods_own_code_is_a_layer_of_well_under_10_mb(docker_ready):
    # Docker's cache rebuilds a layer and everything after it: trainpod's wheel must come after the
    # venv (torch and the other wheels, in layers of their own) and be small, so that a code change
    # is a small push and pull.
    history = layers(IMAGE)
    own = next(i for i, (_, created) in enumerate(history) if re.search(r"COPY .*/tmp/trainpod/", created))
    after_venv = history[:own + 1]
    assert any("trainpod" in created and "pip" in created for _, created in after_venv), [c[:120] for _, c in after_venv]
    assert sum(size for size, _ in after_venv) < 10e6, [(size, created[:80]) for size, created in after_venv]
    assert sum(size for size, _ in history[own + 1:]) > 500e6  # torch and the rest are below it


def test_every_rendezvous_backend_loads_in_the_image(docker_ready):
    # torch's `etcd` backend imports python-etcd, a source-only package the wheelhouse builds a wheel
    # of (Makefile SOURCE_ONLY); etcd-v3 is trainpod's own; c10d is torch's.
    code = ("import etcd; from torch.distributed.elastic.rendezvous import etcd_rendezvous, etcd_rendezvous_backend; "
            "from trainpod.rendezvous import etcd_v3; print('backends ok', etcd.__name__)")
    result = run("docker", "run", "--rm", "--entrypoint", "/opt/trainpod/venv/bin/python", IMAGE, "-c", code,
                 timeout=120, check=False)
    assert result.returncode == 0 and "backends ok etcd" in result.stdout, (result.stdout + result.stderr)[-3000:]
