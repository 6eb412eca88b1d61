"""Elastic data under real DDP on this host (gloo): 3 processes, a failure, 2 processes resume.

Every sample of every epoch trains exactly once (the ledger of the last checkpoint proves it),
ranks with an empty last batch still take part in each step, and the weights are those of one
process training on the same global batches with the mean loss (float64, so only summation order
differs).
"""

import json

import pytest

torch = pytest.importorskip("torch")

import torch.multiprocessing as mp  # noqa: E402

from fixtures import elastic_ddp  # noqa: E402
from trainpod.train.samplers import Ledger  # noqa: E402

N = elastic_ddp.N


def blocks(epoch, start, end, world):
    size = world * elastic_ddp.BATCH
    return [(epoch, a, min(a + size, end), world) for a in range(start, end, size)]


@pytest.mark.slow
def test_world_3_then_2_after_a_failure_trains_each_sample_once(tmp_path):
    # World 3: epoch 0 with a checkpoint after 3 steps and at its end, 2 steps of epoch 1 saved,
    # one more step trained and lost (no checkpoint), then the job "fails".
    plan3 = [(0, 3, "save"), (0, None, "save"), (1, 2, "save"), (1, 1, "lose")]
    mp.spawn(elastic_ddp.worker, args=(3, plan3, str(tmp_path)), nprocs=3, join=True)
    after3 = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert after3["sampler"] == {"epoch": 1, "consumed": 12}  # the lost step is not in it
    assert after3["ledger"]["epochs"] == {0: [[0, N]], 1: [[0, 12]]}
    # World 2 resumes from the checkpoint: the rest of epoch 1, then epoch 2.
    plan2 = [(1, None, "save"), (2, None, "save")]
    mp.spawn(elastic_ddp.worker, args=(2, plan2, str(tmp_path)), nprocs=2, join=True)

    final = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    report = Ledger.from_state(final["ledger"]).check(final["sampler"], first_epoch=0)
    assert report.ok, report.problems
    assert report.complete == [0, 1, 2]
    assert final["ledger"]["epochs"] == {0: [[0, N]], 1: [[0, N]], 2: [[0, N]]}

    # Uneven last batches happened, on both worlds, and every rank still ran every step.
    counts = {name: json.loads((tmp_path / f"rank-{name}.json").read_text()) for name in ("3-0", "3-1", "3-2", "2-0", "2-1")}
    assert {counts[r]["steps"] for r in ("3-0", "3-1", "3-2")} == {8}
    assert {counts[r]["steps"] for r in ("2-0", "2-1")} == {11}
    assert counts["3-1"]["empty"] == counts["3-2"]["empty"] == 1 and counts["3-0"]["short"] == 1
    assert counts["2-1"]["empty"] == 2 and counts["2-0"]["short"] == 2

    expected = elastic_ddp.reference(blocks(0, 0, N, 3) + blocks(1, 0, 12, 3) + blocks(1, 12, N, 2) + blocks(2, 0, N, 2))
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(final["model"][name], value, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_an_empty_batch_trains_nothing_through_resnet50():
    # What a rank with no sample left in an epoch's last step does with the examples' model.
    from trainpod.examples.resnet import resnet50

    model = resnet50(num_classes=10).train()
    statistics = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    logits = model(torch.zeros(0, 3, 32, 32))
    loss = torch.nn.functional.cross_entropy(logits, torch.zeros(0, dtype=torch.long), reduction="sum") * 2.0
    loss.backward()
    assert logits.shape == (0, 10) and loss.item() == 0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())  # every hook fires, with zeros
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in statistics.items())  # BatchNorm learnt nothing
