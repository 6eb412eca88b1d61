"""Ranks where the platform put them: in a fixed-size job whose nodes the platform numbers (OpenPAI's task
index, NODE_RANK, SLURM's node id), node N hosts global ranks N x nproc ... N x nproc + nproc - 1 on every
start and restart, as `trainpod explain` says.

torch's dynamic rendezvous (c10d, trainpod's etcd-v3) ignores --node-rank: when a round completes it numbers
the nodes in the order of their descriptors (address, then the agent's pid), so on one host, or behind a
NAT, or with host names that do not sort like the node ranks, rank 0 went to whichever node sorted first:
the same two-node job printed `[node1 rank0]` on one run and `[node0 rank0]` on the next, and rank 0's
checkpoints, metrics and logs landed on either node.

Here each node says its rank when it joins a round: the rendezvous state that torch shares between the
nodes (pickled into the store) carries a map node -> platform rank beside its participants. The node that
completes the round lets torch number them, then gives each participant its platform rank when every
participant said one and they are exactly 0..n-1; otherwise (an elastic job, a node without trainpod's
agent, two nodes that claim one rank) torch's order stands. Which agent hosts the workers' store does not
change: the workers of every rank connect to it as clients (the agent's store, trainpod.agent.policy).

A round's world is the one it completed with, on every node (hold(), for every job on torch's dynamic
rendezvous). torch gives a node its rank and world size from the state as that node last read it
(DynamicRendezvousHandler._get_world: the participants map and its length), and every read first drops each
node whose heartbeat is older than keep_alive_interval x keep_alive_max_attempt (15 s by torch's defaults, 3
s by an elastic trainpod job's: trainpod.launcher.resolve), completed round or not. A node off the CPU for
that long as its round completed (seen in CI, three trainers on two loaded cores) was dropped by the nodes
that read the state after it: they started a world of two beside a third node that had started a world of
three, the two trained as a job of their own until its agent timed out, and the job's membership went 2, 3,
4 where it was meant to go 3, 4; where the dropped node held rank 0, the others waited for its address until
the store's timeout. Here the node that completes a round records its participants, numbered, in the shared
state, and each node takes its rank and the world size from that record: the same on every node. A node that
died meanwhile is still in its round's world, as it is in torch when it dies a moment later: the others'
first collective or store wait fails and the next round goes on without it. And the dropped node itself,
alive but late: torch found it outside a completed round and put it on the wait list for the next one, while
the others waited for it in this one until the store's timeout (seen in CI: a round of three whose rank 0
waited 60 s for rank 1's worker count). Here a node that joined the round in this process, and has not left
it since (next_rendezvous' exit), finishes its join as one of the round's world.

A round after the first closes as soon as every live node it expects has joined (closes_now()), not when its last call
ends. torch's last call (last_call_timeout: how long a round waits for more nodes once the minimum joined) is for the
first round, whose nodes start apart; in every later round each node that is still alive is already at the rendezvous,
or about to be: the last round's members that outlived it (their ranks failed with the lost one's, or a joiner stopped
them), a node on the wait list (a joiner) and a spare beyond --nnodes' maximum (torch's redundancy list). A node is
alive while its heartbeat is: torch drops one whose heartbeat is older than keep_alive_interval x
keep_alive_max_attempt from the state as it reads it, and a dead node's drop is what ends its round (its last
participant gone), or sooner: a node whose agent the others saw go is dropped at once (trainpod.rendezvous.
presence). So the survivors of a lost node met once that node was dropped, then waited out the whole last call
for nobody (3 s by an elastic trainpod job's default, 45 s in the compose tests, torch's 30 s); here they meet as soon
as the last of them joins, and one that is slow to stop its ranks, its heartbeat alive, is still waited for, up to the
last call. A round that none of the last round's members outlived (every agent started anew: the job restarted whole,
or etcd back after an outage) is a first round again. (torch forgets the heartbeat of a node that leaves a round; one
that leaves to join the next, next_rendezvous' first step, keeps it here: between its exit and its join it would look
dead. A node that leaves the rendezvous for good says so first: leave(). torch also forgets the heartbeat of a spare
that comes off the redundancy list once its round lost a node, and only the spare's next step puts it on the wait
list: in between it was in no list, and the survivors' round closed without it, then restarted for it (seen in CI, a
round of two before the round of three). Here it goes to the wait list in the same step, its heartbeat alive.)

torch's private API used (checked by trainpod.agent.agent.torch_internals_missing()): _DistributedRendezvousOpExecutor's
_add_to_participants(), _remove_from_participants() and _mark_rendezvous_complete(), its `_node` and `_state`, the
state's `participants`, `round`, `complete`, `closed`, `wait_list`, `redundancy_list` and `last_heartbeats`, the
handler's `_this_node`, `_state_holder`, `_heartbeat_lock` and `_get_world()`, and the join and exit operations' __call__(ctx, deadline)
(_RendezvousJoinOp, _RendezvousExitOp; _Action.FINISH, MARK_RENDEZVOUS_COMPLETE, ADD_TO_REDUNDANCY_LIST), and the
executor's _remove_from_redundancy_list(), _add_to_wait_list() and _add_to_redundancy_list(), and the state holder's
_sanitize() (_BackendRendezvousStateHolder: where trainpod.rendezvous.presence expires a lost node's heartbeat).
"""

