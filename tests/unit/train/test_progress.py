"""trainpod.train.progress: what a rank reports, as its agent reads it."""

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
