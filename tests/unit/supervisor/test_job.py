"""trainpod.supervisor.job: the supervised job takes the RunSpec from its environment, checks, then becomes the agent."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from trainpod.contract import RUN_SPEC_VAR
from trainpod.runspec import RunSpec, Target
from trainpod.supervisor.job import gloo_fallback_note
from trainpod.topology import Topology

ENTRYPOINT = str(Path(__file__).resolve().parents[3] / "entrypoint")

TOPOLOGY = Topology(source="pai", nnodes=2, node_rank=1, nproc_per_node=2, master_addr="10.0.0.2", master_port=29877,
                    backend="gloo", interface=None, interface_reason="decided at run time",
                    origins={"master_addr": "PAI_HOST_IP_worker_0"}, warnings=("no port label",))


def test_a_spec_round_trips_through_json():
    for target in (Target.for_example("cifar10-ddp", ["--epochs", "1"]), Target(command=("python", "train.py", "100%"))):
        spec = RunSpec(topology=TOPOLOGY, target=target, connect_timeout=5.0, term_grace=25.0, max_restarts=3,
                       progress_window=30.0, rejoin_timeout=12.5)
        assert RunSpec.from_json(spec.to_json()) == spec


def test_the_job_module_needs_its_spec():
    env = {k: v for k, v in os.environ.items() if k != RUN_SPEC_VAR}
    result = subprocess.run([sys.executable, "-m", "trainpod.supervisor.job"], env={**env, "PYTHONPATH": ENTRYPOINT},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 64
    assert result.stderr.strip() == f"trainpod.supervisor.job: error: {RUN_SPEC_VAR} is not set: this module is started by `trainpod run`"


@pytest.mark.slow
def test_a_preflight_failure_is_one_line_with_the_node_prefix():
    spec = RunSpec(topology=Topology(source="torchrun", nnodes=2, node_rank=1, nproc_per_node=1, master_addr="no-such-host.invalid",
                                     master_port=29500, backend="gloo", interface=None),
                   target=Target(command=("true",)), connect_timeout=0.5, term_grace=25.0, max_restarts=0)
    result = subprocess.run([sys.executable, "-m", "trainpod.supervisor.job"],
                            env={**os.environ, "PYTHONPATH": ENTRYPOINT, **spec.to_env()}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 69, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[node1] trainpod: error: master address 'no-such-host.invalid'")


def test_a_cuda_torch_without_gpus_says_it_falls_back_to_gloo():
    fallback = replace(TOPOLOGY, origins={**TOPOLOGY.origins, "backend": "default (no GPU visible)"})
    note = gloo_fallback_note(fallback, "13.0")
    assert note.startswith("no GPU visible: gloo instead of NCCL") and "CUDA 13.0" in note and "--gpus all" in note
    assert gloo_fallback_note(fallback, None) is None  # a CPU build of torch: gloo is all it has
    assert gloo_fallback_note(replace(fallback, origins={"backend": "--backend"}), "13.0") is None  # asked for
    assert gloo_fallback_note(replace(fallback, backend="nccl", origins={"backend": "default (GPUs visible)"}), "13.0") is None


def test_an_elastic_etcd_spec_round_trips_through_json():
    from trainpod.topology import Rendezvous

    topology = Topology(source="etcd", nnodes=4, node_rank=None, nproc_per_node=1, master_addr="10.0.0.9", master_port=2379,
                        backend="gloo", interface="eth0",
                        rendezvous=Rendezvous(backend="etcd-v3", endpoint="10.0.0.9:2379", id="job-1", min_nodes=2, max_nodes=4,
                                              settings={"last_call_timeout": "3"}, id_origin="--rdzv-id"))
    spec = RunSpec(topology=topology, target=Target(command=("x",)), connect_timeout=5.0, term_grace=25.0, max_restarts=3)
    again = RunSpec.from_json(spec.to_json())
    assert again == spec and again.topology.rdzv.elastic and again.topology.node_rank is None


# The job's start as run() makes it, with a preflight that takes a second: which thread imported torch, which ran the
# checks, and what the checks' error becomes.
CHECK_WHILE_IMPORTING = """
import builtins, sys, threading, time
from trainpod.errors import UnreachableError
from trainpod.runspec import RunSpec
from trainpod.supervisor import job