from __future__ import annotations

import functools
import logging
from datetime import datetime, timezone

from trainpod.rendezvous import presence

STATE_ATTR = "trainpod_node_ranks"  # on torch's _RendezvousState: {node descriptor: platform node rank}
ROUND_ATTR = "trainpod_completed"  # on torch's _RendezvousState: (round, {node descriptor: rank}) as it completed

_wanted: dict = {}  # node descriptor of a handler in this process -> the node rank the platform gave it
_joined: dict = {}  # node descriptor of a handler in this process -> the round it joined and has not left since
_rejoining: set = set()  # nodes of handlers in this process between leaving a round and joining the next one
_leaving: set = set()  # nodes of handlers in this process that leave their rendezvous for good (leave())
_spare_hooks: dict = {}  # node -> called when torch puts it on the redundancy list (when_spare())
_spares: set = set()  # nodes of handlers in this process whose hook was called for their present wait there

logger = logging.getLogger(__name__)


def _say_spare(ctx) -> None:
    """Call the node's spare hook once per wait on the redundancy list, once a state it read holds it there: not when
    torch decides to put it there, a write that another node's may beat (then it is decided and written again). Said
    at the decision, the line came while the rendezvous did not know of the spare yet: a node lost at once after it
    (seen in a suite run: a kill a second after the line) left the survivors expecting no one, and their round closed at two,
    then restarted for the spare."""
    if ctx.node in getattr(ctx.state, "redundancy_list", ()):
        if ctx.node in _spare_hooks and ctx.node not in _spares:
            _spares.add(ctx.node)
            _spare_hooks[ctx.node](ctx.settings.max_nodes)
    else:
        _spares.discard(ctx.node)


def hold(handler) -> None:
    """Give `handler`'s node the rank and world size its round completed with (the module docstring)."""
    if getattr(handler, "_this_node", None) is not None:  # torch's etcd backend (v2 API) has a rendezvous of its own
        _install()


def keep(handler, node_rank: int) -> None:
    """Make `handler`'s node join every round of its rendezvous as node `node_rank`."""
    node = getattr(handler, "_this_node", None)
    if node is None:
        return  # not torch's dynamic rendezvous (torch's etcd backend numbers the nodes itself)
    _install()
    _wanted[node] = node_rank


def leave(handler) -> None:
    """`handler`'s node leaves its rendezvous for good (its next exit is its last): a later round does not wait for it."""
    node = getattr(handler, "_this_node", None)
    if node is not None:
        _leaving.add(node)


def when_spare(handler, hook) -> None:
    """Call `hook(max_nodes)` when `handler`'s node comes to a round that has --nnodes' maximum already, and torch put
    it on the redundancy list (once the state holds it there: _say_spare): a spare, which waits, trains nothing, and
    joins the first round with room for it (a node left) without a restart of the others."""
    node = getattr(handler, "_this_node", None)
    if node is not None:
        _install()
        _spare_hooks[node] = hook


