from trainpod import log


def test_prefixes():
    assert log.prefix() == "trainpod"
    assert log.prefix(1) == "[node1] trainpod"
    assert log.tag(0) == "[node0]"
    assert log.rank_tag_template(2) == "[node2 rank${rank}] "


def test_writer_prints_one_flushed_line(capsys):
    log.writer(3)("hello")
    assert capsys.readouterr().err == "[node3] trainpod: hello\n"
