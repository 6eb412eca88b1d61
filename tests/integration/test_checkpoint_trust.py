"""A crafted checkpoint under a real `trainpod run` (host: torchrun and supervisord, no Docker): every
rank refuses it with one line, the job ends with 78 without a restart, and the command in its pickle
never runs; --trust-checkpoints reaches the ranks and lets it load (and run)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.checkpoints import poisoned
from fixtures.ports import free_port

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.slow]

ENTRYPOINT = str(Path(__file__).resolve().parents[2] / "entrypoint")
# What a user's script does with the Checkpointer: resume, and exit with the error's code.
SCRIPT = """\
import sys
from trainpod.train.checkpoint import Checkpointer, CheckpointError
try:
    step, state = Checkpointer(sys.argv[1]).load_latest()
except CheckpointError as error:
    print(f"train.py: error: {error}", file=sys.stderr, flush=True)
    sys.exit(error.exit_code)
print(f"train.py: loaded step {step}", flush=True)
"""


def run(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "PET_", "PAI_"))}
    command = [sys.executable, "-m", "trainpod", "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               "--max-restarts", "2", "--restart-backoff", "0.1", "--warm-start", "off", *flags,
               "--", sys.executable, str(tmp_path / "train.py"), str(tmp_path / "ckpt")]
    return subprocess.run(command, env={**env, "PYTHONPATH": ENTRYPOINT, "OMP_NUM_THREADS": "1"}, cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)


def test_a_crafted_checkpoint_ends_the_job_with_78_and_runs_nothing(tmp_path):
    marker = tmp_path / "MARKER"
    path = poisoned(tmp_path / "ckpt", marker)
    result = run(tmp_path)
    log = result.stdout
    assert not marker.exists(), log
    assert result.returncode == 78, log
    refusals = [line for line in log.splitlines() if f"train.py: error: {path}: not loaded: it holds posix.system" in line]
    # Each rank refuses it in one line; trainpod.agent.ranklog shows a script's last error line once for all ranks.
    assert len(refusals) >= 1 and "exited with 78 (a configuration error): not restarting" in log, log
    assert "Traceback" not in log and "restart 1 of" not in log, log


def test_trust_checkpoints_reaches_the_ranks_and_loads_it(tmp_path):
    marker = tmp_path / "MARKER"
    path = poisoned(tmp_path / "ckpt", marker)
    result = run(tmp_path, "--trust-checkpoints")
    log = result.stdout
    assert result.returncode == 0, log
    assert marker.exists(), log  # the file's code ran: that is what trusting it means
    assert log.count("train.py: loaded step 7") == 2, log
    trusting = [line for line in log.splitlines() if f"{path}: it holds posix.system" in line and "full unpickler" in line]
    assert len(trusting) == 2, log  # once per rank
