"""The settings table: kinds, precedence, and where a bad value is blamed (flag 64, variable 78)."""

import pytest

from trainpod import settings
from trainpod.errors import ConfigError, UsageError
from trainpod.settings import Boolean, Choice, Host, Integer, Invalid, Number, ProcessCount, Setting, Switch


@pytest.mark.parametrize("text,expected", [("0", 0), (" 7 ", 7), ("+3", 3), (12, 12)])
def test_integers(text, expected):
    assert Integer()(text) == expected


@pytest.mark.parametrize("text", ["٢", "1_0", "9" * 25, "1.0", "", "x", "-1", True, "0x10"])
def test_integers_are_ascii_digits_within_bounds(text):
    with pytest.raises(Invalid):
        Integer(0, 10**6)(text)


@pytest.mark.parametrize("text,expected", [("2.5", 2.5), ("1e2", 100.0), (".5", 0.5), ("3", 3.0), (4, 4.0)])
def test_numbers(text, expected):
    assert Number(above=0)(text) == expected


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "NaN", "1_0", "٢", "0", "-1", "", "1e999"])
def test_numbers_are_finite_and_above_the_bound(text):
    with pytest.raises(Invalid):
        Number(above=0)(text)


def test_number_bounds_read_well():
    assert Number(above=0).expected() == "a number of seconds above 0"
    assert Number(minimum=0).expected() == "a number of seconds >= 0"


@pytest.mark.parametrize("text,expected", [
    ("10.0.0.1", "10.0.0.1"), ("fd00::2", "fd00::2"), ("[::1]", "::1"), ("node0", "node0"),
    ("mnist-node-0-0.mnist", "mnist-node-0-0.mnist"), ("pai_node0", "pai_node0"), ("master.", "master."),
])
def test_hosts(text, expected):
    assert Host()(text) == expected


@pytest.mark.parametrize("text", ["", "127.0.0.1:29500", "two words", "[10.0.0.1]", "10.0.0", "999.1.1.1", "-node", "a" * 64,
                                  "host/x", "[::1]:29500", "nöde"])
def test_malformed_hosts(text):
    with pytest.raises(Invalid, match="without a port"):
        Host()(text)


def test_process_counts():
    assert ProcessCount()("auto") == ProcessCount()("gpu") == "auto"
    assert ProcessCount()("4") == 4
    for bad in ("0", "1025", "many"):
        with pytest.raises(Invalid, match="or auto"):
            ProcessCount()(bad)


def test_booleans_and_choices():
    assert Boolean()("Yes") is True and Boolean()("off") is False and Boolean()(True) is True
    with pytest.raises(Invalid):
        Boolean()("maybe")
    assert Choice(("gloo", "nccl"))(" nccl ") == "nccl"
    with pytest.raises(Invalid, match="one of gloo, nccl"):
        Choice(("gloo", "nccl"))("mpi")


SETTING = Setting("max_restarts", "restarts", Integer(0, 100), var="TRAINPOD_MAX_RESTARTS", default=3)


def test_flag_then_variable_then_default():
    assert settings.resolve([SETTING], {"max_restarts": "5"}, {"TRAINPOD_MAX_RESTARTS": "7"}).max_restarts == 5
    values = settings.resolve([SETTING], {}, {"TRAINPOD_MAX_RESTARTS": "7"})
    assert values.max_restarts == 7 and values.origins["max_restarts"] == "TRAINPOD_MAX_RESTARTS"
    values = settings.resolve([SETTING], {"max_restarts": None}, {"TRAINPOD_MAX_RESTARTS": " "})
    assert values.max_restarts == 3 and values.origins["max_restarts"] == "default"


def test_a_bad_flag_is_a_usage_error_and_a_bad_variable_a_configuration_error():
    with pytest.raises(UsageError, match=r"^--max-restarts='-1': expected an integer from 0 to 100$"):
        settings.resolve([SETTING], {"max_restarts": "-1"}, {})
    with pytest.raises(ConfigError, match=r"^TRAINPOD_MAX_RESTARTS='-1': expected an integer from 0 to 100$"):
        settings.resolve([SETTING], {}, {"TRAINPOD_MAX_RESTARTS": "-1"})


