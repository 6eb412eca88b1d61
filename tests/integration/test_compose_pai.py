"""The 2-node OpenPAI job of compose/pai-2node, on the real engine."""

import re
import time

import pytest

from fixtures.docker_env import REPO, ComposeJob
from trainpod.examples.reporting import parse_metrics_line

# One worker runs the module (make test: pytest-xdist, --dist loadgroup): its jobs one after another.
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.xdist_group("compose_pai")]

COMPOSE = REPO / "compose" / "pai-2node" / "compose.yaml"


@pytest.fixture
def job(docker_ready):
    job = ComposeJob(COMPOSE)
    yield job
    job.down()


def test_two_nodes_train_to_identical_weights(job):
    job.up()
    codes = job.wait("node0", "node1")
    assert codes == {"node0": 0, "node1": 0}, job.logs("node0")[-3000:] + job.logs("node1")[-3000:]

    metrics = job.metrics()
    assert (metrics["world_size"], metrics["nnodes"], metrics["backend"]) == (4, 2, "gloo")
    assert len(metrics["rank_checksums"]) == 4 and len(set(metrics["rank_checksums"])) == 1
    assert metrics["checksum"] == metrics["rank_checksums"][0]
    first, last = metrics["loss_curve"][0][1], metrics["loss_curve"][-1][1]
    assert last < 0.7 * first, metrics["loss_curve"]

    worker_log = job.logs("node1")
    assert f"pai: node 1 of 2, 2 process(es) per node, master {job.prefix}.11:29877, gloo over eth0" in worker_log
    assert re.search(r"^\[node0 rank0\] epoch 2/2 ", job.logs("node0"), re.M)
    listing = job.compose("run", "--rm", "--no-deps", "-T", "node1", "ls", "/workspace/output/checkpoints").stdout.split()
    assert listing[-2:] == ["ckpt-00000030.json", "ckpt-00000030.pt"], listing  # every 10 steps, on the shared volume


# The other multi-node examples on the same 2-node job, small: the variables are the examples' option twins.
OTHER_EXAMPLES = {
    "cifar10-ddp-amp": {"TRAINPOD_SYNTHETIC_SAMPLES": "1024", "TRAINPOD_BATCH_SIZE": "32"},
    "imagenet-ddp": {"TRAINPOD_ARCH": "resnet18", "TRAINPOD_RESNET_WIDTH": "8", "TRAINPOD_IMAGE_SIZE": "32",
                     "TRAINPOD_SYNTHETIC_SAMPLES": "512", "TRAINPOD_SYNTHETIC_CLASSES": "10",
                     "TRAINPOD_BATCH_SIZE": "8", "TRAINPOD_WORKERS": "1"},
}


@pytest.mark.parametrize("example", list(OTHER_EXAMPLES))
def test_each_multi_node_example_trains_on_two_nodes(example, tmp_path, docker_ready):
    override = tmp_path / "example.yaml"
    variables = "".join(f"      {name}: \"{value}\"\n" for name, value in OTHER_EXAMPLES[example].items())
    override.write_text(f"services:\n  node0:\n    environment:\n{variables}  node1:\n    environment:\n{variables}")
    job = ComposeJob(COMPOSE, env={"TRAINPOD_EXAMPLE": example, "TRAINPOD_EPOCHS": "1"},
                     overrides=(override,))
    try:
        job.up()
        codes = job.wait("node0", "node1")
        assert codes == {"node0": 0, "node1": 0}, job.logs("node0")[-3000:] + job.logs("node1")[-3000:]
        metrics = job.metrics()
        assert (metrics["example"], metrics["world_size"], metrics["nnodes"]) == (example, 4, 2)
        assert len(set(metrics["rank_checksums"])) == 1
        assert metrics["loss_curve"][-1][1] < metrics["loss_curve"][0][1], metrics["loss_curve"]
    finally:
        job.down()


def test_the_data_parallel_example_trains_in_one_container(docker_ready):
    from fixtures.docker_env import IMAGE, run

    result = run("docker", "run", "--rm", "--shm-size", "256m", IMAGE, "trainpod", "run", "--example", "cifar10-dp", "--",
                 "--epochs", "1", "--synthetic-samples", "512", "--output-dir", "/tmp/out", timeout=300)
    metrics = parse_metrics_line(result.stdout)  # the summary line; metrics.json went with the container
    assert (metrics["example"], metrics["world_size"], metrics["ranks_agree"]) == ("cifar10-dp", 1, True)
    said = result.stdout + result.stderr
    assert "hang:" not in said and "restarting" not in said, said[-4000:]  # fresh75: once stalled before its first step


def test_a_worker_whose_master_never_comes_up_exits_69(job):
    job.env["TRAINPOD_CONNECT_TIMEOUT"] = "5"
    job.env["TRAINPOD_MAX_RESTARTS"] = "0"  # one attempt: this test is about the preflight's bound
    started = time.monotonic()
    job.up("node1")
    code = job.exit_code("node1", timeout=120)
    elapsed = time.monotonic() - started
    log = job.logs("node1")
    assert code == 69, log
    assert elapsed < 150, elapsed  # --connect-timeout 5 and one attempt, not the default 300 s
    errors = [line for line in log.splitlines() if line.startswith("[node1] trainpod: error:")]
    assert len(errors) == 1, log
    for part in (f"{job.prefix}.11:29877", "PAI_HOST_IP_worker_0", "PAI_PORT_LIST_worker_0_SyncPort", "within 5s", "interface eth0"):
        assert part in errors[0]
    assert "Traceback" not in log
    assert "the job exited with 69 after 1 attempt(s)" in log
