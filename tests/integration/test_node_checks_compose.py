"""The nodes' checks at the rendezvous on compose/pai-2node, a fixed-size job of two containers, on the real engine.

- The network check (trainpod.agent.netcheck): with node1's sending side shaped to 20 Mbit/s (tc,
  fixtures.docker_env.shape_egress) and --min-bandwidth 0.05, both nodes end with 69 and one line that names node1 and
  its link, before any rank starts; unshaped, the job trains and node 0 says the job's figures in one line.
- Every node the same software (trainpod.agent.consistency): node1 runs a train.py one line different from node0's,
  or a trainpod with one comment more (bind-mounted over the image's package): both nodes end with 78 and one line
  naming the field and both values, before any rank starts.
(The elastic cases, where a named node leaves and the others go on, are in test_compose_elastic_nodes.)"""

import re
import shutil

import pytest

from fixtures.docker_env import IMAGE, REPO, ComposeJob, run, shape_egress

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.xdist_group("node_checks")]

COMPOSE = REPO / "compose" / "pai-2node" / "compose.yaml"
OVERRIDES = (REPO / "tests" / "integration" / "compose" / "pai-2node-faults.yaml",
             REPO / "tests" / "integration" / "compose" / "pai-2node-netcheck.yaml")


@pytest.fixture
def job(docker_ready):
    job = ComposeJob(COMPOSE, env={"TRAINPOD_SYNTHETIC_SAMPLES": "128",
                                   "TRAINPOD_EPOCHS": "1"}, overrides=OVERRIDES)
    yield job
    job.down()


def test_a_node_with_a_slow_link_ends_a_fixed_size_job_with_69_naming_it(job):
    job.compose("up", "-d", "--no-build", "--no-deps", "node1")  # it waits for the master: shaped before it meets anyone
    shaped = shape_egress(job.compose("ps", "-q", "node1").stdout.strip())
    job.up("node0")
    codes = job.wait("node0", "node1", timeout=300)
    logs = {node: job.logs(node) for node in ("node0", "node1")}
    assert codes == {"node0": 69, "node1": 69}, f"{codes}, shaped with {shaped}:\n{logs}"
    for log in logs.values():
        errors = [line for line in log.splitlines() if "trainpod: error:" in line]
        assert len(errors) == 1, log[-3000:]
        assert "the link from node 1 (worker-1) to node 0 (worker-0) carries " in errors[0], errors[0]
        assert "below --min-bandwidth 0.05 Gbit/s" in errors[0] and "node 1 (worker-1) is named" in errors[0], errors[0]
        assert "a fixed-size job cannot go on without it (--netcheck" in errors[0], errors[0]
        assert "rank0]" not in log and "rank1]" not in log  # no rank started
    print(f"\nshaped with {shaped}: {errors[0]}")


def test_an_unshaped_job_trains_and_node0_says_the_networks_figures_once(job):
    job.up("node0", "node1")
    assert job.wait("node0", "node1", timeout=300) == {"node0": 0, "node1": 0}, job.logs("node0")[-3000:]
    lines = [line for line in job.logs("node0").splitlines() if "trainpod: network: " in line]
    assert len(lines) == 1 and "network: 2 nodes over eth0, links " in lines[0], lines
    assert "every link above --min-bandwidth 0.05 Gbit/s" in lines[0], lines
    assert "trainpod: network: " not in job.logs("node1")
    print(f"\n{lines[0]}")


SCRIPT = """\
import os
from pathlib import Path

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
Path("/workspace/output", f"trained-rank{dist.get_rank()}").write_text("trained")
dist.destroy_process_group()
"""


def refused_before_any_rank(job: ComposeJob, field: str) -> str:
    """Both nodes end with 78 and one error line naming `field`, and no rank trained; node1's line."""
    codes = job.wait("node0", "node1", timeout=300)
    logs = {node: job.logs(node) for node in ("node0", "node1")}
    assert codes == {"node0": 78, "node1": 78}, logs
    for log in logs.values():
        errors = [line for line in log.splitlines() if "trainpod: error:" in line]
        assert len(errors) == 1, log[-3000:]
        assert re.search(rf"runs? other software than the rest: {field} ", errors[0]) or f": {field} " in errors[0], errors[0]
        assert "give every node the same software, or pass --consistency warn" in errors[0], errors[0]
    listing = job.compose("run", "--rm", "--no-deps", "-T", "--entrypoint", "ls", "node1", "/workspace/output").stdout
    assert "trained-rank" not in listing, listing
    return errors[0]


def test_a_node_with_another_script_ends_the_job_with_78_naming_it(job, tmp_path):
    for rank, script in enumerate((SCRIPT, SCRIPT + "# node 1's copy has one line more\n")):
        home = tmp_path / f"scripts{rank}"
        home.mkdir()
        (home / "train.py").write_text(script)
        home.chmod(0o755)
        (home / "train.py").chmod(0o644)
        job.env[f"SCRIPTS_DIR{rank}"] = str(home)
    job.overrides = (*job.overrides, REPO / "tests" / "integration" / "compose" / "pai-2node-two-scripts.yaml")
    job.up("node0", "node1")
    line = refused_before_any_rank(job, "script")
    print(f"\n{line}")


def test_a_node_with_another_trainpod_ends_the_job_with_78_naming_it(job, tmp_path):
    where = run("docker", "run", "--rm", IMAGE, "python", "-c", "import os, trainpod; print(os.path.dirname(trainpod.__file__))")
    # Under tmp_path, not a directory removed at the test's end: the fixture's `compose down` reads the override.
    package = tmp_path / "patched" / "trainpod"
    shutil.copytree(REPO / "entrypoint" / "trainpod", package, ignore=shutil.ignore_patterns("__pycache__"))
    with open(package / "log.py", "a") as f:
        f.write("# patched on one node\n")
    for path in (tmp_path, package.parent, *package.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)  # the image's user reads it
    override = tmp_path / "override.yaml"
    override.write_text(f"services:\n  node1:\n    volumes:\n      - {package}:{where.stdout.strip()}:ro\n")
    job.overrides = (*job.overrides, override)
    job.up("node0", "node1")
    line = refused_before_any_rank(job, "trainpod")
    print(f"\n{line}")
