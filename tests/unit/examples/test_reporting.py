import io
import json
import os
import stat
import time
from collections import OrderedDict

import pytest

torch = pytest.importorskip("torch")

from trainpod.examples import reporting  # noqa: E402
from trainpod.examples.reporting import (  # noqa: E402
    Progress,
    Throughput,
    metrics_line,
    parse_metrics_line,
    state_dict_checksum,
    want_progress_bar,
    write_json_atomic,
)

# --- checksum ----------------------------------------------------------------------------------


def small_state_dict():
    g = torch.Generator().manual_seed(0)
    return OrderedDict(
        [
            ("conv.weight", torch.randn(4, 3, 3, 3, generator=g)),
            ("fc.bias", torch.randn(10, generator=g)),
            ("norm.num_batches_tracked", torch.tensor(7)),
            ("half", torch.randn(5, generator=g).to(torch.bfloat16)),
        ]
    )


def test_checksum_is_sha256_hex_and_stable():
    a = state_dict_checksum(small_state_dict())
    assert len(a) == 64 and int(a, 16) >= 0
    assert state_dict_checksum(small_state_dict()) == a


def test_checksum_does_not_depend_on_insertion_order():
    sd = small_state_dict()
    assert state_dict_checksum(OrderedDict(reversed(list(sd.items())))) == state_dict_checksum(sd)


def test_checksum_sees_one_changed_value():
    sd = small_state_dict()
    before = state_dict_checksum(sd)
    sd["conv.weight"][1, 2, 0, 1] = torch.nextafter(sd["conv.weight"][1, 2, 0, 1], torch.tensor(10.0))
    assert state_dict_checksum(sd) != before


def test_checksum_sees_names_dtypes_and_shapes():
    sd = small_state_dict()
    base = state_dict_checksum(sd)
    renamed = OrderedDict(("x." + k, v) for k, v in sd.items())
    assert state_dict_checksum(renamed) != base
    reshaped = OrderedDict(sd, **{"conv.weight": sd["conv.weight"].reshape(4, 27)})
    assert state_dict_checksum(reshaped) != base
    retyped = OrderedDict(sd, **{"fc.bias": sd["fc.bias"].view(torch.int32)})  # same bytes
    assert state_dict_checksum(retyped) != base


def test_checksum_of_a_module_ignores_non_contiguous_layout_and_non_tensors():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.GroupNorm(2, 4))
    sd = model.state_dict()
    transposed = OrderedDict(sd, **{"0.weight": sd["0.weight"].t().contiguous().t()})
    assert not transposed["0.weight"].is_contiguous()
    assert state_dict_checksum(transposed) == state_dict_checksum(sd)
    assert state_dict_checksum(OrderedDict(sd, _extra={"not": "a tensor"})) == state_dict_checksum(sd)


# --- metrics JSON ------------------------------------------------------------------------------


def test_write_json_atomic_creates_dirs_and_writes_valid_json(tmp_path):
    metrics = {"example": "cifar10-ddp", "loss_curve": [[1, 2.3], [10, 1.5]], "checksum": "ab" * 32}
    path = write_json_atomic(tmp_path / "new" / "dir" / "metrics.json", metrics)
    assert path == tmp_path / "new" / "dir" / "metrics.json"
    assert json.loads(path.read_text()) == metrics
    assert os.listdir(path.parent) == ["metrics.json"]  # no temporary file left behind


