import collections
import itertools

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler  # noqa: E402

from trainpod.samplers import EpochIndices, ResumableDistributedSampler  # noqa: E402

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