importers = set()
plain = builtins.__import__
def watched(name, *args, **kwargs):
    if name.split(".")[0] == "torch":
        importers.add(threading.current_thread().name)
    return plain(name, *args, **kwargs)
builtins.__import__ = watched

checked = []
def preflight(topology, env, **_):
    checked.append(threading.current_thread().name)
    time.sleep(1)
    if sys.argv[1] == "fails":
        raise UnreachableError("the master did not answer")
    return topology
job.run_preflight = preflight
spec = RunSpec.from_json(sys.argv[2])
try:
    topology, thread = job._check_while_importing(spec, {}, print)
    print(sorted(importers), checked, topology == spec.topology, thread.is_alive(), "torch.distributed.run" in sys.modules)
except UnreachableError as error:
    print(sorted(importers), checked, "raised:", error)
"""


@pytest.mark.slow
def test_torch_is_imported_by_the_main_thread_while_the_checks_run_on_another():
    # The node's fork server is a copy of the job's process: a copy made after another thread ran torch's import (its
    # MKL code) could inherit MKL's allocator lock held, and every rank forked from it spun at its first matrix product
    # (the suite: ranks busy and silent before their first step). Before, the import ran on the thread.
    spec = RunSpec(topology=TOPOLOGY, target=Target(command=("true",)), connect_timeout=5.0, term_grace=25.0, max_restarts=0)
    env = {**os.environ, "PYTHONPATH": ENTRYPOINT}
    ok = subprocess.run([sys.executable, "-c", CHECK_WHILE_IMPORTING, "passes", spec.to_json()], env=env,
                        capture_output=True, text=True, timeout=180)
    assert ok.stdout.strip() == "['MainThread'] ['trainpod-preflight'] True False True", ok.stdout + ok.stderr
    failed = subprocess.run([sys.executable, "-c", CHECK_WHILE_IMPORTING, "fails", spec.to_json()], env=env,
                            capture_output=True, text=True, timeout=180)
    assert failed.stdout.strip() == "['MainThread'] ['trainpod-preflight'] raised: the master did not answer", failed.stderr
    # torch made unimportable: the main thread's import swallows it, and the agent's own import raises it again
    broken = ("import sys; sys.modules['torch'] = None; from trainpod.supervisor import job; job._import_the_launcher(); "
              "import torch.distributed.run")
    result = subprocess.run([sys.executable, "-c", broken], env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1].startswith("ModuleNotFoundError"), result.stderr
    assert result.stderr.count("Traceback") == 1


# The agent's end (exit_before_finalization) with a daemon thread in a store call, as torch's rendezvous keep-alive is
# when the store's host went away, a non-daemon thread still finishing, and an atexit handler: the thread is joined,
# the handler runs, and the process ends with the code. (The interpreter's own end aborted such a process when the call
# returned during finalization, "terminate called without an active exception": timing-dependent, docs/shutdown.md.)
AGENT_END = """
import atexit, sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from trainpod.supervisor.job import exit_before_finalization

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
entered = threading.Event()
threading.Thread(target=lambda: (entered.set(), store.get("never set")), daemon=True).start()
threading.Thread(target=lambda: (time.sleep(0.5), print("joined", flush=True))).start()
atexit.register(print, "atexit ran", flush=True)
entered.wait()
exit_before_finalization(69)
"""


@pytest.mark.slow
def test_the_agent_ends_with_its_code_after_its_threads_and_atexit_handlers_with_a_daemon_thread_in_a_store_call():
    ended = subprocess.run([sys.executable, "-c", AGENT_END], capture_output=True, text=True, timeout=60)
    assert ended.returncode == 69 and "terminate called" not in ended.stderr, ended.stderr[-2000:]
    assert ended.stdout.splitlines() == ["joined", "atexit ran"], ended.stdout
