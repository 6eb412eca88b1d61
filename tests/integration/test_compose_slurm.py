"""A real SLURM cluster (compose/slurm: slurmctld, node1, node2, munge; Debian's slurm-wlm 22.05 on the
trainpod image): the sbatch script `trainpod job slurm` renders, submitted with --submit from the
controller, trains on 2 nodes x 2 processes; scancel mid-run stops every rank and leaves the
checkpoint loadable."""

import json
import re
import time

import pytest

from fixtures.docker_env import REPO, ComposeJob
from trainpod.examples.reporting import parse_metrics_line

# One worker runs the module (make test: pytest-xdist, --dist loadgroup): the SLURM cluster is a module fixture.
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.xdist_group("compose_slurm")]

COMPOSE = REPO / "compose" / "slurm" / "compose.yaml"
SMALL = ["--synthetic-samples", "1024", "--batch-size", "32"]
LEFTOVERS = re.compile(r"python|trainpod|supervisord|torchrun|pt_elastic|slurmstepd")


@pytest.fixture(scope="module")
def cluster(docker_ready):
    cluster = ComposeJob(COMPOSE)
    try:
        cluster.compose("build", timeout=900)
        cluster.compose("up", "-d", "--wait", timeout=300)
        deadline = time.monotonic() + 60
        while cluster.compose("exec", "-T", "slurmctld", "sinfo", "-h", "-t", "idle", "-o", "%D").stdout.strip() != "2":
            assert time.monotonic() < deadline, cluster.compose("exec", "-T", "slurmctld", "sinfo").stdout
            time.sleep(1)
        yield cluster
    finally:
        cluster.down()


def ctl(cluster, *command, user=None, check=True):
    user_args = ["-u", user] if user else []
    return cluster.compose("exec", "-T", *user_args, "slurmctld", *command, check=check)


def submit(cluster, *args) -> str:
    result = ctl(cluster, "trainpod", "job", "slurm", "cifar10-ddp", "--nodes", "2", "--nproc-per-node", "2", "--cpus", "2",
                 "--submit", "--", *args, user="trainpod")
    match = re.fullmatch(r"Submitted batch job (\d+)", result.stdout.strip())
    assert match, result.stdout + result.stderr
    return match[1]


def state(cluster, job) -> str:
    return re.search(r"JobState=(\w+)", ctl(cluster, "scontrol", "show", "job", job, "-o").stdout)[1]


def wait_for(cluster, job, states, timeout):
    deadline = time.monotonic() + timeout
    while (now := state(cluster, job)) not in states:
        assert time.monotonic() < deadline, f"job {job} still {now}:\n{log(cluster, job)[-3000:]}"
        time.sleep(1)
    return now


def log(cluster, job) -> str:
    return ctl(cluster, "cat", f"/shared/trainpod-cifar10-ddp-{job}.out", check=False).stdout


def leftovers(cluster, node) -> list[str]:
    listing = cluster.compose("exec", "-T", node, "ps", "-eo", "comm,args").stdout.splitlines()[1:]
    return [line for line in listing if LEFTOVERS.search(line.split()[0])]


def test_the_rendered_sbatch_script_trains_on_two_nodes(cluster):
    job = submit(cluster, "--epochs", "1", *SMALL, "--output-dir", "/shared/run1")
    assert wait_for(cluster, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, 300) == "COMPLETED", log(cluster, job)
    output = log(cluster, job)
    assert parse_metrics_line(output)["metrics"] == "/shared/run1/metrics.json"  # the log has the summary
    metrics = json.loads(ctl(cluster, "cat", "/shared/run1/metrics.json").stdout)
    assert (metrics["world_size"], metrics["nnodes"], metrics["backend"]) == (4, 2, "gloo")
    assert len(metrics["rank_checksums"]) == 4 and len(set(metrics["rank_checksums"])) == 1
    for node in (0, 1):  # each node's trainpod found its place in SLURM's variables
        assert re.search(rf"\[node{node}\] trainpod: slurm: node {node} of 2, 2 process\(es\) per node, master node1:\d+", output), output


