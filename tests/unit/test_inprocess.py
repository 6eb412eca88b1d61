"""trainpod.inprocess: the rank's side of in-process recovery (the whole path runs in
tests/integration/test_inprocess_recovery.py)."""

import pytest

torch = pytest.importorskip("torch")

from trainpod import inprocess  # noqa: E402


def test_without_a_keeper_nothing_is_recovered(monkeypatch):
    monkeypatch.delenv(inprocess.GENERATION_VAR, raising=False)
    assert not inprocess.enabled() and inprocess.generation() == 0
    error = RuntimeError("Connection closed by peer")
    with pytest.raises(RuntimeError) as raised:
        inprocess.recover(error)
    assert raised.value is error  # the script's own error, untouched: the agent restarts the group
    monkeypatch.setenv(inprocess.GENERATION_VAR, "2")
    assert inprocess.enabled() and inprocess.generation() == 2


def test_the_gist_of_a_gloo_error_is_its_first_sentence_without_the_source_location():
    error = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                         "[10.0.0.2]:4711: Connection reset by peer. This is typically caused by a remote worker\nmore")
    assert inprocess.gist(error) == "Read error [10.0.0.2]:4711: Connection reset by peer"
    assert inprocess.gist(RuntimeError("")) == "RuntimeError"


def test_the_host_copy_is_a_copy_and_what_it_restores_is_another():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    copy = inprocess.HostCopy()
    copy.keep(5, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "loss_curve": [[5, 1.0]]})
    kept = copy.state["model"]["weight"].clone()
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on: the copy does not follow
    assert torch.equal(copy.state["model"]["weight"], kept)

    restored = copy.restore()
    optimizer.load_state_dict(restored["optimizer"])  # keeps the tensors it is given (same device and dtype)
    optimizer.state[model.weight]["momentum_buffer"].add_(1.0)  # as the next step does, in place
    assert not torch.equal(copy.state["optimizer"]["state"][0]["momentum_buffer"],
                           optimizer.state[model.weight]["momentum_buffer"])  # the copy is untouched
    assert copy.step == 5 and restored["loss_curve"] == [[5, 1.0]]
    assert restored["loss_curve"] is not copy.state["loss_curve"]
