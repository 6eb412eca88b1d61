"""`trainpod report OUTPUT_DIR`: one self-contained HTML file from the run's records and metrics.json, through the real
CLI (trainpod.launcher.cli.main) in this process; its series checked on a run whose figures are known
(fixtures.run_records). The page in a real browser: tests/integration/test_report_browser.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.cli import in_process
from fixtures.run_records import BATCH, FAILED_AT, NODES, RESUMED_AT, START, STEPS_PER_S, write_run
from trainpod.launcher import report
from trainpod.launcher.cli import main

KINDS = ("started", "failed", "recovered", "membership", "hang", "straggler", "checkpoint")


def run_report(capsys, *args) -> tuple[int, str, str]:
    code = main(["report", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("trainpod: error: trainpod report: "), err
    return lines[0]


def events_table(page: str) -> str:
    return page.split("<h2>Events</h2>", 1)[1]


def test_a_run_is_drawn_into_one_file_that_needs_no_network(tmp_path, capsys):
    output = write_run(tmp_path / "output")
    code, out, err = run_report(capsys, output)
    assert code == 0, err
    assert out == f"{output / 'report.html'}\n"
    page = (output / "report.html").read_text()
    assert "plotly.js v" in page and "Plotly.newPlot" in page  # the bundle itself, embedded
    assert page.count("plotly.js v") == 1  # once, however many figures
    assert '<script src="http' not in page and "<script src='http" not in page
    assert not re.search(r"<(script|link)[^>]+(src|href)=[\"']?(https?:)?//", page)
    assert "cifar10-ddp" in page and "0.610" in page and "512.0" in page


def test_every_event_kind_is_in_the_table_in_time_order(tmp_path, capsys):
    output = write_run(tmp_path / "output")
    assert run_report(capsys, output)[0] == 0
    table = events_table((output / "report.html").read_text())
    for kind in KINDS:
        assert f"<td>{kind}</td>" in table, kind
    assert "<td>progress</td>" not in table  # a line a second per rank: drawn, not listed
    seconds = [float(s) for s in re.findall(r'<td class="number">([0-9.]+)</td>', table)]
    assert seconds == sorted(seconds) and seconds[0] == 0.0
    assert "cause failure; restarting" in table and "rank 3 keeps pace again" in table


def test_a_node_name_is_data_never_markup(tmp_path, capsys):
    output = write_run(tmp_path / "output")  # one node is called <b>x</b>
    assert run_report(capsys, output)[0] == 0
    page = (output / "report.html").read_text()
    assert "<td>&lt;b&gt;x&lt;/b&gt;</td>" in events_table(page)
    assert "<b>x</b>" not in page


def test_out_writes_the_report_where_it_says_and_prints_that_path(tmp_path, capsys):
    output = write_run(tmp_path / "output")
    code, out, err = run_report(capsys, output, "--out", tmp_path / "run.html")
    assert (code, out) == (0, f"{tmp_path / 'run.html'}\n"), err
    assert (tmp_path / "run.html").stat().st_size > 1_000_000 and not (output / "report.html").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_an_empty_directory_is_78_with_one_line_naming_it(tmp_path, capsys):
    code, out, err = run_report(capsys, tmp_path)
    assert (code, out) == (78, "")
    line = one_line(err)
    assert str(tmp_path) in line and "no run records (records/*.jsonl) or metrics.json" in line


@pytest.mark.parametrize("what", ["missing", "a file"])
def test_a_missing_directory_or_a_file_is_78_with_one_line(tmp_path, capsys, what):
    path = tmp_path / "output"
    if what == "a file":
        path.write_text("not a directory")
    code, out, err = run_report(capsys, path)
    assert (code, out) == (78, "")
    assert str(path) in one_line(err)


def test_an_out_that_cannot_be_written_is_78_with_one_line(tmp_path, capsys):
    output = write_run(tmp_path / "output")
    code, out, err = run_report(capsys, output, "--out", tmp_path / "no" / "such" / "dir" / "r.html")
    assert (code, out) == (78, "")
    assert "--out " in one_line(err) and f"no such directory {tmp_path / 'no' / 'such' / 'dir'}" in err


def test_metrics_json_alone_is_still_a_report_with_the_loss_by_step(tmp_path, capsys):
    output = write_run(tmp_path / "output", records_too=False)
    code, out, err = run_report(capsys, output)
    assert (code, err) == (0, "")
    page = (output / "report.html").read_text()
    assert "loss by step" in page and "trainpod-loss-by-step" in page and "trainpod-run" not in page
    assert "No events recorded." in page


def test_records_alone_are_a_report_without_the_loss(tmp_path, capsys):
    output = write_run(tmp_path / "output", metrics_too=False)
    assert run_report(capsys, output)[0] == 0
    page = (output / "report.html").read_text()
    assert "trainpod-run" in page and "loss by step" not in page and "placed by global rank 0" not in page


def test_a_broken_metrics_json_is_a_warning_and_the_records_are_still_drawn(tmp_path, capsys):
    output = write_run(tmp_path / "output", metrics_too=False)
    (output / "metrics.json").write_text('{"example": "cut by a ki')
    code, _, err = run_report(capsys, output)
    assert code == 0 and err.count("\n") == 1 and "warning" in err and "metrics.json" in err


def test_a_broken_metrics_json_without_records_is_78_naming_it(tmp_path, capsys):
    (tmp_path / "metrics.json").write_text("[1, 2]")
    code, out, err = run_report(capsys, tmp_path)
    assert (code, out) == (78, "")
    assert f"{tmp_path / 'metrics.json'}: a JSON list, not an object" in one_line(err)


def test_without_plotly_it_says_how_to_get_it(tmp_path, capsys, monkeypatch):
    output = write_run(tmp_path / "output")
    for name in ("plotly", "plotly.graph_objects", "plotly.subplots"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as where it is not installed
    code, out, err = run_report(capsys, output)
    assert (code, out) == (78, "")
    assert one_line(err) == "trainpod: error: trainpod report: needs plotly: pip install 'trainpod[report]'"


def test_help_lists_report_and_its_out_flag():
    env = dict(os.environ)
    assert "report" in in_process(["--help"], env).stdout
    assert "--out FILE" in in_process(["report", "--help"], env).stdout


def test_the_job_throughput_is_the_ranks_samples_summed_and_zero_while_it_restarts(tmp_path):
    run = report.load(write_run(tmp_path / "output"))
    unit, times, rates = report.throughput(report.progress_by_rank(run))
    assert unit == "samples/s"
    ranks = sum(len(r) for r in NODES.values())
    running = [rate for t, rate in zip(times, rates) if START + 5 < t < START + FAILED_AT - 2]
    assert running and all(rate == pytest.approx(ranks * STEPS_PER_S * BATCH) for rate in running)
    stopped = [rate for t, rate in zip(times, rates) if START + FAILED_AT + 1 < t < START + RESUMED_AT - 1]
    assert stopped and all(rate == 0 for rate in stopped)


def test_steps_per_second_where_no_rank_reports_samples(tmp_path):
    from trainpod import records

    writer = records.Writer(tmp_path, host="node-a")
    for at in range(10):
        for rank in (0, 1):
            writer.write("progress", START + at, rank=rank, step=3 * at, samples=0, own_s=0, step_s=None)
    unit, _, rates = report.throughput(report.progress_by_rank(report.load(tmp_path)))
    assert unit == "steps/s" and all(rate == pytest.approx(3) for rate in rates)


def test_a_loss_step_is_placed_when_rank_0_last_trained_it(tmp_path):
    run = report.load(write_run(tmp_path / "output"))
    clock = report.step_clock(report.progress_by_rank(run)[0])
    assert clock(2) == START + 2  # rank 0's first report
    assert clock(30) == START + RESUMED_AT  # trained before the failure, and again after it: the last time counts
    assert clock(31) == pytest.approx(START + RESUMED_AT + 0.5)  # between two reports
    assert clock(0) < START + 2  # before the first report: at rank 0's mean pace


def test_the_world_is_zero_from_a_failure_to_the_next_start(tmp_path):
    run = report.load(write_run(tmp_path / "output"))
    line = report.world_line(run)
    assert [world for t, world in line if t == START + FAILED_AT] == [0, 0]
    assert line[-1] == (run.records[-1].time, 4)


@pytest.mark.slow
def test_the_report_never_imports_torch(tmp_path):
    output = write_run(tmp_path / "output")
    code = ("import sys; from trainpod.launcher.cli import main; assert main(['report', sys.argv[1]]) == 0; "
            "print('torch' in sys.modules)")
    entrypoint = str(Path(__file__).resolve().parents[3] / "entrypoint")
    path = os.pathsep.join(filter(None, [entrypoint, os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", code, str(output)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": path})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "False"


# --- records that cannot be drawn, and records that cannot be read ------------------------------------

STARTED = '{"time": 100.0, "node": "vm", "kind": "started", "world": 1, "nodes": 1, "ranks": [0]}'


def progress(at: float | str, step: int) -> str:
    return (f'{{"time": {at}, "node": "vm", "kind": "progress", "rank": 0, "step": {step}, "samples": {8 * step}, '
            f'"own_s": 0, "step_s": 1.0}}')


def records_file(output: Path, *lines: str, end: str = "\n") -> Path:
    (output / "records").mkdir(parents=True, exist_ok=True)
    path = output / "records" / "vm.jsonl"
    path.write_text("\n".join(lines) + end)
    return path


@pytest.fixture
def unreadable(monkeypatch):
    """make(path): chmod 000; where that does not stop this user (root), the system's refusal to list or open that one
    path is made by hand (os.scandir, Path.open), as it is for anyone else. Readable again afterwards."""
    import errno
    import pathlib

    made = []
    scandir, path_open = os.scandir, pathlib.Path.open

    def refused(path):
        return PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    def make(path: Path) -> None:
        mode = path.stat().st_mode
        made.append((path, mode))
        path.chmod(0)
        if os.access(path, os.R_OK):
            monkeypatch.setattr(os, "scandir", lambda p=".": (_ for _ in ()).throw(refused(p))
                                if os.fspath(p) == str(path) else scandir(p))
            monkeypatch.setattr(pathlib.Path, "open", lambda self, *a, **k: (_ for _ in ()).throw(refused(self))
                                if str(self) == str(path) else path_open(self, *a, **k))

    yield make
    for path, mode in made:
        path.chmod(mode)


@pytest.mark.parametrize("time, shown", [("1e20", "1e+20"), ("1e400", "Infinity"), ("NaN", "NaN"), ('"soon"', '"soon"')])
def test_a_time_that_is_no_date_is_78_naming_the_file_its_line_and_the_field(tmp_path, capsys, time, shown):
    path = records_file(tmp_path, STARTED.replace("100.0", time))
    code, out, err = run_report(capsys, tmp_path)
    assert (code, out) == (78, "")
    line = one_line(err)
    assert f'{path}:1: "time" {shown}: expected unix seconds, a finite number (a date from year 1 to 9999)' in line
    assert "no run records (records/*.jsonl)" not in line


def test_a_progress_line_whose_time_is_nan_is_left_out_said_once_and_listed_and_the_rest_is_drawn(tmp_path, capsys):
    path = records_file(tmp_path, STARTED, progress(101.0, 1), progress("NaN", 2), progress(102.0, 2),
                        progress(103.0, 3))
    code, out, err = run_report(capsys, tmp_path)
    assert (code, out) == (0, f"{tmp_path / 'report.html'}\n"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f'warning: trainpod report: {path}:3: "time" NaN: expected unix seconds' in err and err.endswith("left out\n")
    page = (tmp_path / "report.html").read_text()
    assert "<dt>records</dt><dd>4 from 1 nodes" in page  # the started line and three progress lines
    assert "throughput of the job (samples" in page
    assert "<dt>left out</dt><dd>1 records line that cannot be drawn" in page
    assert f'<h2>Records lines left out</h2>\n<ul>\n<li>{path}:3: &quot;time&quot; NaN: expected' in page


def test_lines_left_out_are_counted_in_one_warning_and_their_text_is_data_never_markup(tmp_path, capsys):
    bad = [STARTED.replace("100.0", '"<b>x</b>"')] * 25
    path = records_file(tmp_path, STARTED, *bad, progress(101.0, 1))
    code, _, err = run_report(capsys, tmp_path)
    assert code == 0 and err.count("\n") == 1, err
    assert f"{path}:2: " in err and "(and 24 more; the report lists them)" in err
    page = (tmp_path / "report.html").read_text()
    listed = page.split("<h2>Records lines left out</h2>", 1)[1]
    assert listed.count("<li>") == 21 and "<li>and 5 more</li>" in listed
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in listed


@pytest.mark.parametrize("text, why", [
    ("not json", "not JSON: expected a run record {"),
    ("[1, 2]", "a JSON list, not an object: expected a run record {"),
    ('"started"', "a JSON string, not an object: expected a run record {"),
    ('{"time": 100.0, "node": "vm"}', 'no "kind": expected a run record {'),
])
def test_a_file_of_lines_that_are_no_records_is_78_naming_its_line_not_no_records(tmp_path, capsys, text, why):
    path = records_file(tmp_path, text)
    code, out, err = run_report(capsys, tmp_path)
    assert (code, out) == (78, "")
    line = one_line(err)
    assert f"{path}:1: {why}" in line and "no run records (records/*.jsonl)" not in line


def test_a_file_whose_only_line_is_cut_by_a_kill_is_78_saying_it_holds_no_record(tmp_path, capsys):
    path = records_file(tmp_path, STARTED[:30], end="")
    code, out, err = run_report(capsys, tmp_path)
    assert (code, out) == (78, "")
    line = one_line(err)
    assert f"no run record in {path}: expected lines" in line and "a last line cut short" in line


def test_a_last_line_cut_by_a_kill_and_a_kind_of_another_version_are_left_out_unsaid(tmp_path, capsys):
    records_file(tmp_path, STARTED, '{"time": 100.5, "node": "vm", "kind": "a-later-kind"}', progress(101.0, 1),
                 progress(102.0, 2)[:40], end="")
    code, _, err = run_report(capsys, tmp_path)
    assert (code, err) == (0, "")
    page = (tmp_path / "report.html").read_text()
    assert "<dt>records</dt><dd>2 from 1 nodes" in page and "left out" not in page


def test_an_unreadable_records_directory_is_78_naming_it_though_metrics_json_is_readable(tmp_path, capsys, unreadable):
    write_run(tmp_path / "output")
    unreadable(tmp_path / "output" / "records")
    code, out, err = run_report(capsys, tmp_path / "output")
    assert (code, out) == (78, "")
    assert one_line(err) == (f"trainpod: error: trainpod report: {tmp_path / 'output' / 'records'}: Permission denied: "
                             "expected the directory of the nodes' records files (*.jsonl), readable by this user")


def test_an_unreadable_records_file_is_78_naming_it(tmp_path, capsys, unreadable):
    output = write_run(tmp_path / "output")
    unreadable(output / "records" / "node-b.jsonl")
    code, out, err = run_report(capsys, output)
    assert (code, out) == (78, "")
    assert one_line(err) == (f"trainpod: error: trainpod report: {output / 'records' / 'node-b.jsonl'}: Permission "
                             "denied: expected a node's records file, readable by this user")


def test_a_loss_curve_that_is_no_list_is_left_out(tmp_path, capsys):
    (tmp_path / "metrics.json").write_text('{"example": "x", "loss_curve": 5}')
    code, _, err = run_report(capsys, tmp_path)
    assert (code, err) == (0, "")
    assert "Nothing to draw" in (tmp_path / "report.html").read_text()
