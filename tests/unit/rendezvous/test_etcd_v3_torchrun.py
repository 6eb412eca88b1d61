"""Two real torchrun agents (`python -m trainpod.rendezvous.torchrun`) meet over etcd-v3 and all_reduce.

On this host, with etcd started with and without --enable-v2: the v3 backend needs only the v3 API.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch")

ENTRYPOINT = Path(__file__).resolve().parents[3] / "entrypoint"
TIMEOUT_S = 120

SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {t.item():g}", flush=True)
dist.destroy_process_group()
"""


def agents(endpoint: str, script: Path, count: int = 2, run_id: str | None = None) -> list[subprocess.CompletedProcess]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "TORCHELASTIC_", "PET_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ENTRYPOINT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    run_id = run_id or f"torchrun-{uuid.uuid4().hex[:8]}"
    cmd = [
        sys.executable, "-m", "trainpod.rendezvous.torchrun", "--nnodes", "1:2", "--nproc-per-node", "1",
        "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--rdzv-conf", "read_timeout=10,join_timeout=60", "--local-addr", "127.0.0.1", "--max-restarts", "0",
        str(script),
    ]  # fmt: skip
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for _ in range(count)]  # fmt: skip
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"torchrun ran past {TIMEOUT_S} s:\n{out}")
        results.append(subprocess.CompletedProcess(cmd, proc.returncode, out, None))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("server", ["etcd", "etcd_v2"])
def test_two_agents_form_world_two_and_all_reduce(server, request, tmp_path):
    etcd = request.getfixturevalue(server)
    script = tmp_path / "all_reduce.py"
    script.write_text(SCRIPT)
    started = time.monotonic()
    results = agents(etcd.endpoint, script)
    elapsed = time.monotonic() - started
    for result in results:
        assert result.returncode == 0, result.stdout
    lines = sorted(line for r in results for line in r.stdout.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0 of 2: sum 3", "rank 1 of 2: sum 3"], [r.stdout for r in results]
    print(f"two agents over etcd-v3 ({server}): world 2 and all_reduce done in {elapsed:.1f} s")


@pytest.mark.slow
def test_a_bad_endpoint_ends_the_agent_with_one_line(tmp_path):
    from fixtures.etcd import dead_endpoint

    script = tmp_path / "all_reduce.py"
    script.write_text(SCRIPT)
    dead = dead_endpoint()
    (result,) = agents(dead, script, count=1)
    assert result.returncode != 0
    assert f"etcd-v3 rendezvous: etcd unreachable ({dead}: connection refused)" in result.stdout
