"""The snapshot save() takes: a copy that shares no memory with the state, in reused buffers."""

import argparse
import collections
import copy

import pytest

torch = pytest.importorskip("torch")

from fixtures.checkpoints import data_name  # noqa: E402
from fixtures.states import assert_same  # noqa: E402
from trainpod.train.checkpoint import Checkpointer  # noqa: E402
from trainpod.train.checkpoint.snapshot import Snapshot  # noqa: E402

Point = collections.namedtuple("Point", "x y")


def test_the_caller_may_change_its_model_as_soon_as_save_returns(tmp_path):
    model = torch.nn.Linear(256, 256)
    before = copy.deepcopy(model.state_dict())
    ckpt = Checkpointer(tmp_path, keep=2, log=lambda line: None)
    ckpt.save(1, {"model": model.state_dict()})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    after = copy.deepcopy(model.state_dict())
    ckpt.save(2, {"model": model.state_dict()})  # copies into the first snapshot's buffers
    with torch.no_grad():
        model.weight.zero_()
    ckpt.close()

    assert_same(torch.load(tmp_path / data_name(1), weights_only=True)["model"], before)
    assert_same(torch.load(tmp_path / data_name(2), weights_only=True)["model"], after)


def test_reused_buffers_are_never_shared_by_two_tensors(tmp_path):
    tied = torch.arange(16.0)
    ckpt = Checkpointer(tmp_path, keep=2, log=lambda line: None)
    ckpt.save(1, {"a": tied, "b": tied})  # tied weights: one tensor under two names
    ckpt.save(2, {"a": torch.zeros(16), "b": torch.ones(16)})  # same shapes, now distinct
    ckpt.close()
    first = torch.load(tmp_path / data_name(1), weights_only=True)
    second = torch.load(tmp_path / data_name(2), weights_only=True)
    assert first["a"].data_ptr() == first["b"].data_ptr()  # still tied, as torch.save keeps them
    assert torch.equal(second["a"], torch.zeros(16)) and torch.equal(second["b"], torch.ones(16))


def test_a_snapshot_copies_into_the_spare_buffers_of_the_same_shape_dtype_and_strides():
    first = Snapshot().take({"w": torch.ones(4, 4), "b": torch.ones(4), "h": torch.ones(4)})
    source = {"w": torch.zeros(4, 4), "b": torch.zeros(5), "h": torch.zeros(4, dtype=torch.float16)}
    second = Snapshot(first).take(source)
    assert second["w"].data_ptr() == first["w"].data_ptr() and torch.equal(second["w"], source["w"])
    assert second["b"].data_ptr() != first["b"].data_ptr() and torch.equal(second["b"], source["b"])  # another shape
    assert second["h"].data_ptr() != first["h"].data_ptr() and second["h"].dtype == torch.float16  # another dtype


def test_a_snapshot_shares_no_memory_with_the_state_and_keeps_its_containers():
    state = {
        "d": collections.defaultdict(list, a=[torch.ones(2)]),
        "p": Point(torch.ones(1), 2),
        "t": (1, torch.ones(3)),
        "args": argparse.Namespace(x=[1]),
    }
    original = copy.deepcopy(state)
    copied = Snapshot().take(state)
    state["d"]["a"][0].add_(1)
    state["p"].x.add_(1)
    state["t"][1].add_(1)
    state["args"].x.append(2)
    assert type(copied["d"]) is collections.defaultdict and copied["d"].default_factory is list
    assert type(copied["p"]) is Point and type(copied["t"]) is tuple
    assert torch.equal(copied["d"]["a"][0], original["d"]["a"][0]) and torch.equal(copied["p"].x, original["p"].x)
    assert torch.equal(copied["t"][1], original["t"][1]) and copied["args"] == original["args"]
