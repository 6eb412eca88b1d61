"""trainpod.launcher.left_out: `trainpod explain --left-out` reads the nodes a run keeps out, as the agents recorded
them (trainpod.rendezvous.exclusions), from each backend's real store: c10d's TCPStore, etcd-v3 and torch's etcd."""

import json
import os
import uuid
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

from fixtures.cli import in_process  # noqa: E402
from fixtures.ports import free_port  # noqa: E402
from trainpod.rendezvous import exclusions  # noqa: E402
from trainpod.rendezvous.exclusions import Exclusion, Node  # noqa: E402

LINE = "rank 4 failed the same way twice: it leaves the elastic job"


def explain(*flags: str) -> str:
    result = in_process(["explain", "--nnodes", "1:3", "--left-out", *flags], {"PATH": os.environ["PATH"]})
    assert result.returncode == 0, result.stderr
    return result.stdout


def recorded(store) -> None:
    exclusions.record(store, Exclusion.of(Node("elsewhere", "boot"), 1, "another node's"))
    exclusions.record(store, Exclusion.of(Node.this(), 1, LINE))


def test_c10d_the_records_in_the_endpoint_agent_s_store():
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    out = explain("--rdzv-endpoint", f"127.0.0.1:{port}")
    assert "left out of rendezvous trainpod: none" in out, out
    recorded(store)
    out = explain("--rdzv-endpoint", f"127.0.0.1:{port}")
    lines = out.split("left out of rendezvous trainpod (", 1)[1].splitlines()
    assert lines[1].startswith("  elsewhere (boot boot), since ") and "exit 1: another node's" in lines[1], out
    assert lines[2].startswith(f"  {Node.this().host} (boot ") and lines[2].endswith(f"exit 1: {LINE}  <- this node"), out
    data = json.loads(in_process(["explain", "--nnodes", "1:3", "--left-out", "--json", "--rdzv-endpoint", f"127.0.0.1:{port}"],
                                 {"PATH": os.environ["PATH"]}).stdout)
    assert [(n["host"], n["this_node"]) for n in data["left_out"]["nodes"]] == [("elsewhere", False), (Node.this().host, True)]


def test_etcd_v3_the_records_of_the_job_s_current_generation(etcd):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from trainpod.rendezvous import etcd_v3, generation

    job = f"left-out-{uuid.uuid4().hex[:6]}"
    handler = etcd_v3.create_handler(RendezvousParameters("etcd-v3", etcd.endpoint, generation.run_id(job, 0), 1, 3, read_timeout=5))
    recorded(exclusions.job_store(handler))
    out = explain("--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", job)
    assert f"left out of rendezvous {job}.g0 (" in out and f"{LINE}  <- this node" in out, out


@pytest.mark.slow
def test_torch_s_etcd_the_records_under_the_run_s_directory(etcd_v2):
    pytest.importorskip("etcd")
    from torch.distributed.elastic.rendezvous import RendezvousParameters, etcd_rendezvous

    job = f"left-out-{uuid.uuid4().hex[:6]}"
    handler = etcd_rendezvous.create_rdzv_handler(RendezvousParameters("etcd", etcd_v2.endpoint, f"{job}.g0", 1, 3, timeout=30))
    recorded(exclusions.job_store(handler))
    out = explain("--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_v2.endpoint, "--rdzv-id", job)
    assert f"left out of rendezvous {job}.g0 (" in out and f"{LINE}  <- this node" in out, out


@pytest.mark.slow
def test_a_rendezvous_that_does_not_answer_is_one_line_and_a_fixed_size_job_has_none():
    out = explain("--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--connect-timeout", "1")
    assert "left out: not read from the c10d rendezvous at 127.0.0.1:" in out and "Traceback" not in out, out
    result = in_process(["explain", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--left-out"],
                        {"PATH": os.environ["PATH"]})
    assert "left out: none (a fixed-size job ends instead of leaving a node out)" in result.stdout, result
