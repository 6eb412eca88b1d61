"""Every node the same software (trainpod.agent.consistency), on this host: two nodes of a fixed-size c10d job
(`trainpod run --nnodes 2`, each in a directory of its own, as two hosts would be), each runs `python train.py`.

- Node 1's train.py differs by one line: both nodes end with 78 and one error line that names the field
  (script) and both values, before any rank runs (no rank writes its marker); supervisord retries nothing.
- The same with --consistency warn: the line is a warning, the job trains and ends with 0.
- Both scripts the same: not a word about it, 0.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.elastic_host import clean_env
from fixtures.ports import free_port
from fixtures.processes import communicate_all

pytestmark = pytest.mark.slow

SCRIPT = """\
import os
from pathlib import Path

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
Path(os.environ["MARKER_DIR"], f"rank{dist.get_rank()}").write_text("trained")
dist.destroy_process_group()
"""


def run_job(tmp_path: Path, scripts: tuple[str, str], *extra: str) -> tuple[list[int], list[str], Path, float]:
    port = free_port()
    markers = tmp_path / "markers"
    markers.mkdir()
    procs = []
    started = time.monotonic()
    for rank, script in enumerate(scripts):
        home = tmp_path / f"node{rank}"  # the job's code, where each node has it
        home.mkdir()
        (home / "train.py").write_text(script)
        argv = [sys.executable, "-m", "trainpod", "run", "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(port), "--connect-timeout", "60", *extra,
                "--", sys.executable, "train.py"]
        procs.append(subprocess.Popen(argv, cwd=home, env=clean_env(MARKER_DIR=str(markers)), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = communicate_all(procs, 240)
    return [proc.returncode for proc in procs], outputs, markers, time.monotonic() - started


def test_a_node_with_another_script_ends_the_job_with_78_before_any_rank_runs(tmp_path):
    codes, outputs, markers, took = run_job(tmp_path, (SCRIPT, SCRIPT + "print('one line more')\n"))
    assert codes == [78, 78], outputs
    for output in outputs:
        errors = [line for line in output.splitlines() if "trainpod: error:" in line]
        assert len(errors) == 1, output
        assert "the nodes run different software: script " in errors[0], errors[0]
        assert "on node 0 (" in errors[0] and "on node 1 (" in errors[0] and "--consistency warn" in errors[0]
        assert "Traceback" not in output and "restart" not in output, output
    assert list(markers.iterdir()) == []  # no rank ran
    print(f"\nconsistency: a different script on node 1 -> 78 on both nodes after {took:.1f} s")


def test_with_warn_the_same_difference_is_a_warning_and_the_job_trains(tmp_path):
    codes, outputs, markers, _ = run_job(tmp_path, (SCRIPT, SCRIPT + "print('one line more')\n"), "--consistency", "warn")
    assert codes == [0, 0], outputs
    for output in outputs:
        assert "trainpod: warning: the nodes run different software: script " in output, output
    assert sorted(p.name for p in markers.iterdir()) == ["rank0", "rank1"]


def test_the_same_script_on_both_nodes_says_nothing(tmp_path):
    codes, outputs, markers, _ = run_job(tmp_path, (SCRIPT, SCRIPT))
    assert codes == [0, 0], outputs
    assert not any("software" in output for output in outputs), outputs
    assert sorted(p.name for p in markers.iterdir()) == ["rank0", "rank1"]
