"""trainpod.train.progress: what a rank reports, as its agent reads it."""

import pytest

from trainpod.contract import PROGRESS_DIR_VAR
from trainpod.train import progress


def test_a_rank_reports_its_step_commit_and_the_end_of_training(tmp_path, monkeypatch):
    monkeypatch.setenv(PROGRESS_DIR_VAR, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(progress, "_reporter", progress._Reporter())
    assert progress.read(tmp_path) == {}
    progress.step(7)
    progress.committed(5)
    record = progress.read(tmp_path)[3]
    assert (record.step, record.committed, record.finished) == (7, 5, False)
    progress.finished()
    record = progress.read(tmp_path)[3]
    assert (record.step, record.committed, record.finished) == (7, 5, True)
    assert (tmp_path / "rank3").stat().st_size == progress._RECORD_BYTES  # one fixed-width line, overwritten


def test_without_the_variable_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(PROGRESS_DIR_VAR, raising=False)
    monkeypatch.setattr(progress, "_reporter", progress._Reporter())
    progress.step(1)
    progress.finished()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_measure_reports_a_steps_own_work_not_its_wait_for_the_others(tmp_path, monkeypatch):
    """The time from the end of the previous step to the last gradient: a wait after backward (the
    all-reduce, an optimizer step) is not the rank's own work."""
    import time

    import torch

    monkeypatch.setenv(PROGRESS_DIR_VAR, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(progress, "_reporter", progress._Reporter())
    monkeypatch.setattr(progress, "_compute", progress._Compute())
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    progress.step(0)
    assert progress.read(tmp_path)[0].busy == 0.0  # not measured: no hook yet
    progress.measure(model)
    for n in (1, 2):
        time.sleep(0.2)  # the rank's own work (a slow data loader counts)
        model(torch.ones(2, 4)).sum().backward()
        time.sleep(1.0)  # waiting for the others: counted, the figure would be 1.2 s at least
        progress.step(n)
        busy = progress.read(tmp_path)[0].busy
        assert 0.2 <= busy < 1.0, f"step {n}: busy {busy}"
    figure = progress.read(tmp_path)[0].busy
    progress.step(3)  # a step with no backward: the last figure stands
    assert progress.read(tmp_path)[0].busy == figure


def test_a_record_without_the_busy_field_reads_as_not_measured(tmp_path):
    (tmp_path / "rank0").write_bytes(b"%20d %20d %20.3f %1d\n" % (4, 2, 1.5, 0))  # an older trainpod's record
    assert progress.read(tmp_path)[0] == progress.Record(4, 2, 1.5, False, 0.0, 0)


def test_a_commit_reports_how_long_its_save_took_and_held_the_loop(tmp_path, monkeypatch):
    monkeypatch.setenv(PROGRESS_DIR_VAR, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(progress, "_reporter", progress._Reporter())
    progress.committed(8, save_seconds=1.25, stall_seconds=0.125)
    progress.step(9)
    record = progress.read(tmp_path)[0]
    assert (record.committed, record.save, record.stall) == (8, 1.25, 0.125)
    progress.committed(8)  # a resumed checkpoint's step: the last save's figures stay
    assert progress.read(tmp_path)[0].save == 1.25
    huge = progress.Record(1, 1, 1.0, save=1e12, stall=1e12)  # capped: the record keeps its width
    assert len(progress.encode(huge)) == progress._RECORD_BYTES
