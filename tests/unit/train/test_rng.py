import io
import random

import pytest

torch = pytest.importorskip("torch")

from fixtures.states import assert_same  # noqa: E402
from trainpod.train.checkpoint import Checkpointer  # noqa: E402
from trainpod.train.rng import rng_state, set_rng_state  # noqa: E402


def draws():
    import numpy as np

    return [random.random() for _ in range(3)], torch.rand(3), np.random.rand(3).tolist(), torch.randn(2)


def test_rng_state_round_trip_reproduces_the_same_draws(tmp_path):
    pytest.importorskip("numpy")
    random.seed(1)
    torch.manual_seed(2)
    __import__("numpy").random.seed(3)
    draws()
    saved = rng_state()
    expected = draws()
    draws()  # move on, as training would

    with Checkpointer(tmp_path, log=lambda line: None) as ckpt:
        ckpt.save(1, {"rng": saved})
    _, state = ckpt.load_latest()
    set_rng_state(state["rng"])
    assert_same(draws(), expected)
    set_rng_state(saved)  # and straight from memory
    assert_same(draws(), expected)


def test_rng_state_loads_without_the_full_unpickler():
    buffer = io.BytesIO()
    torch.save(rng_state(), buffer)
    buffer.seek(0)
    assert_same(torch.load(buffer, weights_only=True), rng_state())
