import collections
import itertools

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler  # noqa: E402

from trainpod.train.samplers import (  # noqa: E402
    BATCH_LR_RULE,
    ElasticSampler,
    EpochIndices,
    Ledger,
    ResumableDistributedSampler,
    WithIds,
    epoch_order,
    scaled_lr,
)

COMBOS = [
    # (dataset length, world, shuffle, drop_last, epoch)
    (10, 1, True, False, 0),
    (10, 3, True, False, 0),
    (10, 3, True, True, 2),
    (10, 3, False, False, 1),
    (10, 3, False, True, 0),
    (7, 4, True, False, 5),
    (7, 4, True, True, 5),
    (2, 5, True, False, 0),  # padding longer than the dataset
    (2, 5, False, True, 0),  # everything dropped
    (12, 4, True, False, 3),
    (101, 8, True, True, 7),
]


def make(n, world, rank, **kw):
    return ResumableDistributedSampler(range(n), num_replicas=world, rank=rank, **kw)


def epoch_shards(n, world, epoch, **kw):
    shards = []
    for rank in range(world):
        s = make(n, world, rank, **kw)
        s.set_epoch(epoch)
        shards.append(list(s))
    return shards


def consume_and_save(n, world, epoch, k, **kw):
    """Every rank trains on its first k samples of `epoch`; returns (what they consumed, rank 0's state)."""
    consumed, states = [], []
    for rank in range(world):
        s = make(n, world, rank, **kw)
        s.set_epoch(epoch)
        consumed.extend(itertools.islice(iter(s), k))
        s.advance(k)
        states.append(s.state_dict())
    assert all(state == states[0] for state in states)
    return consumed, states[0]


def resumed_shards(n, world, state, **kw):
    shards = []
    for rank in range(world):
        s = make(n, world, rank, **kw)
        s.load_state_dict(state)
        s.set_epoch(state["epoch"])
        expected_len = len(s)
        shards.append(list(s))
        assert len(shards[-1]) == expected_len
    return shards


@pytest.mark.parametrize("n,world,shuffle,drop_last,epoch", COMBOS)
def test_matches_torch_distributed_sampler(n, world, shuffle, drop_last, epoch):
    for rank in range(world):
        ours = make(n, world, rank, shuffle=shuffle, seed=17, drop_last=drop_last)
        theirs = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=17, drop_last=drop_last)
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs) == ours.num_samples
        assert ours.total_size == theirs.total_size


def test_defaults_without_process_group():
    s = ResumableDistributedSampler(range(5))
    assert (s.num_replicas, s.rank) == (1, 0)
    assert list(s) == list(DistributedSampler(range(5), num_replicas=1, rank=0))


