"""trainpod.supervisor.job: the supervised job takes the RunSpec from its environment, checks, then becomes the agent."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

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


def test_the_launcher_is_imported_beside_the_checks_and_a_failed_import_is_left_to_the_agent():
    """trainpod.supervisor.job imports torch's launcher on a thread while the preflight waits for the master."""
    check = ("import sys; from trainpod.supervisor import job; thread = job._import_the_launcher(); assert thread.daemon; "
             "thread.join(120); print('torch.distributed.run' in sys.modules, 'trainpod.agent.agent' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", check], env={**os.environ, "PYTHONPATH": ENTRYPOINT},
                            capture_output=True, text=True, timeout=180)
    assert (result.returncode, result.stdout) == (0, "True True\n"), result.stderr
    # torch made unimportable (sys.modules['torch'] = None): the thread swallows it, the main thread's import raises it
    broken = ("import sys; sys.modules['torch'] = None; from trainpod.supervisor import job; job._import_the_launcher().join(60); "
              "import torch.distributed.run")
    result = subprocess.run([sys.executable, "-c", broken], env={**os.environ, "PYTHONPATH": ENTRYPOINT},
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1].startswith("ModuleNotFoundError"), result.stderr
    assert result.stderr.count("Traceback") == 1  # the main thread's, not the import thread's


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


def test_the_agent_ends_with_its_code_after_its_threads_and_atexit_handlers_with_a_daemon_thread_in_a_store_call():
    ended = subprocess.run([sys.executable, "-c", AGENT_END], capture_output=True, text=True, timeout=60)
    assert ended.returncode == 69 and "terminate called" not in ended.stderr, ended.stderr[-2000:]
    assert ended.stdout.splitlines() == ["joined", "atexit ran"], ended.stdout