def test_write_json_atomic_replaces_and_is_readable_by_others(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text("old")
    old_umask = os.umask(0o022)
    try:
        write_json_atomic(path, {"a": 1})
    finally:
        os.umask(old_umask)
    assert json.loads(path.read_text()) == {"a": 1}
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_write_json_atomic_keeps_the_old_file_when_serialising_fails(tmp_path):
    path = tmp_path / "metrics.json"
    write_json_atomic(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["metrics.json"]


def test_metrics_line_round_trip():
    metrics = {"example": "cifar10-ddp", "note": "two\nlines", "loss_curve": [[1, 2.5]]}
    line = metrics_line(metrics)
    assert line.startswith("trainpod-metrics: ") and "\n" not in line
    log = f"epoch 1/1 step 1/1 loss 2.5\n{metrics_line({'old': True})}\n{line}\ntrailing\n"
    assert parse_metrics_line(log) == metrics
    assert parse_metrics_line("no metrics here\n") is None
    assert parse_metrics_line("[node0 rank0] " + metrics_line(metrics) + "\n") == metrics


def test_process_start_time_is_in_the_past():
    started = reporting.process_start_time()
    assert time.time() - 24 * 3600 < started <= time.time() + 0.05


# --- throughput --------------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_throughput_leaves_out_warmup():
    clock = FakeClock()
    meter = Throughput(warmup_steps=2, clock=clock)
    for seconds in (5.0, 1.0, 0.5, 0.5):  # two slow warm-up steps, then 2 steps of 0.5 s
        clock.now += seconds
        meter.step(64)
    assert meter.overall() == pytest.approx(128 / 1.0)
    assert meter.steps == 4 and meter.samples == 256


def test_throughput_with_too_few_steps_uses_them_all():
    clock = FakeClock()
    meter = Throughput(warmup_steps=5, clock=clock)
    clock.now += 2.0
    meter.step(100)
    assert meter.overall() == pytest.approx(50.0)
    assert Throughput(warmup_steps=5, clock=clock).overall() == 0.0


def test_throughput_window_restarts():
    clock = FakeClock()
    meter = Throughput(warmup_steps=0, clock=clock)
    clock.now += 1.0
    meter.step(10)
    assert meter.window() == pytest.approx(10.0)
    clock.now += 2.0
    meter.step(10)
    meter.step(10)
    assert meter.window() == pytest.approx(10.0)
    assert meter.overall() == pytest.approx(30 / 3.0)


# --- progress ----------------------------------------------------------------------------------


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_want_progress_bar():
    assert want_progress_bar(Tty(), env={}) is True
    assert want_progress_bar(io.StringIO(), env={}) is False
    assert want_progress_bar(io.StringIO(), env={"TRAINPOD_PROGRESS": "bar"}) is True
    assert want_progress_bar(Tty(), env={"TRAINPOD_PROGRESS": "lines"}) is False


def test_progress_lines_at_log_points_only():
    out = io.StringIO()
    progress = Progress(total_steps=64, epochs=2, bar=False, stream=out)
    progress.update(1, 39, 1.5, 1000.0, log_point=False)
    progress.update(1, 40, 1.23449, 1523.44, log_point=True)
    progress.print("done")
    assert out.getvalue() == "epoch 1/2 step 40/64 loss 1.2345 1523.4 samples/s\ndone\n"


def test_progress_bar_redraws_one_line_and_ends_it():
    out = Tty()
    clock = FakeClock()
    progress = Progress(total_steps=4, epochs=1, stream=out, width=4, clock=clock)
    assert progress.bar
    progress.update(1, 1, 2.0, 10.0, log_point=True)
    clock.now += 1
    progress.update(1, 2, None, 10.0, log_point=False)
    progress.update(1, 3, 1.0, 10.0, log_point=False)  # too soon after the last draw: skipped
    progress.update(1, 4, 0.5, 10.0, log_point=True)  # the last step is always drawn
    progress.print("trainpod-metrics: {}")
    text = out.getvalue()
    frames = text.split("\r")[1:]
    assert frames[0].startswith("[#...] epoch 1/1 step 1/4 loss 2.0000")
    assert frames[1].startswith("[##..] epoch 1/1 step 2/4 10.0 samples/s")
    assert len(frames[1]) == len(frames[0])  # padded over the longer previous frame
    assert frames[2].startswith("[####] epoch 1/1 step 4/4 loss 0.5000")
    assert text.endswith("samples/s\ntrainpod-metrics: {}\n")
    assert len(frames) == 3


def test_progress_disabled_prints_nothing():
    out = Tty()
    progress = Progress(total_steps=4, epochs=1, enabled=False, stream=out)
    progress.update(1, 1, 2.0, 10.0, log_point=True)
    progress.print("x")
    progress.close()
    assert out.getvalue() == ""


def test_the_log_line_is_a_short_summary_that_names_the_file(tmp_path):
    from trainpod.examples.reporting import summary

    metrics = {"example": "cifar10-ddp", "steps": 32, "final_loss": 0.661150395870, "loss_curve": [[1, 2.3]] * 500,
               "checksum": "ab" * 32, "rank_checksums": ["ab" * 32] * 4}
    short = summary(metrics, tmp_path / "metrics.json")
    assert short["ranks_agree"] is True and short["final_loss"] == 0.6612 and "loss_curve" not in short
    assert short["metrics"] == str(tmp_path / "metrics.json")
    assert len(metrics_line(short)) < 400
    assert summary({**metrics, "rank_checksums": ["a", "b"]}, "m.json")["ranks_agree"] is False
