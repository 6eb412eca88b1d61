"""trainpod.rendezvous.node_order: a fixed-size job's nodes get the ranks the platform numbered them with."""

import pickle
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from fixtures.ports import free_port  # noqa: E402
from fixtures.rendezvous_nodes import elastic_handler, meet, store_server  # noqa: E402
from trainpod.agent import policy  # noqa: E402
from trainpod.rendezvous import node_order  # noqa: E402


def handlers(count: int, run_id: str):
    """`count` c10d rendezvous handlers of one job in this process: one address and one pid, so torch numbers
    them in the order they were made (their descriptors' local ids)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    made = []
    for _ in range(count):  # a client each, as each node's agent has: one client's blocking calls would serialise them
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        made.append(DynamicRendezvousHandler.from_backend(run_id, store, C10dRendezvousBackend(store, run_id), count, count,
                                                          local_addr="127.0.0.1"))
    return made, server


def rendezvous_ranks(made) -> list[int]:
    """Each handler's rank after one round that all of them join at once."""
    return [rank for rank, _ in rendezvous_worlds(made)]


def rendezvous_worlds(made) -> list[tuple[int, int]]:
    """Each handler's (rank, world size) after one round that all of them join at once."""
    ranks = [None] * len(made)

    def join(index):
        info = made[index].next_rendezvous()
        ranks[index] = (info.rank, info.world_size)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(made))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return ranks


def test_torch_numbers_the_nodes_by_their_descriptors_whatever_their_node_rank():
    made, _ = handlers(3, "torch-order")
    assert rendezvous_ranks(made) == [0, 1, 2]  # torch's order: the one that sorts first gets rank 0


@pytest.mark.slow
def test_each_node_gets_its_platform_rank_in_every_round():
    made, _ = handlers(3, "platform-order")
    for handler, node_rank in zip(made, (2, 0, 1)):
        node_order.keep(handler, node_rank)
    assert rendezvous_ranks(made) == [2, 0, 1]
    # A restart: every node leaves the round (next_rendezvous's exit op) and joins the next one.
    assert rendezvous_ranks(made) == [2, 0, 1]


@pytest.mark.parametrize("said", [(1, 1, 0), (0, 1, 5), (1, None, 0)], ids=["two claim one rank", "beyond the nodes",
                                                                               "one node says none"])
def test_ranks_that_do_not_number_every_node_leave_torchs_order(said):
    made, _ = handlers(3, f"bad-{'-'.join(map(str, said))}")
    for handler, node_rank in zip(made, said):
        if node_rank is not None:
            node_order.keep(handler, node_rank)
    assert rendezvous_ranks(made) == [0, 1, 2]


def test_platform_order_is_exactly_a_numbering_of_the_participants():
    assert node_order.platform_order({"a": 0, "b": 0}, {"a": 1, "b": 0}) == {"a": 1, "b": 0}
    assert node_order.platform_order({"a": 0, "b": 0}, {"a": 1}) is None
    assert node_order.platform_order({"a": 0, "b": 0}, {"a": 1, "b": 2}) is None
    assert node_order.platform_order({"a": 0}, {"a": 0, "gone": 1}) == {"a": 0}  # a node that left says nothing


def drop(handler, dropped) -> None:
    """What torch does when `handler` reads the state and finds `dropped`'s heartbeat older than its dead-node timeout
    (keep_alive_interval x keep_alive_max_attempt): the node leaves the participants, completed round or not."""
    holder = handler._state_holder
    holder.state.last_heartbeats[dropped._this_node] = datetime.now(timezone.utc) - timedelta(hours=1)
    holder._sanitize()
    assert dropped._this_node not in holder.state.participants


@pytest.mark.parametrize("platform", [False, True], ids=["elastic", "platform ranks"])
def test_a_node_dropped_after_its_round_completed_leaves_every_nodes_rank_and_world_as_completed(platform):
    # CI: a trainer off the CPU as its round completed was dropped by the nodes that read the state after it; they
    # started a world of two (torch's world size is the participants they read) beside its world of three.
    made, _ = handlers(3, f"dropped-{platform}")
    for handler, node_rank in zip(made, (2, 0, 1)):
        node_order.hold(handler)
        if platform:
            node_order.keep(handler, node_rank)
    worlds = rendezvous_worlds(made)
    assert [world for _, world in worlds] == [3, 3, 3]
    drop(made[0], made[2])
    drop(made[2], made[2])  # the dropped node's own reading of it
    assert [handler._get_world() for handler in (made[0], made[2])] == [worlds[0], worlds[2]]
    # torch's own answer, the one replaced: a world of two (and a KeyError for the dropped node)
    assert made[0]._get_world.torch_method(made[0]) == (worlds[0][0], 2)


