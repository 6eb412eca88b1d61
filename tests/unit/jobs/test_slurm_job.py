"""`trainpod job slurm`: the sbatch script, and --submit through sbatch (a stand-in here; the real one runs in
tests/integration/test_compose_slurm.py)."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.cli import in_process
from trainpod import jobs

ENTRYPOINT = str(Path(__file__).resolve().parents[3] / "entrypoint")
CLEAN = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "SLURM_"))}


def trainpod(*args, env=None):
    return subprocess.run([sys.executable, "-m", "trainpod", *args], env={**CLEAN, "PYTHONPATH": ENTRYPOINT, **(env or {})},
                          capture_output=True, text=True, timeout=60)


def here(*args, env=None):
    """trainpod() in this process (fixtures.cli.in_process): nothing here starts a job."""
    return in_process(args, {**CLEAN, "PYTHONPATH": ENTRYPOINT, **(env or {})})


def directives(script):
    return [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_one_trainpod_per_node_with_what_the_job_needs():
    renderer, _ = jobs.build("slurm", "imagenet-ddp", {"nodes": "4", "partition": "gpu", "time": "2:00:00", "memory_mb": "200000"}, {},
                             ["--epochs", "90"])
    script = renderer.render()
    assert script.startswith("#!/bin/bash\n")
    assert directives(script) == ["--job-name=trainpod-imagenet-ddp", "--nodes=4", "--ntasks-per-node=1", "--cpus-per-task=32",
                                  "--gpus-per-node=8", "--mem=200000M", "--output=trainpod-imagenet-ddp-%j.out", "--partition=gpu",
                                  "--time=2:00:00"]
    # srun asks for the CPUs again: from SLURM 22.05 to 23.02 it does not inherit sbatch's --cpus-per-task
    assert script.rstrip().endswith("exec srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task=32 trainpod run "
                                    "--example imagenet-ddp -- --epochs 90")
    # sbatch reads #SBATCH lines only before the first command
    first_command = next(i for i, line in enumerate(script.splitlines()) if line and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(script.splitlines()) if line.startswith("#SBATCH"))


def test_a_cpu_job_names_its_processes_and_leaves_memory_to_the_cluster():
    renderer, _ = jobs.build("slurm", "cifar10-ddp", {"nproc_per_node": "2", "cpus": "2"}, {})
    script = renderer.render()
    assert "--cpus-per-task=2" in directives(script) and not any(d.startswith(("--mem", "--gpus")) for d in directives(script))
    assert "trainpod run --example cifar10-ddp --nproc-per-node 2" in script


def test_help_and_bad_values():
    assert here("job", "slurm", "--help").returncode == 0
    assert here("job", "slurm", "cifar10-ddp", "--partition", "two words").returncode == 64
    assert here("job", "slurm", "cifar10-ddp", env={"TRAINPOD_JOB_TIME": "1 day"}).returncode == 78


def test_submit_without_sbatch_is_one_line_78(tmp_path):
    result = trainpod("job", "slurm", "cifar10-ddp", "--submit", env={"PATH": str(tmp_path)})
    assert result.returncode == 78 and "sbatch is not on PATH" in result.stderr and len(result.stderr.splitlines()) == 1


@pytest.mark.slow
def test_submit_pipes_the_script_to_sbatch(tmp_path):
    sbatch = tmp_path / "sbatch"
    sbatch.write_text(f"#!/bin/sh\ncat > {tmp_path}/script\necho 'Submitted batch job 77'\n")
    sbatch.chmod(sbatch.stat().st_mode | stat.S_IEXEC)
    result = trainpod("job", "slurm", "cifar10-ddp", "--submit", env={"PATH": f"{tmp_path}:/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "Submitted batch job 77"
    assert (tmp_path / "script").read_text() == here("job", "slurm", "cifar10-ddp").stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sbatch", "script"]  # trainpod itself wrote nothing

    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Invalid partition name specified' >&2\nexit 1\n")
    refused = trainpod("job", "slurm", "cifar10-ddp", "--submit", env={"PATH": f"{tmp_path}:/usr/bin:/bin"})
    assert refused.returncode == 78 and "Invalid partition name" in refused.stderr


def test_an_sbatch_that_cannot_run_or_reach_slurm_is_one_line(tmp_path):
    sbatch = tmp_path / "sbatch"
    path = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    sbatch.write_bytes(b"\x7fELF\x02\x01\x01 not this machine's program")  # another architecture's, say
    sbatch.chmod(0o755)
    broken = here("job", "slurm", "cifar10-ddp", "--submit", env=path)
    assert broken.returncode == 78 and broken.stderr.startswith(f"trainpod: error: sbatch ({sbatch}) could not be run: ")
    sbatch.write_text("#!/bin/sh\nkill -9 $$\n")
    killed = here("job", "slurm", "cifar10-ddp", "--submit", env=path)
    assert killed.returncode == 69 and "was killed by signal 9: submit again" in killed.stderr
    # What sbatch prints when slurmctld does not answer (compose/slurm, tests/integration/test_compose_slurm.py): try again.
    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Unable to contact slurm controller "
                      "(connect failure)' >&2\nexit 1\n")
    down = here("job", "slurm", "cifar10-ddp", "--submit", env=path)
    assert down.returncode == 69 and "sbatch could not reach SLURM: sbatch: error: Batch job submission failed: Unable" in down.stderr
    assert all(len(result.stderr.splitlines()) == 1 for result in (broken, killed, down))
