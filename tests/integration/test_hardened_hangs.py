"""The hang watch in the hardened container the README shows: read-only root, a tmpfs /tmp, no
capability at all, no-new-privileges, Docker's default seccomp profile. py-spy, the agent's child,
reads its sibling ranks' stacks with ptrace rights of the same uid, which need no capability."""

import re
import time

import pytest
from testcontainers.core.container import DockerContainer

from fixtures.docker_env import IMAGE, REPO, find_rank

pytestmark = [pytest.mark.docker, pytest.mark.slow]

SCRIPTS = str(REPO / "tests" / "integration" / "hangs")
# docker run --read-only --tmpfs /tmp --cap-drop ALL --security-opt no-new-privileges
HARDENED = {"read_only": True, "cap_drop": ["ALL"], "security_opt": ["no-new-privileges"]}
SHOW = ("cat /tmp/out/hangs/*/rank*.txt; grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status")


def hardened(command: str) -> DockerContainer:
    return (DockerContainer(IMAGE).with_kwargs(**HARDENED).with_tmpfs_mount("/tmp").with_env("TRAINPOD_OUTPUT_DIR", "/tmp/out")
            .with_volume_mapping(SCRIPTS, "/hangs", "ro").with_command(["sh", "-c", f"{command}; code=$?; {SHOW}; exit $code"]))


def logs(container) -> str:
    return "".join(part.decode() for part in container.get_logs())


def assert_hardened(output: str) -> None:
    for line in ("CapEff:\t0000000000000000", "CapBnd:\t0000000000000000", "NoNewPrivs:\t1", "Seccomp:\t2"):
        assert line in output, output[-2000:]


def test_a_rank_asleep_before_init_is_named_with_its_stack_in_a_hardened_container(docker_ready):
    command = "trainpod run --nproc-per-node 2 --hang-timeout 10 --max-restarts 0 -- python3 /hangs/hang_job.py sleep-before-init"
    with hardened(command) as container:
        status = container.get_wrapped_container().wait(timeout=180)["StatusCode"]
        output = logs(container)
    assert status == 124, output[-3000:]
    assert "behind: rank 1 idle (no CPU, same stack) at hangs/hang_job.py:" in output, output[-3000:]
    assert "stack by py-spy" in output and "init_process_group (/opt/trainpod/venv/" in output
    assert_hardened(output)


def test_a_sigstopped_rank_is_named_with_its_stack_in_a_hardened_container(docker_ready):
    command = "trainpod run --nproc-per-node 2 --hang-timeout 10 --max-restarts 0 -- python3 /hangs/hang_job.py run --steps 100000"
    find = find_rank(1)
    with hardened(command) as container:
        deadline = time.monotonic() + 120
        while logs(container).count("runs its steps") < 2:
            assert time.monotonic() < deadline, logs(container)[-3000:]
            time.sleep(0.2)
        pid = container.exec(["sh", "-c", find]).output.decode().split()
        assert len(pid) == 1, pid
        assert container.exec(["kill", "-STOP", pid[0]]).exit_code == 0
        status = container.get_wrapped_container().wait(timeout=120)["StatusCode"]
        output = logs(container)
    assert status == 124, output[-3000:]
    assert re.search(r"behind: rank 1 stopped at hangs/hang_job\.py:\d+ in main, step \d+; rank 0 waits for it in all_reduce",
                     output), output[-3000:]
    assert re.search(r"rank 1 \(local rank 1, node0, pid \d+\): stopped at .*; stack by py-spy", output), output[-3000:]
    assert_hardened(output)
