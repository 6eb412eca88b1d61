import io
import logging

from trainpod import log


def test_prefixes():
    assert log.prefix() == "trainpod"
    assert log.prefix(1) == "[node1] trainpod"
    assert log.tag(0) == "[node0]"
    assert log.rank_tag_template(2) == "[node2 rank${rank}] "


def test_writer_prints_one_flushed_line(capsys):
    log.writer(3)("hello")
    assert capsys.readouterr().err == "[node3] trainpod: hello\n"


def test_torchs_lines_about_what_trainpod_says_go_to_the_runs_agent_log(tmp_path):
    # Issue 24: a rank's usage error ended in its line, torch's "E... failed (exitcode: 64)" and two of trainpod's.
    console = io.StringIO()
    aside = log.Aside()
    handler = logging.StreamHandler(console)
    handler.addFilter(aside)
    torch_own = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    torch_own.addHandler(handler)
    try:
        torch_own.error("failed (exitcode: %s) local_rank: %s (pid: %s)", 64, 0, 123)
        assert "failed (exitcode: 64)" in console.getvalue()  # no run directory yet: the console keeps it
        console.seek(0)
        console.truncate()
        aside.path = str(tmp_path / log.ASIDE_FILE)
        torch_own.error("failed (exitcode: %s) local_rank: %s (pid: %s)", 64, 0, 123)
        torch_own.warning("Sending process %s closing signal %s", 124, "SIGTERM")
        torch_own.warning("Unable to shutdown process %s via %s, forcefully exiting via %s", 124, 15, 9)
    finally:
        torch_own.removeHandler(handler)
    assert console.getvalue() == "Unable to shutdown process 124 via 15, forcefully exiting via 9\n"  # news: stays
    kept = (tmp_path / log.ASIDE_FILE).read_text().splitlines()
    assert [line.split(" ", 2)[2] for line in kept] == [
        "torch.distributed.elastic.multiprocessing.api ERROR: failed (exitcode: 64) local_rank: 0 (pid: 123)",
        "torch.distributed.elastic.multiprocessing.api WARNING: Sending process 124 closing signal SIGTERM"]
