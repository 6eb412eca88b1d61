"""Two jobs whose ids differ never meet, on a real etcd: `team/a`, `team-a`, `team a` (once one world of 2).

The ids as trainpod resolves them, then the keys each backend writes for them: distinct; and two real
`trainpod run` jobs with --rdzv-id team/a and team-a on one etcd each train alone (world 1).
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from fixtures.etcd import meet
from trainpod.launcher.resolve import Options, resolve_topology
from trainpod.rendezvous import ids
from trainpod.rendezvous.etcd_http import EtcdClient

JOBS = ("team/a", "team-a", "team a", "team_a")
ENTRYPOINT = str(Path(__file__).resolve().parents[3] / "entrypoint")


def resolved_id(job: str, endpoint: str, as_variable: bool = False) -> str:
    flags = {"nnodes": "1:2", "rdzv_backend": "etcd-v3", "rdzv_endpoint": endpoint}
    env = {"TRAINPOD_RDZV_ID": job} if as_variable else {}
    if not as_variable:
        flags["rdzv_id"] = job
    return resolve_topology(Options(**flags), env, resolve_names=False).rdzv.id


def keys(client: EtcdClient, prefix: str) -> set[str]:
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    answer = client.call("/v3/kv/range", {"key": base64.b64encode(prefix.encode()).decode(),
                                          "range_end": base64.b64encode(end.encode()).decode(), "keys_only": True})
    return {base64.b64decode(kv["key"]).decode() for kv in answer.get("kvs", [])}


def test_the_ids_trainpod_resolves_are_distinct_and_the_same_from_a_flag_or_a_variable():
    flags = [resolved_id(job, "e:2379") for job in JOBS]
    assert len(set(flags)) == len(JOBS)
    assert flags == [resolved_id(job, "e:2379", as_variable=True) for job in JOBS]
    assert [ids.unescape(i) for i in flags] == list(JOBS)


@pytest.mark.parametrize("flags,env,code,origin", [
    ({"rdzv_id": "team\na"}, {}, 64, "--rdzv-id"),
    ({}, {"TRAINPOD_RDZV_ID": "team\ta"}, 78, "TRAINPOD_RDZV_ID"),
    ({}, {"PET_RDZV_ID": "team\u200ba", "PET_NNODES": "1:2"}, 78, "PET_RDZV_ID"),
])  # fmt: skip
def test_an_id_that_cannot_be_kept_is_one_line_by_its_origin(flags, env, code, origin):
    from trainpod.errors import TrainpodError

    with pytest.raises(TrainpodError) as refused:
        resolve_topology(Options(nnodes="1:2", rdzv_backend="etcd-v3", rdzv_endpoint="e:2379", **flags), env,
                         resolve_names=False)
    line = str(refused.value)
    assert refused.value.exit_code == code and line.startswith(f"{origin}=") and "printable" in line and "\n" not in line


@pytest.mark.slow
def test_etcd_v3_keeps_each_job_in_keys_of_its_own(etcd):
    pytest.importorskip("torch")
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from trainpod.rendezvous import etcd_v3, generation

    client = EtcdClient(etcd.endpoint, 5)
    tag = uuid.uuid4().hex[:6]
    run_ids = [generation.run_id(resolved_id(f"{job}{tag}", etcd.endpoint), 0) for job in JOBS]
    handlers = [etcd_v3.create_handler(RendezvousParameters("etcd-v3", etcd.endpoint, run_id, 1, 2, read_timeout=5,
                                                            local_addr="127.0.0.1", join_timeout=30, last_call_timeout=1))
                for run_id in run_ids]  # fmt: skip
    infos = meet(handlers)
    assert [info.world_size for info in infos] == [1] * len(JOBS)  # each alone: none met another
    states = {key for key in keys(client, etcd_v3.KEY_PREFIX) if key.endswith("/state") and tag in key}
    assert states == {f"{etcd_v3.KEY_PREFIX}{run_id}/state" for run_id in run_ids}
    for handler in handlers:
        handler.shutdown()


@pytest.mark.slow
def test_torchs_etcd_backend_keeps_each_job_in_keys_of_its_own(etcd_v2):
    pytest.importorskip("etcd")
    pytest.importorskip("torch")
    import etcd as python_etcd
    from torch.distributed.elastic.rendezvous import RendezvousParameters, etcd_rendezvous

    tag = uuid.uuid4().hex[:6]
    run_ids = [f"{resolved_id(f'{job}{tag}', etcd_v2.endpoint)}.g0" for job in JOBS]
    for run_id in run_ids:
        handler = etcd_rendezvous.create_rdzv_handler(RendezvousParameters("etcd", etcd_v2.endpoint, run_id, 1, 1,
                                                                           timeout=30, last_call_timeout=1))
        assert handler.next_rendezvous().world_size == 1
    host, port = etcd_v2.endpoint.split(":")
    listed = python_etcd.Client(host, int(port)).read("/torchelastic/p2p")
    runs = {child.key.rpartition("/")[2] for child in listed.children if tag in child.key}
    assert runs == {f"run_{run_id}" for run_id in run_ids}  # one directory per job, its id exactly as resolved


@pytest.mark.slow
def test_two_jobs_team_slash_a_and_team_dash_a_each_train_alone(etcd, tmp_path):
    """Today's case: both joined one world of 2. Now each job forms its own world of 1 (after its last call)."""
    pytest.importorskip("torch")
    script = tmp_path / "world.py"
    script.write_text("import os\nprint('WORLD', os.environ['WORLD_SIZE'], os.environ['TORCHELASTIC_RUN_ID'], flush=True)\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PAI_", "PET_", "TRAINPOD_", "MASTER_", "SLURM_"))}
    env = {**clean, "PYTHONPATH": ENTRYPOINT, "OMP_NUM_THREADS": "1"}
    tag = uuid.uuid4().hex[:6]
    jobs = [subprocess.Popen([sys.executable, "-m", "trainpod", "run", "--no-supervise", "--nnodes", "1:2",
                              "--nproc-per-node", "1", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint,
                              "--rdzv-id", f"{tag}team{sep}a", "--connect-timeout", "30", "--", sys.executable, str(script)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
            for sep in ("/", "-")]  # fmt: skip
    outputs = [job.communicate(timeout=180)[0] for job in jobs]
    for job, out in zip(jobs, outputs):
        assert job.returncode == 0, out
    worlds = [line.split()[-3:] for out in outputs for line in out.splitlines() if "WORLD" in line]
    assert sorted(worlds) == [["WORLD", "1", f"{tag}team-a.g0"], ["WORLD", "1", f"{tag}team@2Fa.g0"]], outputs