def test_parse_args_derives_flags_help_and_switches(capsys):
    table = (SETTING, Setting("quiet", "say less", Switch(), var="TRAINPOD_QUIET", default=False),
             Setting("amp", "mixed precision", Boolean(), var="TRAINPOD_AMP", default=False))
    values = settings.parse_args("prog", "", table, ["--quiet", "--no-amp"], {"TRAINPOD_AMP": "1"})
    assert (values.max_restarts, values.quiet, values.amp) == (3, True, False)
    assert settings.parse_args("prog", "", table, [], {"TRAINPOD_QUIET": "yes"}).quiet is True
    with pytest.raises(UsageError, match="^prog: unrecognized arguments: --bogus$"):
        settings.parse_args("prog", "", table, ["--bogus"], {})
    # each as a shell word: an empty argument, or one holding a space, is seen (argparse joins them with spaces)
    with pytest.raises(UsageError, match="^prog: unrecognized arguments: '' 'a b' x$"):
        settings.parse_args("prog", "", table, ["", "a b", "x"], {})
    # a flag is its whole name: an abbreviation would mean whichever flag shares the prefix in this release
    with pytest.raises(UsageError, match="^prog: unrecognized arguments: --max-restart 2$"):
        settings.parse_args("prog", "", table, ["--max-restart", "2"], {})
    with pytest.raises(SystemExit):
        settings.parse_args("prog", "", table, ["--help"], {})
    assert "restarts (default 3; env TRAINPOD_MAX_RESTARTS)" in " ".join(capsys.readouterr().out.split())


def test_a_flag_given_again_with_another_value_is_said_and_the_last_one_counts():
    table = (SETTING, Setting("quiet", "say less", Switch(), var="TRAINPOD_QUIET", default=False),
             Setting("amp", "mixed precision", Boolean(), var="TRAINPOD_AMP", default=False))
    said: list[str] = []
    values = settings.parse_args("prog", "", table, ["--max-restarts", "5", "--amp", "--quiet", "--quiet", "--max-restarts=5",
                                                     "--no-amp", "--max-restarts", "7"], {}, said)
    assert (values.max_restarts, values.amp, values.quiet) == (7, False, True)
    assert said == ["prog: --amp given more than once (--amp, then --no-amp): the last one counts",
                    "prog: --max-restarts given more than once (5, then 7): the last one counts"]
    said = []  # a value as a shell word, on one line
    with pytest.raises(UsageError):
        settings.parse_args("prog", "", table, ["--max-restarts", "5", "--max-restarts", "a b\n"], {}, said)
    assert said == ["prog: --max-restarts given more than once (5, then 'a b\\n'): the last one counts"]
    values = settings.parse_args("prog", "", table, ["--max-restarts", "4", "--max-restarts", "6"], {})  # no list: not said
    assert values.max_restarts == 6


def test_node_ranges_and_rendezvous_conf():
    from trainpod.settings import NNODES, RDZV_CONF

    assert NNODES.parse("4", "--nnodes") == (4, 4) and NNODES.parse("1:4", "--nnodes") == (1, 4)
    for bad in ("0", "4:1", "1:", ":2", "a:b", "1:2:3"):
        with pytest.raises(UsageError):
            NNODES.parse(bad, "--nnodes")
    assert RDZV_CONF.parse("last_call_timeout=5, keep_alive_interval=2", "--rdzv-conf") == {
        "last_call_timeout": "5", "keep_alive_interval": "2"}
    with pytest.raises(ConfigError) as caught:
        RDZV_CONF.parse("timeout", "TRAINPOD_RDZV_CONF")
    assert "TRAINPOD_RDZV_CONF='timeout'" in str(caught.value)