def test_a_round_without_a_record_or_of_another_round_is_numbered_by_torch():
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    state = _RendezvousState()
    assert node_order.completed_world(state, "a") is None
    state.round = 3
    setattr(state, node_order.ROUND_ATTR, (2, {"a": 0, "b": 1}))
    assert node_order.completed_world(state, "a") is None  # the record of the round before
    setattr(state, node_order.ROUND_ATTR, (3, {"a": 0, "b": 1}))
    assert node_order.completed_world(state, "b") == (1, 2)
    assert node_order.completed_world(state, "c") is None


def test_a_node_dropped_as_its_round_completed_finishes_its_join_in_it_until_it_leaves():
    # CI: the node dropped (its heartbeat late) found itself outside the completed round and waited for the next one,
    # while the other two waited 60 s in this one for its worker count.
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _Action,
        _RendezvousContext,
        _RendezvousExitOp,
        _RendezvousJoinOp,
    )

    made, _ = handlers(3, "dropped-joining")
    for handler in made:
        node_order.hold(handler)
    rendezvous_worlds(made)
    late = made[1]
    drop(late, late)
    state = late._state_holder.state
    context = _RendezvousContext(late._this_node, state, late._settings)
    far = time.monotonic() + 60
    assert state.complete and late._this_node not in state.participants
    assert _RendezvousJoinOp()(context, far) == _Action.FINISH  # a member of the round it joined
    assert late._get_world() == (1, 3)
    assert _RendezvousExitOp()(context, far) == _Action.FINISH  # leaving (not a participant: nothing to remove)
    assert _RendezvousJoinOp()(context, far) == _Action.ADD_TO_WAIT_LIST  # then it waits for the next round, as torch


def elastic_handlers(count: int, run_id: str, min_nodes: int, max_nodes: int, last_call_s: int):
    """`count` c10d handlers of one elastic job (--nnodes min_nodes:max_nodes) with trainpod's rounds (hold()) and store: a
    heartbeat each second, dead after three missed (an elastic trainpod job's defaults)."""
    server, port = store_server()
    return [elastic_handler(port, run_id, min_nodes, max_nodes, last_call_s) for _ in range(count)], server


def lose(handler) -> None:
    """The node of `handler` dies: its heartbeats stop, and it never joins again."""
    handler._stop_heartbeats()


LAST_CALL_S = 60  # far longer than a later round's nodes take to meet here: waiting it out would show


@pytest.mark.slow
def test_the_survivors_of_a_lost_node_meet_once_it_is_dropped_not_after_the_last_call():
    made, _ = elastic_handlers(3, "survivors-meet", 2, 3, LAST_CALL_S)
    assert sorted(world for _, world in meet(made).values()) == [3, 3, 3]  # the first round: complete at the maximum
    lose(made[2])
    started = time.monotonic()
    worlds = meet(made[:2])
    took = time.monotonic() - started
    assert sorted(worlds.values()) == [(0, 2), (1, 2)]
    # torch's rule: the lost node dropped (3 s without a heartbeat), then the last call (60 s) for more nodes
    assert took < LAST_CALL_S / 2, f"the round of the survivors took {took:.1f} s: it waited out its last call"


@pytest.mark.slow
def test_a_survivor_slow_to_come_is_waited_for_while_its_heartbeat_lives():
    made, _ = elastic_handlers(3, "slow-survivor", 2, 3, LAST_CALL_S)
    meet(made)
    # The third node comes 5 s after the others (its ranks slow to stop), past three missed heartbeats' 3 s: it kept
    # its heartbeat while it trained, so the round waits for it instead of closing at world 2.
    worlds = meet(made, delays={2: 5})
    assert sorted(world for _, world in worlds.values()) == [3, 3, 3]


