"""imagenet-elastic across world-size changes on this host (real `trainpod run` and torchrun, no etcd):
3 processes train part of the first epoch, 2 resume from the checkpoint, then 4 finish the job.
The ledger in the checkpoint proves every sample of both epochs trained exactly once, the
membership timeline records each world, and the LR rule scales by the first start's world.
(Nodes leaving and joining a running job over etcd: test_elastic_host.py and test_compose_elastic.py.)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.ports import free_port

pytestmark = [pytest.mark.slow]
torch = pytest.importorskip("torch")

ENTRYPOINT = str(Path(__file__).resolve().parents[2] / "entrypoint")
SAMPLES, BATCH = 120, 8
ARGS = ["--arch", "resnet18", "--width", "8", "--image-size", "16", "--synthetic-samples", str(SAMPLES), "--synthetic-classes", "4",
        "--workers", "0", "--epochs", "2", "--batch-size", str(BATCH), "--checkpoint-every", "3", "--log-every", "1"]


def train(tmp_path: Path, nproc: int, *extra: str) -> tuple[str, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "PET_", "PAI_"))}
    env.update(PYTHONPATH=ENTRYPOINT, OMP_NUM_THREADS="1")
    # A port of its own: a single node's default, 29500, is every other such job's too (pytest-xdist runs them side by side).
    command = [sys.executable, "-m", "trainpod", "run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
               "--example", "imagenet-elastic", "--", *ARGS, *extra, "--output-dir", str(tmp_path / "out"),
               "--checkpoint-dir", str(tmp_path / "ckpt")]
    result = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    log = result.stdout
    assert result.returncode == 0, log[-4000:]
    return log, json.loads((tmp_path / "out" / "metrics.json").read_text())


def test_three_then_two_then_four_processes_train_each_sample_once(tmp_path):
    # World 3: 7 steps of 3 x 8 = 168 samples > one epoch of 120, so epoch 2 is under way.
    _, first = train(tmp_path, 3, "--max-steps", "7")
    assert first["exactly_once"] and first["steps"] == 7 and first["ledger"]["complete"] == [1]
    # World 2 from the checkpoint of step 7 (the end of a run is checkpointed), up to step 10.
    log, second = train(tmp_path, 2, "--max-steps", "10")
    assert "resumed from the checkpoint of step 7 (epoch 2)" in log
    assert second["exactly_once"] and second["steps"] == 10
    # World 4 finishes epoch 2: its last step has fewer samples than 4 x 8, and some ranks none.
    log, last = train(tmp_path, 4)
    assert "resumed from the checkpoint of step 10 (epoch 2)" in log
    assert last["exactly_once"], last["ledger"]["problems"]
    assert last["ledger"]["complete"] == [1, 2]
    assert last["ledger"]["epochs"] == {str(e): {"samples": SAMPLES, "trained": SAMPLES, "repeated": 0, "missing": 0,
                                                  "extra": 0} for e in (1, 2)}
    assert [point[1] for point in last["membership"]] == [3, 2, 4]
    assert [point[0] for point in last["membership"]] == [0, 7, 10]
    # Steps: 5 for epoch 1 (120 / 24), 2 + 3 (world 2: 48 samples) + 2 (world 4: the other 24 of epoch 2's 120).
    done_before = 7 * 3 * BATCH - SAMPLES + 3 * 2 * BATCH  # epoch 2's samples trained before world 4
    assert last["steps"] == 10 + -(-(SAMPLES - done_before) // (4 * BATCH))
    assert last["reference_world"] == 3 and last["world_size"] == 4
    assert len(set(last["rank_checksums"])) == 1
