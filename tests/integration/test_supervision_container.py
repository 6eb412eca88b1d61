"""Supervision inside the image: tini -> trainpod -> supervisord -> the job, with real exit codes."""

import time

import pytest
from testcontainers.core.container import DockerContainer

from fixtures.docker_env import IMAGE

pytestmark = [pytest.mark.docker]


def logs(container) -> str:
    return "".join(part.decode() for part in container.get_logs())


def run_to_exit(command: str) -> tuple[int, str]:
    """The container's exit code and its output."""
    with DockerContainer(IMAGE).with_command(command) as container:
        status = container.get_wrapped_container().wait(timeout=120)["StatusCode"]
        return status, logs(container)


def test_the_container_exits_with_the_jobs_code_after_its_restarts(docker_ready):
    # Another code on each attempt: never the same failure twice, so the budget runs out.
    status, output = run_to_exit("trainpod run --max-restarts 2 --restart-backoff 0.1 -- "
                                 "sh -c 'echo attempt; exit $((3 + TORCHELASTIC_RESTART_COUNT))'")
    assert status == 5, output
    assert output.count("attempt\n") == 3
    assert "rank 0 exited with 5 after 3 attempt(s), 2 restart(s) without progress (--max-restarts 2): giving up" in output


def test_the_same_failure_twice_ends_the_container_after_two_attempts(docker_ready):
    status, output = run_to_exit("trainpod run --max-restarts 5 -- sh -c 'echo attempt; exit 3'")
    assert status == 3, output
    assert output.count("attempt\n") == 2
    assert "the same failure twice without progress (no step reported): not restarting (exit code 3)" in output


def test_a_configuration_error_exits_78_with_one_attempt(docker_ready):
    status, output = run_to_exit("trainpod run -- sh -c 'echo attempt; exit 78'")
    assert status == 78, output
    assert output.count("attempt\n") == 1


def test_docker_stop_ends_the_job_with_143(docker_ready):
    with DockerContainer(IMAGE).with_command("trainpod run -- sh -c 'echo up; exec sleep 300'") as container:
        wrapped = container.get_wrapped_container()
        deadline = time.monotonic() + 60
        while "up\n" not in logs(container):
            assert time.monotonic() < deadline, logs(container)
            time.sleep(0.5)
        started = time.monotonic()
        wrapped.stop(timeout=60)
        stopped_in = time.monotonic() - started
        status = wrapped.wait(timeout=30)["StatusCode"]
        output = logs(container)
    assert status == 143, output
    assert "received SIGTERM" in output
    assert stopped_in < 50, f"took {stopped_in:.0f}s: the SIGTERM did not reach the job"
