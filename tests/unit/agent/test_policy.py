"""trainpod.agent.policy: what the agent keeps across the worker groups it starts and stops."""

import contextlib
import threading
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from fixtures.ports import free_port  # noqa: E402
from trainpod.agent import control, hangwatch, policy  # noqa: E402
from trainpod.contract import NODE_RANK_VAR, PROGRESS_DIR_VAR, SUPERVISOR_DIR_VAR  # noqa: E402
from trainpod.runspec import RunSpec, Target  # noqa: E402
from trainpod.topology import Rendezvous, Topology  # noqa: E402


def fixed_size_agent(monkeypatch, tmp_path, node_rank: int, min_nodes: int = 2, store=None):
    """torch's agent with trainpod's policy, as trainpod.agent builds it, for node `node_rank` of a fixed-size
    2-node c10d job whose store (node 0's) this process hosts (elastic 1:2 with `min_nodes` 1), or on `store`."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    monkeypatch.setenv(NODE_RANK_VAR, str(node_rank))
    monkeypatch.setenv(PROGRESS_DIR_VAR, str(tmp_path))
    monkeypatch.delenv(SUPERVISOR_DIR_VAR, raising=False)
    run = RunSpec(topology=Topology(source="test", nnodes=2, node_rank=node_rank, nproc_per_node=1, master_addr="127.0.0.1",
                                    master_port=1, backend="gloo", interface="lo",
                                    rendezvous=Rendezvous(min_nodes=min_nodes, max_nodes=2)),
                  target=Target(command=("true",)), rejoin_timeout=1.0)
    if store is None:
        store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    # A last call of 1 s: a round of 1:2 that this node completes alone closes then, not after torch's default 30 s.
    handler = DynamicRendezvousHandler.from_backend("policy", store, C10dRendezvousBackend(store, "policy"), min_nodes, 2,
                                                    local_addr="127.0.0.1", timeout=RendezvousTimeout(last_call=timedelta(seconds=1)))

    class Agent(policy.AgentPolicy, hangwatch.WatchedAgent, LocalElasticAgent):
        run_spec = run

    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=handler, entrypoint="true", max_restarts=3)
    return Agent(spec, logs_specs=DefaultLogsSpecs())


@pytest.mark.slow
def test_a_wait_on_the_rounds_store_holds_back_no_heartbeat():
    # One TCPStore client serves one call at a time: with torch's c10d backend a node's heartbeat queued behind the
    # agent's wait for the other nodes' fingerprints (or --netcheck's, --devcheck's), and a wait longer than the
    # keep-alive lapse (3 s in an elastic job) made the node dead to the others.
    import pickle

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    from fixtures.rendezvous_nodes import elastic_handler, store_server

    server, port = store_server()
    handler = elastic_handler(port, "beats", 1, 1, last_call_s=1)  # a heartbeat each second, dead after 3 missed
    policy._heartbeats_of_their_own(handler)
    round_store = handler.next_rendezvous().store
    reader = C10dRendezvousBackend(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)), "beats")

    def heartbeat():
        return pickle.loads(reader.get_state()[0]).last_heartbeats[handler._this_node]

    def wait():
        with contextlib.suppress(Exception):
            round_store.wait(["fingerprint of a slow node"], timedelta(seconds=60))

    waiting = threading.Thread(target=wait, daemon=True)
    waiting.start()
    time.sleep(0.5)  # its wait is on
    # Heartbeats go on through the wait, past the keep-alive lapse (3 heartbeats of 1 s): 4 new ones are seen.
    seen = [heartbeat()]
    deadline = time.monotonic() + 40
    while len(seen) < 5:
        assert time.monotonic() < deadline, f"{len(seen) - 1} heartbeat(s) in 40 s (one a second) while the agent waited"
        if (beat := heartbeat()) != seen[-1]:
            seen.append(beat)
        time.sleep(0.1)
    assert waiting.is_alive()  # all of them while the wait was on
    round_store.clone().set("fingerprint of a slow node", "1")  # the slow node, late (this client is the wait's)
    waiting.join(30)
    assert not waiting.is_alive()
    handler.shutdown()


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
    assert policy._first_failure(failures)[0] == 3
    # torch's own SIGTERM of the other ranks is never the cause; a usage error (64) says more than a signal
    assert policy._first_failure({0: failure(-15, 99), 1: failure(1, 100, 1)})[0] == 1
    assert policy._first_failure({0: failure(-9, 100), 1: failure(64, 101, 1)})[0] == 1
    assert policy._first_failure({0: failure(1, 100), 1: failure(1, 99, 1)})[0] == 1  # else the earliest


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
            "MasterLost": lambda: policy.MasterLost("the master went away", final=False),
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


@pytest.mark.slow
@pytest.mark.parametrize("leaving", ["a check named it", "its ranks failed alike twice"])
def test_a_node_that_leaves_an_elastic_job_leaves_its_round_and_keeps_the_rendezvous_open_for_the_others(
        monkeypatch, tmp_path, leaving):
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    agent = fixed_size_agent(monkeypatch, tmp_path, node_rank=1, min_nodes=1)
    handler = agent._worker_group.spec.rdzv_handler
    # Another node of the job, which stays, with a client of the store of its own, as another node's agent has: one
    # client serves one call at a time, so where this node's wait for rank 0's address (the round's MASTER_ADDR) came
    # first, rank 0's set of it queued behind the wait until the store's timeout (10 s; seen on a loaded host).
    client = dist.TCPStore(handler._store.host, handler._store.port, is_master=False, timeout=timedelta(seconds=10))
    other = DynamicRendezvousHandler.from_backend("policy", client, C10dRendezvousBackend(client, "policy"), 1, 2,
                                                  local_addr="127.0.0.1")
    # A round of two (1:2), `other` first: it waits torch's 30 s last call for more nodes, this node's handler 1 s
    # (fixed_size_agent), so the one that joins first must be `other`, or this node would complete a round alone.
    joined = threading.Thread(target=other.next_rendezvous, daemon=True)
    joined.start()
    deadline = time.monotonic() + 60
    while other._this_node not in handler._state_holder.state.participants:
        assert time.monotonic() < deadline, "the other node did not join within 60 s"
        time.sleep(0.05)
        handler._state_holder.sync()
    handler.next_rendezvous()
    joined.join(60)
    assert not joined.is_alive()
    with pytest.raises(policy.JobEnded) as ended:
        if leaving == "a check named it":
            agent._worker_group.group_rank = 0  # this node, in the round
            agent._judged("node 0 is slow", {0: "slow"}, agent._worker_group, "--netcheck")
        else:
            decision = agent.budget.end(1, "the same failure twice at step 6 without progress: not restarting")
            agent._leave_failing(policy.restarts.Decision(**{**decision.__dict__, "repeated": True}))
    assert ended.value.code == (69 if leaving == "a check named it" else 1)
    assert "leaves the elastic job" in str(ended.value)
    handler._state_holder.sync()
    assert list(handler._state_holder.state.participants) == [other._this_node]  # it left the round at once
    try:
        raise ended.value
    except policy.JobEnded:
        assert handler.shutdown() is False  # as torch's launcher calls it, from its `finally`
    assert agent.left_job and not closed(handler)

    # Started again on the same host (an orchestrator's restart) while the other node trains: it stays out before it
    # joins, with the code and the line it left with.
    again = fixed_size_agent(monkeypatch, tmp_path, node_rank=1, min_nodes=1, store=handler._store)
    with pytest.raises(policy.JobEnded, match=r"this node left this elastic job \(rendezvous policy\) and stays out") as out:
        again._rendezvous(again._worker_group)
    assert out.value.code == ended.value.code and again.final.code == ended.value.code
    assert str(ended.value) in str(out.value)
    again_handler = again._worker_group.spec.rdzv_handler
    again_handler._state_holder.sync()
    assert list(again_handler._state_holder.state.participants) == [other._this_node]
    assert not again_handler._state_holder.state.wait_list
    assert again_handler.shutdown() is False and not closed(again_handler)  # the others' rendezvous stays open

    # Once no node is left in the run (each left: a script failing alike everywhere), the job started again under the
    # same id starts afresh there, this node with it.
    policy._leave_round(other)
    third = fixed_size_agent(monkeypatch, tmp_path, node_rank=1, min_nodes=1, store=handler._store)
    said = []
    third._say = said.append
    third._stay_out_if_excluded()
    assert third.final is None and len(said) == 1 and "but no node is in it now: the job starts afresh there" in said[0]


def test_a_check_that_names_another_node_sends_this_one_to_meet_again_and_a_fixed_size_job_ends(monkeypatch, tmp_path):
    agent = fixed_size_agent(monkeypatch, tmp_path, node_rank=1, min_nodes=1)
    group = agent._worker_group
    group.group_rank, group.group_world_size = 1, 2
    assert agent._judged("node 0 is slow", {0: "slow"}, group, "--netcheck") is False  # elastic: meet again without it
    assert agent._judged("network: fine", {}, group, "--netcheck") is True
    agent.elastic = False
    with pytest.raises(policy.JobEnded, match="a fixed-size job cannot go on without it") as ended:
        agent._judged("node 0 is slow", {0: "slow"}, group, "--netcheck")
    assert ended.value.code == 69 and agent.final.code == 69


def failed(agent, tmp_path, text: str):
    """agent._on_failure for its rank 0 exiting 1 with `text` as its stderr (a fresh attempt's)."""
    from types import SimpleNamespace

    stderr = tmp_path / f"stderr-{time.monotonic_ns()}.log"
    stderr.write_text(text)
    agent._pcontext = SimpleNamespace(stderrs={0: str(stderr)})
    agent._attempt_started = time.monotonic()
    agent._on_failure(SimpleNamespace(failures={0: failure(1, timestamp=100)}))


CRASH = 'Traceback (most recent call last):\n  File "/app/train.py", line 6, in step\nValueError: bad batch\n'
PEER = ('Traceback (most recent call last):\n  File "/venv/torch/distributed/distributed_c10d.py", line 3252, in all_reduce\n'
        "RuntimeError: [pair.cc:537] Read error [10.0.0.2]:1: Connection reset by peer\n")


def test_a_membership_change_gives_back_a_lost_peer_restart_but_never_one_of_this_node_s_own_crash(monkeypatch, tmp_path):
    # CI, under load: trainer2's ranks crashed at step 6 every time, and each round that formed without a late node
    # forgave the crash; trainer2 spent --max-restarts instead of leaving, and its end closed the job for all three.
    agent = fixed_size_agent(monkeypatch, tmp_path, node_rank=1, min_nodes=1)
    agent._met(None, 3)
    failed(agent, tmp_path, PEER)
    assert agent.budget.load().used == 1
    agent._met(3, 2)  # a node left: that was the failure
    assert agent.budget.load().used == 0 and agent.budget.load().last is None
    failed(agent, tmp_path, CRASH)
    agent._met(2, 3)  # a node joined, but this node's ranks crashed on their own
    assert agent.budget.load().used == 1
    with pytest.raises(policy.JobEnded) as ended:
        failed(agent, tmp_path, CRASH)  # the same crash twice: this node leaves, the others go on
    assert ended.value.code == 1 and agent.left_job
    assert "this node's ranks failed the same way twice" in str(ended.value) and "leaves the elastic job" in str(ended.value)


def test_a_node_whose_own_ranks_spend_the_budget_leaves_an_elastic_job_and_a_lost_peer_waits_for_the_next_round(
        monkeypatch, tmp_path):
    agent = fixed_size_agent(monkeypatch, tmp_path, node_rank=1, min_nodes=1)
    agent._met(None, 2)
    for line in range(3):  # three different crashes: never "the same failure twice"
        failed(agent, tmp_path, CRASH.replace("line 6", f"line {line}"))
    with pytest.raises(policy.JobEnded, match="failed on their own until --max-restarts was spent") as ended:
        failed(agent, tmp_path, CRASH)
    assert ended.value.code == 1 and agent.left_job

    other = fixed_size_agent(monkeypatch, tmp_path / "other", node_rank=1, min_nodes=1)
    other._met(None, 2)
    for _ in range(2):  # its ranks only lost a peer, the same way twice: provisional until the next round
        failed(other, tmp_path, PEER)
    assert other._provisional is not None and not other.left_job
    other._met(2, 1)  # the failing node left: go on
    assert other.final is None and other.budget.load().final is None


def test_the_same_nodes_meeting_after_a_lost_peer_end_get_one_more_attempt_then_the_job_ends(monkeypatch, tmp_path):
    # CI: the node that saved the checkpoint saw "the same failure twice" one failure before the crashing node (which
    # learns of a commit only when its ranks resume from it), and ended the job while that node was still in the round.
    agent = fixed_size_agent(monkeypatch, tmp_path, node_rank=1, min_nodes=1)
    agent._met(None, 2)
    for _ in range(2):
        failed(agent, tmp_path, PEER)
    assert agent._provisional is not None and agent.budget.final() is not None
    agent._met(2, 2)  # the same nodes: one more attempt
    assert agent.final is None and agent.budget.final() is None
    failed(agent, tmp_path, PEER)  # the same failure again: an end, provisional
    with pytest.raises(policy.JobEnded, match="the same 2 node\\(s\\) met again, so no node left") as ended:
        agent._met(2, 2)
    assert ended.value.code == 1 and agent.budget.final()["code"] == 1


def test_a_spare_in_a_lost_nodes_place_is_a_membership_change_though_as_many_nodes_met(monkeypatch, tmp_path):
    # A spare (a node beyond --nnodes' maximum, on torch's redundancy list) takes a lost node's place: the next round
    # has as many nodes as the last, one of them new. Counted by number alone, the survivors' lost-peer failures
    # were "the same nodes met again" and their budget ended the job.
    agent = fixed_size_agent(monkeypatch, tmp_path, node_rank=1, min_nodes=1)
    said = []
    agent._say = said.append
    agent._met(None, 3)
    for _ in range(2):
        failed(agent, tmp_path, PEER)
    assert agent._provisional is not None
    agent._met(3, 3, new=1)
    assert agent.final is None and agent.budget.load().used == 0 and agent.budget.final() is None
    assert said[-1] == ("1 node(s) took the place of one that left: the job has 3 node(s), as before: a membership "
                        "change, not counted against --max-restarts")


def test_a_finishing_worker_group_is_not_restarted_for_a_node_that_waits_to_join(monkeypatch, tmp_path):
    # CI: a node came late to an elastic job's first round; the other trained the whole job alone and, as its rank
    # tore down, torch's agent restarted the healthy group for the waiting node: the job trained twice.
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    from trainpod.train import progress

    monkeypatch.setattr(DynamicRendezvousHandler, "num_nodes_waiting", lambda self: 1)  # torch's answer: a node waits
    monkeypatch.setattr(policy, "WAITING_LOOK_S", 0.0)  # every ask reads (the next test: how often it does)
    agent = fixed_size_agent(monkeypatch, tmp_path, node_rank=0, min_nodes=1)
    handler = agent._worker_group.spec.rdzv_handler
    said = []
    agent._say = said.append
    agent._group_started_at = time.time()
    assert handler.num_nodes_waiting() == 1 and not said  # training: the group restarts for the node, as torch's does
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(progress, "_reporter", progress._Reporter())
    progress.step(5)
    assert handler.num_nodes_waiting() == 1
    progress.finished()  # the rank's shutdown: every rank past its barrier
    assert progress.read(tmp_path)[0].finished
    assert handler.num_nodes_waiting() == 0 and handler.num_nodes_waiting() == 0
    assert said == ["1 node(s) waiting to join, but this worker group is finishing (local rank 0 reported the end of "
                    "training): it is not restarted for them"]  # said once
    agent._group_started_at, agent._said_finishing = time.time() + 1, False  # a new group (as _start_workers sets)
    assert handler.num_nodes_waiting() == 1
    agent._left = {1}  # a local rank ended with 0 while the others run (a script without trainpod's shutdown)
    assert handler.num_nodes_waiting() == 0 and "local rank 1 ended with 0" in said[-1]


def test_while_the_ranks_train_the_rendezvous_is_asked_for_joining_nodes_every_waiting_look(monkeypatch, tmp_path):
    # torch's monitor loop asks at every turn (0.1 s): ten reads a second of a store that every node of every job shares.
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    reads = []
    monkeypatch.setattr(DynamicRendezvousHandler, "num_nodes_waiting", lambda self: reads.append(1) or len(reads) - 1)
    monkeypatch.setattr(policy, "WAITING_LOOK_S", 0.5)
    agent = fixed_size_agent(monkeypatch, tmp_path, node_rank=0, min_nodes=1)
    handler = agent._worker_group.spec.rdzv_handler
    clock = [1000.0]
    monkeypatch.setattr(policy.time, "monotonic", lambda: clock[0])
    answers = []
    for _ in range(16):  # the monitor loop's turns over 2 s, at 0.125 s (binary-exact sums)
        answers.append(handler.num_nodes_waiting())
        clock[0] += 0.125
    assert len(reads) == 4  # at 0, 0.5, 1 and 1.5 s: one read per WAITING_LOOK_S, not one per turn
    assert answers == [0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0], answers  # between two reads: 0


def test_a_spare_that_the_job_never_needed_ends_with_0_not_torchs_attribute_error(monkeypatch, tmp_path):
    # torch's run() swallows the RendezvousGracefulExitError of a node on its redundancy list when the job closes the
    # rendezvous, returns None, and its launcher then calls None.is_failed(): the spare ended in a traceback.
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError

    agent = fixed_size_agent(monkeypatch, tmp_path, node_rank=1, min_nodes=1)
    said = []
    agent._say = said.append

    def closed_while_waiting(role):
        raise RendezvousGracefulExitError("The rendezvous 'policy' is closed, terminating pending rendezvous.")

    monkeypatch.setattr(agent, "_invoke_run", closed_while_waiting)
    result = agent.run()
    assert result.state == WorkerState.SUCCEEDED and not result.is_failed() and result.return_values == {}
    assert said == ["the job ended while this node waited as a spare: it trained nothing, and ends with 0"]
