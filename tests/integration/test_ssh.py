"""`trainpod job ssh --submit` against two real sshd hosts (compose/ssh: Debian's openssh-server on the
trainpod image), this machine the launcher: the 2-host job trains to the end with every host's output
prefixed and logged; Ctrl-C mid-run leaves no process on either host; a wrong host name is one line."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from fixtures.docker_env import REPO, ComposeJob
from trainpod.examples.reporting import parse_metrics_line

# One worker runs the module (make test: pytest-xdist, --dist loadgroup): the two hosts are a module fixture.
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.xdist_group("ssh")]

asyncssh = pytest.importorskip("asyncssh")

COMPOSE = REPO / "compose" / "ssh" / "compose.yaml"
LEFTOVERS = re.compile(r"python|trainpod|supervisord|torchrun|pt_elastic")


@pytest.fixture(scope="module")
def hosts(docker_ready, tmp_path_factory):
    keys = tmp_path_factory.mktemp("ssh")
    key = asyncssh.generate_private_key("ssh-ed25519")
    key.write_private_key(str(keys / "key"))
    os.chmod(keys / "key", 0o600)
    cluster = ComposeJob(COMPOSE, env={"SSH_AUTHORIZED_KEY": key.export_public_key().decode().strip()})
    try:
        cluster.compose("build", timeout=900)
        cluster.compose("up", "-d", "--wait", timeout=300)
        known = []
        for service, address in zip(("host1", "host2"), addresses(cluster)):
            deadline = time.monotonic() + 30
            while True:  # the entrypoint makes the host keys when the container starts
                found = cluster.compose("exec", "-T", service, "cat", "/etc/ssh/ssh_host_ed25519_key.pub", check=False)
                if found.returncode == 0:
                    break
                assert time.monotonic() < deadline, found.stderr
                time.sleep(0.5)
            known.append(f"{address} {' '.join(found.stdout.split()[:2])}")
        (keys / "known_hosts").write_text("\n".join(known) + "\n")
        yield cluster, keys
    finally:
        cluster.down()


def addresses(cluster: ComposeJob) -> list[str]:
    """host1's and host2's fixed addresses on the cluster's subnet (compose/ssh)."""
    return [f"{cluster.prefix}.11", f"{cluster.prefix}.12"]


def launcher(cluster, keys, *hosts, args=(), log_dir=None):
    hosts = hosts or tuple(f"trainpod@{h}" for h in addresses(cluster))
    return [sys.executable, "-m", "trainpod", "job", "ssh", "cifar10-ddp", "--hosts", ",".join(hosts), "--no-docker",
            "--nproc-per-node", "2", "--identity", str(keys / "key"), "--known-hosts", str(keys / "known_hosts"),
            "--log-dir", str(log_dir or keys / "logs"), "--submit", "--", *args]


def env():
    return {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINPOD_")}, "PYTHONPATH": str(REPO / "entrypoint")}


def leftovers(cluster, service):
    listing = cluster.compose("exec", "-T", service, "ps", "-eo", "comm,args").stdout.splitlines()[1:]
    return [line for line in listing if LEFTOVERS.search(line.split()[0])]


def test_two_hosts_train_to_the_end(hosts, tmp_path):
    cluster, keys = hosts
    result = subprocess.run(launcher(cluster, keys, args=["--epochs", "1", "--synthetic-samples", "1024", "--output-dir", "/tmp/out"],
                                     log_dir=tmp_path / "logs"), env=env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    metrics = parse_metrics_line(result.stdout)
    assert (metrics["world_size"], metrics["nnodes"], metrics["ranks_agree"]) == (4, 2, True)  # the summary line
    for rank, address in enumerate(addresses(cluster)):  # every line carries its host; each host has its log
        assert re.search(rf"^\[{re.escape(address)}\] \[node{rank}\] trainpod: torchrun: node {rank} of 2", result.stdout, re.M)
        log = (tmp_path / "logs" / f"{address}.log").read_text()
        assert f"[node{rank}] trainpod: torchrun: node {rank} of 2" in log and not log.startswith(f"[{address}]")
    assert "the job finished on every host" in result.stderr


def test_ctrl_c_stops_the_job_on_every_host(hosts, tmp_path):
    cluster, keys = hosts
    output = tmp_path / "launcher.out"
    with open(output, "w") as sink:
        args = ["--epochs", "100", "--synthetic-samples", "4096", "--output-dir", "/tmp/out2"]
        process = subprocess.Popen(launcher(cluster, keys, args=args, log_dir=tmp_path / "logs"), env=env(), stdout=sink,
                                   stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not re.search(r"\[node0 rank0\] epoch \d+/100 step \d+", output.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, output.read_text()[-3000:]
            time.sleep(0.5)
        assert leftovers(cluster, "host1") and leftovers(cluster, "host2")
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=150)
    finally:
        if process.poll() is None:
            process.kill()
    text = output.read_text()
    assert code == 143, text[-3000:]  # the job's own code: stopped by SIGTERM, checkpointed
    assert "stopping the job on every host (SIGINT received)" in text
    deadline = time.monotonic() + 30
    while leftovers(cluster, "host1") or leftovers(cluster, "host2"):
        assert time.monotonic() < deadline, (leftovers(cluster, "host1"), leftovers(cluster, "host2"))
        time.sleep(1)


def test_a_wrong_host_name_is_one_line_and_nothing_starts(hosts, tmp_path):
    cluster, keys = hosts
    hosts = (f"trainpod@{addresses(cluster)[0]}", "trainpod@no-such-host.invalid")
    result = subprocess.run(launcher(cluster, keys, *hosts, log_dir=tmp_path / "logs"),
                            env=env(), capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 64 and len(lines) == 1, result.stderr
    assert lines[0].startswith("trainpod: error: host trainpod@no-such-host.invalid:22: the name does not resolve")
    assert not (tmp_path / "logs").exists() and not leftovers(cluster, "host1")
