"""trainpod.agent_policy: what the agent keeps across the worker groups it starts and stops."""

import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from fixtures.ports import free_port  # noqa: E402
from trainpod import agent_policy, control, hangwatch  # noqa: E402


def fixed_size_agent(monkeypatch, tmp_path, node_rank: int, min_nodes: int = 2):
    """torch's agent with trainpod's policy, as trainpod.agent builds it, for node `node_rank` of a fixed-size
    2-node c10d job whose store (node 0's) this process hosts (elastic 1:2 with `min_nodes` 1)."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    for name, value in {"TRAINPOD_NODE_RANK": str(node_rank), "TRAINPOD_NNODES": "2", "TRAINPOD_MIN_NODES": str(min_nodes),
                        "TRAINPOD_PROGRESS_DIR": str(tmp_path), "TRAINPOD_REJOIN_TIMEOUT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TRAINPOD_SUPERVISOR_DIR", raising=False)
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    handler = DynamicRendezvousHandler.from_backend("policy", store, C10dRendezvousBackend(store, "policy"), min_nodes, 2,
                                                    local_addr="127.0.0.1")

    class Agent(agent_policy.AgentPolicy, hangwatch.WatchedAgent, LocalElasticAgent):
        pass

    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=handler, entrypoint="true", max_restarts=3)
    return Agent(spec, logs_specs=DefaultLogsSpecs())


@pytest.mark.parametrize("node_rank", [1, 0], ids=["node 1", "node 0, the store's host"])
def test_the_job_control_outlives_every_stop_of_the_workers_and_ends_with_the_agent(monkeypatch, tmp_path, node_rank):
    # Issue 29: torch stops the ranks before every worker-group restart (_restart_workers) and every membership
    # change through _stop_workers -> _shutdown. JobControl used to close there: from then on the master's last
    # answer was frozen, and --rejoin-timeout later node 1 declared the live master lost (69).
    monkeypatch.setattr(control, "POLL_S", 0.05)  # "unreachable" after 2.5 polls without an answer: 0.125 s
    agent = fixed_size_agent(monkeypatch, tmp_path, node_rank)
    job_control = agent.control
    assert job_control is not None and job_control.node_rank == node_rank
    for _ in range(3):  # three restarts' worth of stops
        agent._stop_workers(agent._worker_group)
    time.sleep(20 * control.POLL_S)  # well past the 2.5 polls after which a silent master counts as unreachable
    assert job_control._thread.is_alive()
    assert job_control.unreachable_s() == 0.0
    assert job_control.reachable_now()

    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    succeeded = RunResult(state=WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in agent._worker_group.workers})
    monkeypatch.setattr(LocalElasticAgent, "_invoke_run", lambda self, role: succeeded)  # the ranks' part of run()
    assert agent.run() is succeeded  # torch's run() ends the agent: then, and only then, the control ends
    assert not job_control._thread.is_alive()


def failure(exitcode: int, timestamp: int, local_rank: int = 0):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    made = ProcessFailure(local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode, error_file="")
    made.timestamp = timestamp
    return made


def test_a_rank_killed_by_a_signal_is_named_before_the_peers_that_lost_their_connection_to_it():
    # Issue 29: with --warm-start on, rank 3 was SIGKILLed and node 1 said "rank 2 exited with 1": rank 2's error
    # file carried the time of its lost-connection exception, earlier than when torch saw rank 3 gone.
    failures = {2: failure(1, timestamp=100, local_rank=0), 3: failure(-9, timestamp=101, local_rank=1)}
    assert agent_policy._first_failure(failures)[0] == 3
    # torch's own SIGTERM of the other ranks is never the cause; a usage error (64) says more than a signal
    assert agent_policy._first_failure({0: failure(-15, 99), 1: failure(1, 100, 1)})[0] == 1
    assert agent_policy._first_failure({0: failure(-9, 100), 1: failure(64, 101, 1)})[0] == 1
    assert agent_policy._first_failure({0: failure(1, 100), 1: failure(1, 99, 1)})[0] == 1  # else the earliest


def closed(handler) -> bool:
    handler._state_holder.sync()
    return handler._state_holder.state.closed


@pytest.mark.parametrize("error", ["RendezvousTimeoutError", "MasterLost", "EOFError"])
def test_an_elastic_agent_that_fails_to_be_retried_leaves_the_rendezvous_open_for_the_others(monkeypatch, tmp_path, error):
    # Issue 29 (found by the timer tests): torch's launcher closes the rendezvous at any end of its agent but a
    # signal. A node whose own rendezvous timed out closed the one the other nodes trained in, and its retried
    # agent met in the next generation alone: two copies of the job at world 1, one checkpoint directory.
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    agent = fixed_size_agent(monkeypatch, tmp_path, node_rank=1, min_nodes=1)
    handler = agent._worker_group.spec.rdzv_handler
    made = {"RendezvousTimeoutError": lambda: RendezvousTimeoutError("timed out"),
            "MasterLost": lambda: agent_policy.MasterLost("the master went away", final=False),
            "EOFError": lambda: EOFError("the fork server died")}[error]()
    try:
        raise made
    except type(made):
        assert handler.shutdown() is False  # as torch's launcher calls it, from its `finally`
    assert agent.left_open and not closed(handler)
    handler.shutdown()  # the job's end: no error in flight
    assert closed(handler)


def test_an_elastic_agent_closes_the_rendezvous_when_its_end_was_decided(monkeypatch, tmp_path):
    agent = fixed_size_agent(monkeypatch, tmp_path, node_rank=1, min_nodes=1)
    handler = agent._worker_group.spec.rdzv_handler
    agent.final = agent.budget.end(1, "the same failure twice")
    try:
        raise RuntimeError("the ranks failed")
    except RuntimeError:
        handler.shutdown()
    assert closed(handler) and not agent.left_open
