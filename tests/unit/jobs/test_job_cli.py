"""`trainpod job`: the settings-table flags with their TRAINPOD_JOB_* twins, one-line errors, nothing written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fixtures.cli import in_process
from trainpod import jobs
from trainpod.errors import ConfigError, UsageError

ENTRYPOINT = str(Path(__file__).resolve().parents[3] / "entrypoint")
CLEAN = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "SLURM_", "PAI_", "PET_"))}


def trainpod(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "trainpod", *args], env={**CLEAN, "PYTHONPATH": ENTRYPOINT, **(env or {})},
                          capture_output=True, text=True, timeout=60, cwd=cwd)


def here(*args, env=None):
    """trainpod() in this process (fixtures.cli.in_process): nothing here starts a job."""
    return in_process(args, {**CLEAN, "PYTHONPATH": ENTRYPOINT, **(env or {})})


def one_line_error(result, code):
    assert result.returncode == code, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainpod: error: "), result.stderr
    return lines[0]


def test_every_scheduler_is_a_subcommand_with_its_own_flags():
    result = here("job", "--help")
    assert result.returncode == 0
    for name, cls in jobs.REGISTRY.items():
        assert name in result.stdout
        helped = here("job", name, "--help")
        assert helped.returncode == 0, helped.stderr
        for setting in (*jobs.SETTINGS, *cls.settings):
            assert setting.flag in helped.stdout
            if setting.var:
                assert setting.var in helped.stdout


@pytest.mark.slow
def test_prints_the_file_and_writes_nothing(tmp_path):
    result = trainpod("job", "openpai", "cifar10-ddp", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["taskRoles"]["worker"]["instances"] == 2
    assert list(tmp_path.iterdir()) == []


def test_a_variable_is_the_flags_twin_and_the_flag_wins():
    by_var = here("job", "openpai", "cifar10-ddp", env={"TRAINPOD_JOB_NODES": "3"})
    assert yaml.safe_load(by_var.stdout)["taskRoles"]["worker"]["instances"] == 3
    assert "--nodes 3" in by_var.stdout  # the header says how to render it again, variables as flags
    by_flag = here("job", "openpai", "cifar10-ddp", "--nodes", "4", env={"TRAINPOD_JOB_NODES": "3"})
    assert yaml.safe_load(by_flag.stdout)["taskRoles"]["worker"]["instances"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["job"],
    ["job", "openpai"],
    ["job", "nope", "cifar10-ddp"],
    ["job", "openpai", "nope"],
    ["job", "openpai", "cifar10-ddp", "--nodes", "0"],
    ["job", "openpai", "cifar10-ddp", "--nodes", "x"],
    ["job", "openpai", "cifar10-dp", "--nodes", "2"],
    ["job", "openpai", "cifar10-dp", "--nproc-per-node", "2"],
    ["job", "openpai", "cifar10-ddp", "--backend", "nccl"],
    ["job", "openpai", "cifar10-ddp", "--gpus", "2", "--nproc-per-node", "4"],
    ["job", "openpai", "cifar10-ddp", "--name", "Has_Capitals"],
    ["job", "openpai", "cifar10-ddp", "--pai-port-label", "ssh"],
    ["job", "openpai", "cifar10-ddp", "--pai-role", "1st"],
    ["job", "openpai", "cifar10-ddp", "--term-grace", "nan"],
    ["job", "openpai", "cifar10-ddp", "--submit"],
    ["job", "openpai", "cifar10-ddp", "--spares", "1"],  # not elastic
    ["job", "kubeflow", "imagenet-elastic", "--nodes", "2", "--spares", "1"],  # 2:2, no node to lose
    ["job", "slurm", "imagenet-elastic", "--spares", "1"],  # srun ends the step when a node fails
    ["job", "ssh", "imagenet-elastic", "--hosts", "a,b,c", "--spares", "1"],  # so does a failed host
    ["job", "kubeflow", "imagenet-elastic", "--spares", "-1"],
])
def test_usage_errors_exit_64_in_one_line(args):
    one_line_error(here(*args), 64)


@pytest.mark.parametrize("scheduler", sorted(jobs.REGISTRY))
def test_the_examples_own_flags_are_checked_before_a_job_file_is_written(scheduler):
    # As its ranks will parse them: a typo is one line here, not a job that fails after it waited in the queue.
    # This machine's TRAINPOD_* variables are not the job's, so they are not read.
    hosts = ["--hosts", "a,b"] if scheduler == "ssh" else []
    assert one_line_error(here("job", scheduler, "cifar10-ddp", *hosts, "--", "--epocs", "3"), 64) == \
        "trainpod: error: cifar10-ddp: unrecognized arguments: --epocs 3"
    assert one_line_error(here("job", scheduler, "cifar10-ddp", *hosts, "--", "--max-steps", "-5"), 64) == \
        "trainpod: error: cifar10-ddp: --max-steps='-5': expected an integer >= 1"
    assert here("job", scheduler, "cifar10-ddp", *hosts, "--", "--epochs", "3", env={"TRAINPOD_EPOCHS": "x"}).returncode == 0


@pytest.mark.parametrize("env,named", [
    ({"TRAINPOD_JOB_NODES": "0"}, "TRAINPOD_JOB_NODES='0'"),
    ({"TRAINPOD_JOB_GPUS": "many"}, "TRAINPOD_JOB_GPUS='many'"),
    ({"TRAINPOD_JOB_BACKEND": "nccl"}, "TRAINPOD_JOB_BACKEND=nccl"),
    ({"TRAINPOD_JOB_PAI_PORT_LABEL": "http"}, "TRAINPOD_JOB_PAI_PORT_LABEL='http'"),
    ({"TRAINPOD_TERM_GRACE": "0"}, "TRAINPOD_TERM_GRACE='0'"),
    ({"TRAINPOD_JOB_SPARES": "1"}, "TRAINPOD_JOB_SPARES=1: the example cifar10-ddp is not elastic"),
])
def test_bad_variables_exit_78_naming_them(env, named):
    assert named in one_line_error(here("job", "openpai", "cifar10-ddp", env=env), 78)


def test_request_defaults_come_from_the_example():
    renderer, _ = jobs.build("openpai", "imagenet-ddp", {}, {})
    request = renderer.request
    assert (request.nodes, request.gpus, request.processes_per_node, request.effective_backend) == (2, 8, 8, "nccl")
    assert request.image == "trainpod:cuda" and request.shm_mb == 8192
    assert request.run_argv() == ["trainpod", "run", "--example", "imagenet-ddp"]
    cpu, _ = jobs.build("openpai", "cifar10-ddp", {"nproc_per_node": "2", "term_grace": "40"}, {}, ["--epochs", "1"])
    assert cpu.request.run_argv() == ["trainpod", "run", "--example", "cifar10-ddp", "--nproc-per-node", "2", "--term-grace", "40",
                                      "--", "--epochs", "1"]
    assert cpu.request.stop_grace_s == 70
    dp, _ = jobs.build("openpai", "cifar10-dp", {"gpus": "4"}, {})
    assert dp.request.processes_per_node == 1 and "--nproc-per-node" not in dp.request.run_argv()


def test_errors_name_their_origin():
    with pytest.raises(UsageError, match="--nodes=3"):
        jobs.build("openpai", "cifar10-dp", {"nodes": "3"}, {})
    with pytest.raises(ConfigError, match="TRAINPOD_JOB_NODES"):
        jobs.build("openpai", "cifar10-dp", {}, {"TRAINPOD_JOB_NODES": "3"})
