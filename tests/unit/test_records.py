"""trainpod.records: each node's run records, appended as JSON lines and read back in time order."""

import json

from trainpod import records


def test_each_node_appends_its_own_file_and_every_nodes_records_read_back_in_time_order(tmp_path):
    a, b = records.Writer(tmp_path, host="node-a"), records.Writer(tmp_path, host="node-b")
    assert a.write("started", 10.0, world=2, nodes=2, ranks=[0])
    assert b.write("started", 10.5, world=2, nodes=2, ranks=[1])
    assert a.write("progress", 11.0, rank=0, step=1, samples=16, own_s=0.1, step_s=None)
    assert sorted(p.name for p in (tmp_path / "records").iterdir()) == ["node-a.jsonl", "node-b.jsonl"]
    found = records.read(tmp_path)
    assert [(r.time, r.node, r.kind) for r in found] == [(10.0, "node-a", "started"), (10.5, "node-b", "started"),
                                                         (11.0, "node-a", "progress")]
    assert found[2].fields == {"rank": 0, "step": 1, "samples": 16, "own_s": 0.1, "step_s": None}
    assert found[2].get("missing", "default") == "default"


def test_a_host_name_is_a_safe_file_name_and_the_record_keeps_it_as_it_is(tmp_path):
    writer = records.Writer(tmp_path, host="../<b>x</b> y")
    writer.write("hang", 1.0, ranks=[1], stalled_s=30.0, limit_s=20.0)
    assert [p.name for p in (tmp_path / "records").iterdir()] == ["..__b_x__b__y.jsonl"]  # no path separator, nothing to interpret
    assert records.read(tmp_path)[0].node == "../<b>x</b> y"


def test_a_line_cut_by_a_kill_or_of_an_unknown_kind_is_skipped(tmp_path):
    records.Writer(tmp_path, host="n").write("failed", 2.0, cause="failure", restarting=True)
    with open(tmp_path / "records" / "n.jsonl", "a") as f:
        f.write('{"time": 3.0, "node": "n", "kind": "a-later-kind"}\n{"time": 4.0, "node": "n", "ki')
    (tmp_path / "records" / "other.jsonl").write_text("not json\n[1, 2]\n")
    assert [r.kind for r in records.read(tmp_path)] == ["failed"]


def test_no_directory_reads_as_no_records_and_a_nan_is_written_as_null(tmp_path):
    assert records.read(tmp_path / "none") == []
    records.Writer(tmp_path, host="n").write("progress", 1.0, rank=0, step=1, own_s=float("nan"), step_s=float("inf"))
    line = json.loads((tmp_path / "records" / "n.jsonl").read_text())
    assert (line["own_s"], line["step_s"]) == (None, None)


def test_a_directory_that_cannot_be_written_says_so_once_and_writes_nothing_more(tmp_path):
    (tmp_path / "file").write_text("")
    said = []
    writer = records.Writer(tmp_path / "file", said.append, host="n")
    assert not writer.write("started", 1.0, world=1, nodes=1, ranks=[0])
    assert not writer.write("failed", 2.0, cause="failure", restarting=False)
    assert len(said) == 1 and "the run's records stop here" in said[0], said


def test_a_line_that_is_no_record_is_passed_over_by_read_and_said_by_scan(tmp_path):
    # (A 400-digit time was an OverflowError out of read(), a traceback for every caller.)
    good = {"time": 1796640000.0, "node": "a", "kind": "started", "world": 2}
    lines = [json.dumps(good), '{"time": 1' + "0" * 400 + ', "node": "a", "kind": "failed"}', '{"time": NaN, "node": "a", "kind": "hang"}',
             "[1, 2]", '{"time": 1, "node": "a", "kind": "a-later-kind"}', '{"time": 17966400']  # the last: cut by a kill
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "a.jsonl").write_text("\n".join(lines))
    assert [record.kind for record in records.read(tmp_path)] == ["started"]
    found = records.scan(tmp_path)
    assert [(number, why.split(":")[0]) for _, number, why in found.left_out] == [(2, '"time" 1000000000000000000000000000000000000...'),
                                                                                 (3, '"time" NaN'), (4, "a JSON list, not an object")]