def test_scancel_stops_every_rank_and_the_checkpoint_stays_loadable(cluster):
    job = submit(cluster, "--epochs", "100", "--synthetic-samples", "8192", "--output-dir", "/shared/run2",
                 "--checkpoint-dir", "/shared/run2/ckpt", "--checkpoint-every", "5")
    deadline = time.monotonic() + 240
    while "ckpt-00000010.json" not in ctl(cluster, "ls", "/shared/run2/ckpt", check=False).stdout:
        assert state(cluster, job) in ("PENDING", "CONFIGURING", "RUNNING"), log(cluster, job)
        assert time.monotonic() < deadline, log(cluster, job)
        time.sleep(1)
    assert leftovers(cluster, "node1") and leftovers(cluster, "node2")  # the ranks are running

    ctl(cluster, "scancel", job)
    assert wait_for(cluster, job, {"CANCELLED"}, 120) == "CANCELLED"
    deadline = time.monotonic() + 90  # KillWait is 60 s: nothing may outlive it
    while any(leftovers(cluster, node) for node in ("node1", "node2")):
        assert time.monotonic() < deadline, {node: leftovers(cluster, node) for node in ("node1", "node2")}
        time.sleep(1)
    output = log(cluster, job)
    assert re.search(r"stopped by SIGTERM at step \d+; checkpoint of step \d+ saved", output), output

    loaded = cluster.compose("exec", "-T", "-u", "trainpod", "node2", "python3", "-c",
                             "from trainpod.train.checkpoint import Checkpointer; step, state = "
                             "Checkpointer('/shared/run2/ckpt').load_latest(); print('step', step)").stdout
    assert int(re.search(r"step (\d+)", loaded)[1]) >= 10


def test_a_step_of_two_tasks_per_node_is_refused_by_every_task_and_the_fix_it_names_runs_one(cluster):
    # One task per GPU, as other launchers want: a bare srun then starts two trainpods per node, each of which
    # would claim its node's rank and the master's port. The fix the refusal names is checked in the same job.
    fixed = "srun --ntasks=$SLURM_NNODES --ntasks-per-node=1 trainpod explain --example cifar10-ddp"
    bare = "srun trainpod run --example cifar10-ddp -- " + " ".join(SMALL)
    submitted = ctl(cluster, "sbatch", "--nodes=2", "--ntasks-per-node=2", "--output=/shared/two-tasks-%j.out",
                    "--wrap", f"{fixed} && {bare}", user="trainpod").stdout
    job = re.fullmatch(r"Submitted batch job (\d+)", submitted.strip())[1]
    assert wait_for(cluster, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, 120) == "FAILED"
    output = ctl(cluster, "cat", f"/shared/two-tasks-{job}.out").stdout
    assert sorted(re.findall(r"^node_rank +(\d) +SLURM_NODEID$", output, re.M)) == ["0", "1"], output  # one per node
    refusal = ("trainpod: error: SLURM_STEP_TASKS_PER_NODE='2(x2)': srun started 2 tasks on a node, each a trainpod that "
               "would start all of the node's ranks; start one per node: `srun --ntasks=$SLURM_NNODES --ntasks-per-node=1")
    assert output.count(refusal) == 4, output  # every task of the bare step, in one line each
    assert not re.search(r"\[node\d+ rank\d+\]", output), output  # no rank started
    assert "ExitCode=78:0" in ctl(cluster, "scontrol", "show", "job", job, "-o").stdout


def test_an_sbatch_that_cannot_reach_the_controller_is_one_line_69_and_one_that_cannot_name_it_78(cluster):
    # Copies of slurm.conf (SLURM_CONF): slurmctld's port closed, then its name unknown. sbatch's own words, in one line.
    closed = "sed 's/^SlurmctldPort=.*/SlurmctldPort=9/' /etc/slurm/slurm.conf > /tmp/closed.conf"
    unknown = "sed 's/^SlurmctldHost=.*/SlurmctldHost=gone/' /etc/slurm/slurm.conf > /tmp/unknown.conf"
    for conf, make, code, words in (("closed", closed, 69, "sbatch could not reach SLURM: sbatch: error: Batch job submission "
                                                           "failed: Unable to contact slurm controller (connect failure)"),
                                    ("unknown", unknown, 78, "sbatch refused the job: sbatch: error: Unable to establish "
                                                             "control machine address")):
        submit_there = f"SLURM_CONF=/tmp/{conf}.conf trainpod job slurm cifar10-ddp --nodes 2 --cpus 2 --submit"
        result = ctl(cluster, "bash", "-c", f"{make} && {submit_there}", user="trainpod", check=False)
        assert (result.returncode, result.stderr) == (code, f"trainpod: error: {words}\n"), result.stdout + result.stderr