@pytest.mark.parametrize("n,world,shuffle,drop_last,epoch", COMBOS)
def test_resume_same_world_continues_the_same_order(n, world, shuffle, drop_last, epoch):
    kw = {"shuffle": shuffle, "drop_last": drop_last, "seed": 3}
    full = epoch_shards(n, world, epoch, **kw)
    per_rank = len(full[0])
    for k in sorted({0, per_rank // 2, per_rank}):
        consumed, state = consume_and_save(n, world, epoch, k, **kw)
        assert state == {"epoch": epoch, "index": k, "num_replicas": world, "offset": 0}
        rest = resumed_shards(n, world, state, **kw)
        for rank in range(world):
            assert rest[rank] == full[rank][k:]
        # The union over ranks is the epoch's multiset: nothing twice that torch does not repeat, nothing skipped.
        before_and_after = collections.Counter(consumed) + collections.Counter(itertools.chain(*rest))
        assert before_and_after == collections.Counter(itertools.chain(*full))
        # The next epoch is a full, ordinary one.
        s = make(n, world, world - 1, **kw)
        s.load_state_dict(state)
        s.set_epoch(epoch + 1)
        assert list(s) == full_epoch_rank(n, world, world - 1, epoch + 1, **kw)
        assert s.state_dict()["index"] == 0


def full_epoch_rank(n, world, rank, epoch, **kw):
    s = DistributedSampler(range(n), num_replicas=world, rank=rank, **kw)
    s.set_epoch(epoch)
    return list(s)


def test_state_applies_without_set_epoch_and_only_to_its_epoch():
    s = make(20, 2, 1, seed=5)
    s.set_epoch(4)
    full = list(s)
    s.advance(6)
    state = s.state_dict()

    t = make(20, 2, 1, seed=5)
    t.load_state_dict(state)
    assert t.epoch == 4 and len(t) == 4
    assert list(t) == full[6:]
    assert t.state_dict() == state  # nothing advanced yet in this pass
    t.advance(4)
    assert t.state_dict()["index"] == 10
    # A second pass over the same epoch without set_epoch is a whole epoch, as with torch.
    assert list(t) == full and len(t) == 10

    u = make(20, 2, 1, seed=5)
    u.load_state_dict(state)
    u.set_epoch(3)
    assert len(u) == 10
    u.set_epoch(4)  # going back to the loaded epoch before any pass still resumes it
    assert list(u) == full[6:]


def test_dataloader_over_resumed_sampler_yields_expected_batches():
    n, world, rank, batch = 50, 3, 2, 4
    s = make(n, world, rank, seed=11)
    s.set_epoch(1)
    full = list(s)  # 17 samples on this rank
    loader = DataLoader(list(range(n)), batch_size=batch, sampler=s, num_workers=0)
    for i, b in enumerate(loader):
        s.advance(len(b))
        if i == 1:
            break
    state = s.state_dict()
    assert state["index"] == 8

    r = make(n, world, rank, seed=11)
    r.load_state_dict(state)
    r.set_epoch(1)
    loader = DataLoader(list(range(n)), batch_size=batch, sampler=r, num_workers=0)
    assert len(loader) == 3
    got = [b.tolist() for b in loader]
    tail = full[8:]
    assert got == [tail[i : i + batch] for i in range(0, len(tail), batch)]


@pytest.mark.parametrize("n,old,new,k", [(50, 4, 3, 5), (50, 3, 4, 7), (10, 3, 2, 3), (10, 3, 2, 4), (13, 2, 5, 3)])
def test_resume_on_another_world_size_skips_nothing(n, old, new, k):
    kw = {"seed": 9, "shuffle": True, "drop_last": False}
    consumed, state = consume_and_save(n, old, 2, k, **kw)
    rest = resumed_shards(n, new, state, **kw)
    assert len({len(shard) for shard in rest}) == 1  # DDP needs every rank to take the same number of steps
    seen = collections.Counter(consumed) + collections.Counter(itertools.chain(*rest))
    assert set(seen) == set(range(n))  # none skipped
    repeats = sum(seen.values()) - n
    # Only padding repeats: the old world's for what it consumed, the new world's (< new) for the rest.
    old_padding = max(0, k * old - n)
    assert repeats <= old_padding + new - 1

    # Resumed again, mid-way, on yet another world size (the saved offset carries the first resume).
    if len(rest[0]) >= 2:
        more, state2 = [], None
        for rank in range(new):
            s = make(n, new, rank, **kw)
            s.load_state_dict(state)
            more.extend(itertools.islice(iter(s), 1))
            s.advance(1)
            state2 = s.state_dict()
        assert state2["offset"] == min(k * old, n) and state2["num_replicas"] == new
        final = resumed_shards(n, old, state2, **kw)
        seen = collections.Counter(consumed) + collections.Counter(more) + collections.Counter(itertools.chain(*final))
        assert set(seen) == set(range(n))


def test_resume_on_another_world_size_with_drop_last():
    n, old, new, k = 23, 4, 3, 2
    kw = {"seed": 1, "drop_last": True}
    consumed, state = consume_and_save(n, old, 0, k, **kw)
    rest = resumed_shards(n, new, state, **kw)
    assert len({len(shard) for shard in rest}) == 1
    seen = collections.Counter(consumed) + collections.Counter(itertools.chain(*rest))
    assert max(seen.values()) == 1  # drop_last never repeats
    assert n - len(seen) < new  # and drops fewer samples than the world size


def test_rejects_bad_states_and_advances():
    s = make(10, 2, 0)
    with pytest.raises(ValueError, match="index"):
        s.load_state_dict({"epoch": 0, "index": -1})
    with pytest.raises(ValueError, match="does not fit"):
        s.load_state_dict({"epoch": 0, "index": 6})
    s.set_epoch(0)
    s.advance(5)
    with pytest.raises(ValueError, match="goes past"):
        s.advance(1)
    with pytest.raises(ValueError):
        s.advance(-1)
    s.load_state_dict({"epoch": torch.tensor(0), "index": torch.tensor(3)})
    assert len(s) == 2


# --- EpochIndices ------------------------------------------------------------------------------


def test_epoch_indices_yields_epoch_and_index_and_follows_set_epoch():
    sampler = DistributedSampler(range(10), num_replicas=2, rank=1, shuffle=True, seed=0)
    wrapped = EpochIndices(sampler)
    assert len(wrapped) == len(sampler) == 5
    assert list(wrapped) == [(0, i) for i in sampler]
    wrapped.set_epoch(4)
    assert sampler.epoch == wrapped.epoch == 4
    assert list(wrapped) == [(4, i) for i in sampler]
    sampler.set_epoch(5)  # on the wrapped sampler directly: the same
    assert [e for e, _ in wrapped] == [5] * 5


def test_epoch_indices_length_follows_a_resumed_sampler():
    sampler = ResumableDistributedSampler(range(10), num_replicas=1, rank=0)
    sampler.load_state_dict({"epoch": 2, "index": 4})
    wrapped = EpochIndices(sampler)
    assert len(wrapped) == 6
    assert list(wrapped) == [(2, i) for i in sampler._order()[4:]]


def test_epoch_indices_needs_an_epoch():
    with pytest.raises(TypeError, match="epoch"):
        EpochIndices(SequentialSampler(range(3)))


# --- ElasticSampler ----------------------------------------------------------------------------


def elastic_segment(n, world, batch, state, steps=None, seed=4, epoch=0):
    """Every rank of `world` in lockstep for `steps` steps (None: to the epoch's end), as a DDP loop does.

    Returns (what was trained, by rank), the plans of each step, and the state every rank would save.
    """
    samplers = [ElasticSampler(range(n), num_replicas=world, rank=r, seed=seed) for r in range(world)]
    for s in samplers:
        if state is None:
            s.set_epoch(epoch)
        else:
            s.load_state_dict(state)
    loaders = [iter(DataLoader(WithIds(list(range(n))), batch_size=batch, sampler=s)) for s in samplers]
    lengths = {len(DataLoader(range(n), batch_size=batch, sampler=s)) for s in samplers}
    assert len(lengths) == 1  # every rank takes the same number of steps
    trained, plans = [[] for _ in range(world)], []
    for _ in range(lengths.pop() if steps is None else steps):
        step = []
        for rank, (s, loader) in enumerate(zip(samplers, loaders)):
            ids, values = next(loader)
            assert ids.tolist() == values.tolist()
            plan = s.plan(len(ids))
            trained[rank].extend(ids[: plan.real].tolist())
            s.advance(plan.size)
            step.append(plan)
        plans.append(step)
    states = [s.state_dict() for s in samplers]
    assert all(st == states[0] for st in states)  # no rank in it: any rank's state serves all
    return trained, plans, states[0]


@pytest.mark.parametrize("n,batch,worlds", [
    (25, 2, [(3, 2), (2, None)]),        # the DDP test's shape: empty ranks in the last step
    (25, 2, [(3, None)]),
    (23, 2, [(2, 1), (5, 1), (3, 1), (1, None)]),
    (7, 3, [(4, 0), (8, None)]),         # more ranks than samples left
    (50, 1, [(4, 5), (3, 5), (4, None)]),
    (1, 2, [(3, None)]),
    (0, 2, [(2, None)]),
    (64, 8, [(2, 2), (4, None)]),        # divisible: no padding at all
])  # fmt: skip
def test_elastic_trains_every_sample_exactly_once_across_world_sizes(n, batch, worlds):
    state, everything, done = None, [], 0
    for world, steps in worlds:
        trained, plans, state = elastic_segment(n, world, batch, state, steps)
        everything.extend(itertools.chain(*trained))
        for step in plans:
            assert len({p.size for p in step}) == 1  # equal batches: DDP's ranks in lockstep
            world_real = step[0].world_real
            assert all(p.world_real == world_real for p in step)
            assert sum(p.real for p in step) == world_real > 0
            assert all(p.loss_scale == world / world_real for p in step)
            done += world_real
            # Only the epoch's last step is short, and only it leaves ranks with less (or nothing).
            assert world_real == world * batch or done == n
        assert state["consumed"] == done
    assert state == {"epoch": 0, "consumed": n}
    assert sorted(everything) == list(range(n))


def test_elastic_order_and_padding_are_distributed_samplers():
    for rank in range(3):
        ours = ElasticSampler(range(25), num_replicas=3, rank=rank, seed=8)
        theirs = DistributedSampler(range(25), num_replicas=3, rank=rank, seed=8)
        ours.set_epoch(2)
        theirs.set_epoch(2)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)
    order = epoch_order(25, 8, 2)
    assert list(ours) == (order + order[:2])[2::3]  # rank 2: the epoch's second sample as padding


def test_elastic_last_step_is_short_or_empty():
    _, plans, _ = elastic_segment(25, 3, 2, None)
    assert [(p.size, p.real, p.world_real) for p in plans[-1]] == [(1, 1, 1), (1, 0, 1), (1, 0, 1)]
    assert plans[-1][0].loss_scale == 3.0  # the one sample weighs as much as any sample of a full step
    _, plans, _ = elastic_segment(26, 4, 3, None)
    assert [(p.size, p.real) for p in plans[-1]] == [(1, 1), (1, 1), (1, 0), (1, 0)]
    assert plans[-1][0].world_real == 2


def test_elastic_resume_on_the_same_world_continues_the_uninterrupted_run():
    full, _, _ = elastic_segment(31, 3, 2, None)
    first, _, state = elastic_segment(31, 3, 2, None, steps=2)
    assert state == {"epoch": 0, "consumed": 12}
    rest, _, _ = elastic_segment(31, 3, 2, state)
    for rank in range(3):
        assert first[rank] + rest[rank] == full[rank]


def test_elastic_loads_a_resumable_samplers_state():
    consumed, state = consume_and_save(25, 4, 1, 3, seed=4)  # ResumableDistributedSampler: 12 done
    trained, _, end = elastic_segment(25, 3, 2, state, epoch=1)
    assert sorted(consumed + list(itertools.chain(*trained))) == list(range(25))
    assert end == {"epoch": 1, "consumed": 25}
    s = ElasticSampler(range(25), num_replicas=4, rank=0, seed=4)
    s.load_state_dict(state)  # the same world: the index format, as saved
    assert s.state_dict() == {"epoch": 1, "consumed": 12}


def test_elastic_state_survives_a_tensor_serializer_and_applies_to_its_epoch_only():
    s = ElasticSampler(range(10), num_replicas=2, rank=1, seed=0)
    s.load_state_dict({"epoch": torch.tensor(3), "consumed": torch.tensor(4)})
    assert (s.epoch, s.consumed, len(s)) == (3, 4, 3)
    assert list(s) == epoch_order(10, 0, 3)[5::2]
    s.set_epoch(4)
    assert s.consumed == 0 and len(s) == 5


def test_elastic_rejects_bad_states_and_plans():
    s = ElasticSampler(range(10), num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="does not fit"):
        s.load_state_dict({"epoch": 0, "consumed": 11})
    with pytest.raises(ValueError, match="consumed"):
        s.load_state_dict({"epoch": 0, "consumed": -1})
    s.set_epoch(0)
    with pytest.raises(ValueError, match="goes past"):
        s.plan(6)
    with pytest.raises(ValueError, match="non-negative int"):
        s.plan(-1)
    assert s.plan(5).real == 5


def test_with_ids_passes_epoch_indices_through():
    class WantsEpoch:
        wants_epoch = True

        def __len__(self):
            return 4

        def __getitem__(self, index):
            epoch, i = index
            return torch.tensor(float(i)), epoch

    data = WithIds(WantsEpoch())
    assert data.wants_epoch and len(data) == 4
    sample_id, x, epoch = data[(7, 2)]
    assert (sample_id, float(x), epoch) == (2, 2.0, 7)
    assert WithIds([5, 6])[1] == (1, 6)


def test_scaled_lr_and_the_rule():
    assert scaled_lr(0.1, 2, 4) == pytest.approx(0.05)
    assert scaled_lr(0.1, 4, 4) == 0.1
    with pytest.raises(ValueError):
        scaled_lr(0.1, 0, 4)
    assert "fixed per-process batch" in BATCH_LR_RULE and "world / reference_world" in BATCH_LR_RULE


# --- Ledger ------------------------------------------------------------------------------------


def commit_all(ledgers):
    pendings = [ledger.take_pending() for ledger in ledgers]
    for ledger in ledgers:
        ledger.commit(pendings)


def test_ledger_proves_exactly_once_over_an_elastic_run_with_a_lost_step():
    n, batch, seed = 25, 2, 4
    world3 = [Ledger(n, seed) for _ in range(3)]
    for epoch, steps in ((0, None), (1, 2)):
        trained, _, state = elastic_segment(n, 3, batch, None, steps, seed=seed, epoch=epoch)
        for ledger, ids in zip(world3, trained):
            ledger.record(epoch, ids)
        commit_all(world3)  # a checkpoint
    committed = world3[0].state_dict()
    assert committed == world3[2].state_dict()
    assert committed["epochs"] == {0: [[0, 25]], 1: [[0, 12]]}  # positions in the epoch's order: compact
    # One more step that no checkpoint committed: lost with the failure.
    lost, _, _ = elastic_segment(n, 3, batch, state, steps=1, seed=seed)
    world3[0].record(1, lost[0])
    # World 2 resumes from the checkpoint: the sampler's and the ledger's state.
    saved = torch.load(save_to_bytes({"ledger": committed, "sampler": state}), weights_only=True)
    world2 = [Ledger.from_state(saved["ledger"]) for _ in range(2)]
    trained, _, state = elastic_segment(n, 2, batch, saved["sampler"], seed=seed)
    for ledger, ids in zip(world2, trained):
        ledger.record(1, ids)
    commit_all(world2)
    report = world2[0].check(state)
    assert report.ok, report.problems
    assert report.complete == [0, 1]
    assert report.epochs[1] == {"samples": 25, "trained": 25, "repeated": 0, "missing": 0, "extra": 0}
    assert world2[0].state_dict()["epochs"] == {0: [[0, 25]], 1: [[0, 25]]}
    # Mid-epoch, the check ties the record to the sampler's position.
    assert Ledger.from_state(committed).check({"epoch": 1, "consumed": 12}).ok
    assert Ledger.from_state(committed).check({"epoch": 1, "consumed": 12}).complete == [0]


def save_to_bytes(obj):
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def test_ledger_finds_repeats_gaps_and_strays():
    order = epoch_order(10, 0, 0)
    ledger = Ledger(10, seed=0)
    ledger.record(0, order[:4])
    ledger.record(0, torch.tensor(order[3:5]))  # order[3] twice
    ledger.record(2, [order[0]])  # an epoch the run never reached
    ledger.commit([ledger.take_pending()])
    report = ledger.check({"epoch": 1, "consumed": 0})
    assert not report.ok and report.complete == []
    assert report.epochs[0] == {"samples": 10, "trained": 5, "repeated": 1, "missing": 5, "extra": 0}
    assert any("epoch 2" in p for p in report.problems)
    # Beyond the sampler's position: trained, but the resumed sampler would hand them out again.
    assert ledger.check({"epoch": 0, "consumed": 3}).epochs[0]["extra"] == 2
    # A repeat within one commit, from two ranks, is found too.
    twice = Ledger(10, seed=0)
    twice.commit([{0: [0, 1]}, {0: [1]}])
    assert twice.check({"epoch": 0, "consumed": 2}).epochs[0]["repeated"] == 1


def test_ledger_pending_is_not_committed_until_commit():
    ledger = Ledger(6, seed=1, shuffle=False)
    ledger.record(0, [0, 1, 2])
    assert ledger.state_dict()["epochs"] == {}
    pending = ledger.take_pending()
    assert pending == {0: [0, 1, 2]} and ledger.take_pending() == {}
    ledger.commit([pending])
    assert ledger.check({"epoch": 0, "consumed": 3}).ok


def test_ledger_refuses_another_data_set_and_bad_ids():
    with pytest.raises(ValueError, match="another data set or seed"):
        Ledger(10, seed=1).load_state_dict(Ledger(10, seed=2).state_dict())
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        Ledger(10).record(0, [10])
    with pytest.raises(ValueError, match="size"):
        Ledger(-1)