def spares_waiting(handler) -> int:
    """How many nodes wait on the redundancy list of `handler`'s rendezvous now (a fresh read of its state, under
    the lock torch's heartbeat takes for its own); 0 where the rendezvous has no such list (torch's etcd backend)."""
    holder, lock = getattr(handler, "_state_holder", None), getattr(handler, "_heartbeat_lock", None)
    if holder is None or lock is None:
        return 0
    with lock:
        holder.sync()
        return len(getattr(holder.state, "redundancy_list", ()))


def round_of(handler) -> int | None:
    """The round `handler`'s rendezvous is in (0: the job's first), as this node last read it; None where the
    rendezvous has no rounds of torch's dynamic kind (torch's etcd backend)."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    return getattr(state, "round", None)


def completed_world(state, node) -> tuple[int, int] | None:
    """(rank, world size) of `node` in the round `state` is in, as that round completed; None without a record."""
    completed = getattr(state, ROUND_ATTR, None)
    if completed is None or completed[0] != state.round or node not in completed[1]:
        return None
    return completed[1][node], len(completed[1])


def expected(state) -> set | None:
    """The nodes a round after the first waits for (the module docstring): the last completed round's members, the
    wait list and the redundancy list, those whose heartbeat is alive in `state`; None in a first round (no record),
    and in a round that none of the last round's members outlived: every node's agent was started anew (the whole job
    restarted, or etcd back after an outage that ended every node's attempt), and such nodes start apart as in a
    first round. (Seen under load: etcd's quorum back, the first two of three restarted agents closed a round of two
    at once, the third joined a moment later, and the job restarted for it.)"""
    completed = getattr(state, ROUND_ATTR, None)
    alive = set(state.last_heartbeats)
    if completed is None or not set(completed[1]) & alive:
        return None
    return (set(completed[1]) | set(state.wait_list) | set(getattr(state, "redundancy_list", ()))) & alive


def closes_now(state, node, min_nodes: int) -> bool:
    """Whether `node` completes the round `state` is in now, before its last call ends: a round after the first, not
    complete, `node` one of its participants, at least `min_nodes` of them, and every node it expects among them."""
    if state.complete or state.closed or node not in state.participants or len(state.participants) < min_nodes:
        return False
    waited = expected(state)
    return waited is not None and waited <= set(state.participants)


def members(handler) -> frozenset | None:
    """The nodes of `handler`'s round as it completed (their descriptors: address, the agent's pid, a local id), the
    same on every node; None without a record (torch's etcd backend, a round not completed by trainpod's agent). Two
    rounds of as many nodes differ where a spare took a lost node's place, or a node's agent was started again."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    completed = getattr(state, ROUND_ATTR, None)
    if completed is None or completed[0] != state.round:
        return None
    return frozenset(completed[1])


def platform_order(participants, said) -> dict | None:
    """{node: rank} by the ranks the nodes said, or None when they do not number every participant 0..n-1."""
    ranks = {node: said.get(node) for node in participants}
    if sorted(ranks.values(), key=lambda r: -1 if r is None else r) != list(range(len(ranks))):
        return None
    return ranks