@pytest.mark.slow
def test_a_spare_beyond_the_maximum_takes_a_lost_nodes_place_at_the_same_world():
    made, _ = elastic_handlers(4, "spare", 2, 3, LAST_CALL_S)
    first = meet(made[:3])
    assert sorted(world for _, world in first.values()) == [3, 3, 3]
    assert node_order.members(made[0]) == {handler._this_node for handler in made[:3]}
    spare: dict[int, tuple[int, int]] = {}
    said = []

    def waits_as_spare(max_nodes: int) -> None:  # the agent's line; and whether the others could see the spare then
        state = pickle.loads(made[0]._state_holder._backend.get_state()[0])
        said.append((max_nodes, made[3]._this_node in state.redundancy_list))

    node_order.when_spare(made[3], waits_as_spare)
    waiting = threading.Thread(target=lambda: spare.update(meet(made[3:])), daemon=True)
    waiting.start()  # torch puts it on the redundancy list: the full round goes on, not restarted for it
    time.sleep(2)
    # said once, and only once the rendezvous held it there: a node lost right after the line is replaced by the spare
    assert waiting.is_alive() and made[0].num_nodes_waiting() == 0 and said == [(3, True)]
    lose(made[1])
    started = time.monotonic()
    worlds = meet([made[0], made[2]])
    waiting.join(60)
    took = time.monotonic() - started
    assert sorted(world for _, world in [*worlds.values(), *spare.values()]) == [3, 3, 3]
    assert took < LAST_CALL_S / 2, f"the round with the spare took {took:.1f} s"
    # as many nodes as before, one of them another: the agents' policy sees a membership change (test_policy)
    assert node_order.members(made[0]) == {made[0]._this_node, made[2]._this_node, made[3]._this_node}


@pytest.mark.slow
def test_a_node_that_leaves_for_good_is_not_waited_for():
    made, _ = elastic_handlers(3, "leaves", 2, 3, LAST_CALL_S)
    meet(made)
    policy._leave_round(made[2])  # an excluded node (its ranks failed alike twice): exit op, heartbeats stopped
    started = time.monotonic()
    worlds = meet(made[:2])
    assert sorted(worlds.values()) == [(0, 2), (1, 2)]
    assert time.monotonic() - started < LAST_CALL_S / 2


def test_expected_is_the_last_rounds_members_and_both_lists_with_a_live_heartbeat():
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    state = _RendezvousState()
    assert node_order.expected(state) is None  # the first round: torch's last call
    setattr(state, node_order.ROUND_ATTR, (0, {"a": 0, "b": 1, "dead": 2}))
    state.wait_list, state.redundancy_list = {"joiner"}, {"spare", "gone"}
    now = datetime.now(timezone.utc)
    state.last_heartbeats = dict.fromkeys(("a", "b", "joiner", "spare"), now)
    assert node_order.expected(state) == {"a", "b", "joiner", "spare"}
    state.participants = dict.fromkeys(("a", "b", "joiner"), 0)
    assert not node_order.closes_now(state, "a", 2)  # the spare is not in yet
    state.participants["spare"] = 0
    assert node_order.closes_now(state, "a", 2)
    assert not node_order.closes_now(state, "outsider", 2)  # only a participant completes it
    assert not node_order.closes_now(state, "a", 5)  # fewer than the minimum
    state.complete = True
    assert not node_order.closes_now(state, "a", 2)


def test_a_round_that_none_of_the_last_rounds_members_outlived_waits_its_last_call_as_a_first_round():
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    state = _RendezvousState()
    setattr(state, node_order.ROUND_ATTR, (0, {"a": 0, "b": 1, "c": 2}))
    # every agent started anew (etcd back after an outage): new descriptors, the old ones dropped
    state.last_heartbeats = dict.fromkeys(("a2", "b2"), datetime.now(timezone.utc))
    state.participants = dict.fromkeys(("a2", "b2"), 0)
    assert node_order.expected(state) is None
    assert not node_order.closes_now(state, "a2", 2)  # c2 may be a moment behind: the last call waits for it
    state.last_heartbeats["a"] = datetime.now(timezone.utc)  # one member outlived the round: its survivors' rule
    state.participants["a"] = 0
    assert node_order.closes_now(state, "a", 2)


def test_a_spare_that_comes_off_the_redundancy_list_is_on_the_wait_list_at_once_and_waited_for():
    # torch takes it off the list and forgets its heartbeat; only its next step put it on the wait list, and a round
    # that closed in between did not wait for it (seen in CI: a round of two, then one of three for the spare).
    from types import SimpleNamespace

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _DistributedRendezvousOpExecutor, _RendezvousState

    node_order._install()
    state = _RendezvousState()
    setattr(state, node_order.ROUND_ATTR, (0, {"a": 0, "b": 1, "lost": 2}))
    state.redundancy_list = {"spare"}
    state.last_heartbeats = dict.fromkeys(("a", "b", "spare"), datetime.now(timezone.utc))
    spare = SimpleNamespace(_state=state, _node="spare", _settings=SimpleNamespace(run_id="job"), _record=lambda **_: None)
    _DistributedRendezvousOpExecutor._remove_from_redundancy_list(spare)
    assert (state.redundancy_list, state.wait_list) == (set(), {"spare"})
    assert node_order.expected(state) == {"a", "b", "spare"}
    state.participants = dict.fromkeys(("a", "b"), 0)
    assert not node_order.closes_now(state, "a", 2)  # the survivors' round waits for the spare
