"""--hang-timeout / TRAINPOD_HANG_TIMEOUT through the CLI: parsed like every setting, shown by explain."""

import json

import pytest
from test_cli import one_line_error, trainpod

from trainpod.runspec import RunSpec


@pytest.mark.slow
@pytest.mark.parametrize("value", ["nan", "-1", "inf", "1_0"])
def test_a_bad_hang_timeout_flag_is_64_and_a_bad_variable_78(value):
    assert f"--hang-timeout={value!r}" in one_line_error(trainpod("run", "--hang-timeout", value, "--", "true"), 64)
    assert f"TRAINPOD_HANG_TIMEOUT={value!r}" in one_line_error(trainpod("explain", env={"TRAINPOD_HANG_TIMEOUT": value}), 78)


@pytest.mark.slow
def test_explain_shows_the_watch_run_would_give_the_agent():
    result = trainpod("explain", "--json", "--hang-timeout", "0", "--", "true")
    assert result.returncode == 0, result.stderr
    assert RunSpec.from_env(json.loads(result.stdout)["env"]).hang_timeout == 0  # what the agent reads
    result = trainpod("explain", "--json", "--", "true", env={"TRAINPOD_OUTPUT_DIR": "/out"})
    env = json.loads(result.stdout)["env"]
    assert RunSpec.from_env(env).hang_timeout == 120 and env["TORCH_FR_DUMP_TEMP_FILE"] == "/out/hangs/flight-recorder/rank"


@pytest.mark.slow
def test_the_flag_is_in_the_help():
    assert "--hang-timeout" in trainpod("run", "--help").stdout