def torch_internals_missing() -> list[str]:
    """What of torch's private API this module uses is missing from the installed torch ([] if nothing)."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    executor = getattr(dynamic_rendezvous, "_DistributedRendezvousOpExecutor", None)
    handler = getattr(dynamic_rendezvous, "DynamicRendezvousHandler", None)
    holder = getattr(dynamic_rendezvous, "_BackendRendezvousStateHolder", None)

    def torchs(name):  # torch's own method, also once _install() wrapped it
        method = getattr(executor, name)
        return getattr(method, "torch_method", method)

    checks = {
        "_add_to_participants() (where a node joins a round)":
            lambda: "state.participants[self._node]" in inspect.getsource(torchs("_add_to_participants")),
        "_mark_rendezvous_complete() (where torch numbers the nodes)":
            lambda: "sorted(state.participants)" in inspect.getsource(torchs("_mark_rendezvous_complete")),
        "DynamicRendezvousHandler._this_node": lambda: "self._this_node = node" in inspect.getsource(handler.__init__),
        "DynamicRendezvousHandler._heartbeat_lock (a fresh read of the state: spares_waiting())":
            lambda: "self._heartbeat_lock = threading.Lock()" in inspect.getsource(handler.__init__),
        "_RendezvousJoinOp.__call__(ctx, deadline) (a node finishing its join)":
            lambda: "if state.complete and is_participant:" in inspect.getsource(
                getattr(dynamic_rendezvous._RendezvousJoinOp.__call__, "torch_method", dynamic_rendezvous._RendezvousJoinOp.__call__)),
        "_RendezvousExitOp.__call__(ctx, deadline) (a node leaving its round)":
            lambda: "_Action.REMOVE_FROM_PARTICIPANTS" in inspect.getsource(
                getattr(dynamic_rendezvous._RendezvousExitOp.__call__, "torch_method", dynamic_rendezvous._RendezvousExitOp.__call__)),
        "_remove_from_participants() (a node leaving a round forgets its heartbeat)":
            lambda: "del state.last_heartbeats[self._node]" in inspect.getsource(torchs("_remove_from_participants")),
        "_remove_from_redundancy_list() (a spare coming off the list forgets its heartbeat)":
            lambda: "del self._state.last_heartbeats[self._node]" in inspect.getsource(torchs("_remove_from_redundancy_list")),
        "_RendezvousState's wait_list, redundancy_list and last_heartbeats (the nodes a later round waits for)":
            lambda: all(f"self.{name} =" in inspect.getsource(dynamic_rendezvous._RendezvousState.__init__)
                        for name in ("wait_list", "redundancy_list", "last_heartbeats")),
        "_BackendRendezvousStateHolder._sanitize() (where a node whose heartbeat lapsed is dropped: trainpod.rendezvous.presence)":
            lambda: "last_heartbeat < expire_time" in inspect.getsource(
                getattr(holder._sanitize, "torch_method", holder._sanitize)),
        "_add_to_wait_list() and _add_to_redundancy_list() (where a node publishes its presence listener)":
            lambda: all(callable(torchs(name)) for name in ("_add_to_wait_list", "_add_to_redundancy_list")),
        "DynamicRendezvousHandler._get_world() (a node's rank and world size)":
            lambda: "state.participants[self._this_node], len(state.participants)" in inspect.getsource(
                getattr(handler._get_world, "torch_method", handler._get_world)),
    }
    missing = []
    for what, present in checks.items():
        try:
            ok = present()
        except (AttributeError, TypeError, OSError):
            ok = False
        if not ok:
            missing.append(f"torch.distributed.elastic.rendezvous.dynamic_rendezvous: {what} (trainpod.rendezvous.node_order)")
    return missing


@functools.cache
def _install() -> None:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler as Handler
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _BackendRendezvousStateHolder as Holder
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _DistributedRendezvousOpExecutor as Executor
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp as ExitOp
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousJoinOp as JoinOp

    torch_add, torch_complete, torch_world = Executor._add_to_participants, Executor._mark_rendezvous_complete, Handler._get_world
    torch_join, torch_exit, torch_remove = JoinOp.__call__, ExitOp.__call__, Executor._remove_from_participants
    torch_unspare = Executor._remove_from_redundancy_list
    torch_wait, torch_spare, torch_sanitize = Executor._add_to_wait_list, Executor._add_to_redundancy_list, Holder._sanitize

    def _add_to_participants(self) -> None:
        rank = _wanted.get(self._node)
        if rank is not None:  # said first: the last node to join completes the round inside torch's method
            self._state.__dict__.setdefault(STATE_ATTR, {})[self._node] = rank
        _joined[self._node] = self._state.round
        presence.publish(self._state, self._node)
        torch_add(self)

    def _add_to_wait_list(self) -> None:
        presence.publish(self._state, self._node)
        torch_wait(self)

    def _add_to_redundancy_list(self) -> None:
        presence.publish(self._state, self._node)
        torch_spare(self)

    def _sanitize(self) -> None:
        presence.expire(self._state)  # a node whose agent this one saw go: dropped by torch's sweep now
        torch_sanitize(self)
        presence.seen(self._state)

    def join(self, ctx, deadline: float):
        _rejoining.discard(ctx.node)  # at its next round now: a participant, or on a list, each with its heartbeat
        state = ctx.state
        _say_spare(ctx)
        if (state.complete and not state.closed and ctx.node not in state.participants
                and _joined.get(ctx.node) == state.round and completed_world(state, ctx.node) is not None):
            return _Action.FINISH  # dropped as its round completed: still one of its world (the module docstring)
        if closes_now(state, ctx.node, ctx.settings.min_nodes):
            return _Action.MARK_RENDEZVOUS_COMPLETE  # every live node it expects is in: no last call to wait out
        return torch_join(self, ctx, deadline)

    def exit(self, ctx, deadline: float):
        _joined.pop(ctx.node, None)  # leaving its round (next_rendezvous' first step): a member of none until it joins
        if ctx.node not in _leaving:
            _rejoining.add(ctx.node)
        return torch_exit(self, ctx, deadline)

    def _remove_from_participants(self) -> None:
        torch_remove(self)
        if self._node in _rejoining:  # alive, and about to join the next round: the others' next round waits for it
            self._state.last_heartbeats[self._node] = datetime.now(timezone.utc)

    def _remove_from_redundancy_list(self) -> None:
        torch_unspare(self)
        # Its round lost a node: on to the wait list now, heartbeat alive (the module docstring), as torch's next step
        # would put it; a round that closes meanwhile waits for it.
        self._state.wait_list.add(self._node)
        self._state.last_heartbeats[self._node] = datetime.now(timezone.utc)

    def _mark_rendezvous_complete(self) -> None:
        torch_complete(self)
        state = self._state
        said = getattr(state, STATE_ATTR, {})
        ranks = platform_order(state.participants, said)
        if ranks is not None:
            state.participants.update(ranks)
        elif said:
            logger.warning("the node ranks %s do not number the %d nodes 0..%d once each: the rendezvous numbers them",
                           ", ".join(str(said.get(node, "none")) for node in sorted(state.participants)),
                           len(state.participants), len(state.participants) - 1)
        state.__dict__.pop(STATE_ATTR, None)  # the next round's nodes say theirs anew
        state.__dict__[ROUND_ATTR] = (state.round, dict(state.participants))

    def _get_world(self) -> tuple[int, int]:
        return completed_world(self._state_holder.state, self._this_node) or torch_world(self)

    _add_to_participants.torch_method = torch_add  # type: ignore[attr-defined]
    _mark_rendezvous_complete.torch_method = torch_complete  # type: ignore[attr-defined]
    _get_world.torch_method = torch_world  # type: ignore[attr-defined]
    join.torch_method, exit.torch_method = torch_join, torch_exit  # type: ignore[attr-defined]
    _remove_from_participants.torch_method = torch_remove  # type: ignore[attr-defined]
    _remove_from_redundancy_list.torch_method = torch_unspare  # type: ignore[attr-defined]
    _add_to_wait_list.torch_method, _add_to_redundancy_list.torch_method = torch_wait, torch_spare  # type: ignore[attr-defined]
    _sanitize.torch_method = torch_sanitize  # type: ignore[attr-defined]
    Executor._add_to_wait_list, Executor._add_to_redundancy_list = _add_to_wait_list, _add_to_redundancy_list
    Holder._sanitize = _sanitize
    Executor._remove_from_participants = _remove_from_participants
    Executor._remove_from_redundancy_list = _remove_from_redundancy_list
    Executor._add_to_participants = _add_to_participants
    Executor._mark_rendezvous_complete = _mark_rendezvous_complete
    Handler._get_world = _get_world
    JoinOp.__call__, ExitOp.__call__ = join, exit
