"""The harness's elastic pieces (trainpod.examples.elastic): the LR rule by world and samples seen,
steps left at a world, padding cut off, and the state a checkpoint keeps."""

import pytest

torch = pytest.importorskip("torch")

from trainpod.examples import harness  # noqa: E402
from trainpod.examples.elastic import ElasticFeed  # noqa: E402

N, BATCH = 50, 4


def data():
    return [(torch.full((2,), float(i)), i % 3) for i in range(N)]


def feed_with_schedule(world: int, rank: int = 0, base_lr: float = 0.4):
    feed = ElasticFeed(data(), world, rank, seed=3)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 3).parameters(), lr=base_lr)
    feed.use_schedule(optimizer, base_lr, harness.lr_schedule(2 * N))
    return feed, optimizer


def run_steps(feed, epoch: int, steps: int):
    feed.sampler.set_epoch(epoch)
    batches = iter(torch.utils.data.DataLoader(feed.dataset, batch_size=BATCH, sampler=feed.sampler))
    for _ in range(steps):
        ids, _, _, _, delivered, _ = feed.cut(next(batches))
        feed.after_step(epoch, ids, delivered)


def resume(feed, saved):
    # In the harness's order (TrainState.resume): the schedule with the other stateful objects,
    # then the sampler, then the feed's own state.
    feed.schedule.load_state_dict(saved.schedule.state_dict())
    feed.sampler.load_state_dict(saved.sampler.state_dict())
    feed.load_state_dict(saved.state_dict())


@pytest.mark.slow
def test_the_lr_scales_with_the_world_against_the_first_starts_and_follows_samples_seen():
    feed, optimizer = feed_with_schedule(world=2)
    factor = harness.lr_schedule(2 * N)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4 * factor(0))
    run_steps(feed, epoch=1, steps=3)  # 3 x 2 x 4 = 24 samples seen
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4 * factor(24))

    # Resumed on a world of 3 from that state: the reference world stays 2, the LR is x 3/2.
    resumed, optimizer3 = feed_with_schedule(world=3)
    resume(resumed, feed)
    assert resumed.schedule.reference_world == 2
    assert optimizer3.param_groups[0]["lr"] == pytest.approx(0.4 * 3 / 2 * factor(24))


@pytest.mark.slow
def test_the_same_world_resumes_with_the_uninterrupted_lr():
    feed, optimizer = feed_with_schedule(world=1)
    run_steps(feed, epoch=1, steps=5)
    resumed, optimizer2 = feed_with_schedule(world=1)
    resume(resumed, feed)
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("bad", [0, -1, True, "2", None])
def test_a_bad_reference_world_is_refused(bad):
    feed, _ = feed_with_schedule(world=1)
    with pytest.raises(ValueError, match="reference_world"):
        feed.schedule.load_state_dict({"reference_world": bad})


def test_steps_left_count_the_rest_of_the_epoch_then_whole_epochs_at_this_world():
    feed = ElasticFeed(data(), 3, 0, seed=0)
    assert feed.remaining_steps(epochs=2, batch_size=BATCH) == 2 * -(-N // 12)  # 5 + 5
    feed.sampler.load_state_dict({"epoch": 1, "consumed": 30})
    assert feed.remaining_steps(epochs=2, batch_size=BATCH) == 2 + 5  # 20 left of epoch 1: 2 steps of 12
    feed.sampler.load_state_dict({"epoch": 2, "consumed": N})
    assert feed.remaining_steps(epochs=2, batch_size=BATCH) == 0


def test_the_last_step_cuts_the_padding_and_every_rank_still_gets_a_batch():
    # 50 samples on a world of 3: 17 a rank, padded to 51; the padding is rank 2's last sample.
    last, seen = [], []
    for rank in range(3):
        feed = ElasticFeed(data(), 3, rank, seed=0)
        feed.sampler.set_epoch(1)
        batches = list(torch.utils.data.DataLoader(feed.dataset, batch_size=BATCH, sampler=feed.sampler))
        assert [len(batch[0]) for batch in batches] == [4, 4, 4, 4, 1]  # every rank runs every step
        for batch in batches:
            ids, inputs, labels, loss_scale, delivered, world_real = feed.cut(batch)
            assert len(ids) == len(inputs) == len(labels)
            feed.after_step(1, ids, delivered)
            seen.extend(ids.tolist())
        last.append((len(ids), loss_scale, world_real))
    assert last == [(1, 1.5, 2), (1, 1.5, 2), (0, 1.5, 2)]  # 2 real samples in the last step: 3 / 2
    assert sorted(seen) == list(range(N))


def test_membership_and_ledger_survive_the_checkpoint_state():
    feed = ElasticFeed(data(), 2, 0, seed=0)
    feed.started(0)
    run_steps(feed, epoch=1, steps=2)
    feed.commit([feed.ledger.take_pending()])
    state = feed.state_dict()
    other = ElasticFeed(data(), 3, 1, seed=0)
    other.load_state_dict(state)
    assert other.membership == [[0, 2, 1]]
    assert other.ledger.state_dict() == feed.ledger.state_dict()
