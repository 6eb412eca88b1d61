"""trainpod.train.preemption with real signals: the handler, the agreed stop over gloo, the grace watchdog."""

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainpod.errors import EXIT_CONFIG, ConfigError
from trainpod.train.preemption import DEFAULT_GRACE_S, EXIT_CODE, GRACE_VAR, Preemption, ignore_sigterm, term_grace

ENTRYPOINT = str(Path(__file__).resolve().parents[3] / "entrypoint")

# A rank of a toy training loop: a collective per step, then should_stop() at the same point.
# argv: rank, world, store file, grace, what to do once stopped ("exit" or "hang"), or "error@N": from step N
# on, rank 1 asks every rank to stop with 73 (a checkpoint that cannot be saved).
RANK_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from trainpod.train.preemption import EXIT_CODE, Preemption

    rank, world, store, grace, then = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5]
    error_at = int(then.split("@")[1]) if then.startswith("error@") else 0
    os.environ["RANK"] = str(rank)
    if world > 1:  # a world of one skips torch: importing it takes seconds
        import torch, torch.distributed as dist
        from trainpod.train import distributed
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    with Preemption(grace=grace) as preemption:
        for step in range(1, 3001):
            if world > 1:
                dist.all_reduce(torch.ones(4))
            time.sleep(0.005)
            if step == 3:
                print("ready", flush=True)
            if preemption.should_stop(error=73 if error_at and rank == 1 and step >= error_at else 0):
                print(f"stopped at step {step} error {preemption.error}", flush=True)
                if preemption.error:
                    distributed.shutdown()
                    sys.exit(preemption.error)
                if then == "hang":
                    time.sleep(60)  # a save that never ends: the watchdog must end the process
                if world > 1:
                    distributed.shutdown()
                sys.exit(EXIT_CODE)
    print("never stopped", flush=True)
    """
)


def start_ranks(tmp_path: Path, world: int, grace: float, then: str = "exit") -> list[subprocess.Popen]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPOD_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = ENTRYPOINT
    return [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(world), str(tmp_path / "store"), str(grace), then],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        for rank in range(world)
    ]


def finish(processes: list[subprocess.Popen], timeout: float = 30) -> list[tuple[int, str, str]]:
    try:
        outputs = [p.communicate(timeout=timeout) for p in processes]
        return [(p.returncode, *output) for p, output in zip(processes, outputs)]
    finally:
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def wait_ready(process: subprocess.Popen) -> None:
    line = process.stdout.readline()
    assert line == "ready\n", (line, process.stderr.read() if process.poll() is not None else "")


# --- TRAINPOD_TERM_GRACE ---


@pytest.mark.parametrize("value,expected", [(None, DEFAULT_GRACE_S), ("", DEFAULT_GRACE_S), ("2.5", 2.5), (" 40 ", 40.0)])
def test_grace_reads_the_variable(value, expected):
    assert term_grace({} if value is None else {GRACE_VAR: value}) == expected


@pytest.mark.parametrize("value", ["abc", "0", "-3", "nan", "inf", "25s"])
def test_a_bad_grace_is_one_line_naming_the_variable(value):
    with pytest.raises(ConfigError) as info:
        term_grace({GRACE_VAR: value})
    message = str(info.value)
    assert message.startswith(f"{GRACE_VAR}={value!r}: ") and "\n" not in message
    assert info.value.exit_code == EXIT_CONFIG


def test_a_bad_grace_installs_no_handler():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ConfigError):
        Preemption(env={GRACE_VAR: "soon"})
    assert signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(ValueError):
        Preemption(grace=0)


# --- in this process: the handler ---


def test_sigterm_is_recorded_and_the_previous_handler_restored(capfd):
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda *_: calls.append(1))
    try:
        with Preemption(grace=60) as preemption:
            assert not preemption.requested and not preemption.should_stop()
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 5
            while not preemption.requested and time.monotonic() < deadline:
                time.sleep(0.01)
            assert preemption.requested and preemption.requested_at <= time.monotonic()
            assert preemption.should_stop() and preemption.should_stop()  # no process group: this process's request
            time.sleep(0.1)  # the watchdog logs the receipt
        os.kill(os.getpid(), signal.SIGTERM)  # closed: back to the handler before, and no os._exit later
        time.sleep(0.05)
        assert calls == [1]
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capfd.readouterr().err.splitlines()
    assert err == [f"trainpod: rank {os.environ.get('RANK', '0')} received SIGTERM: stopping after this step (grace 60s, {GRACE_VAR})"]


def test_ignore_sigterm_is_a_worker_init_fn():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        ignore_sigterm(0)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- real processes, real gloo ---


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")  # found, not imported: seconds
def test_a_sigterm_to_one_rank_stops_both_at_the_same_step(tmp_path):
    ranks = start_ranks(tmp_path, world=2, grace=20)
    for rank in ranks:
        wait_ready(rank)
    ranks[1].send_signal(signal.SIGTERM)  # rank 0 gets none: as on a node whose agent was not told
    (code0, out0, err0), (code1, out1, err1) = finish(ranks)
    assert (code0, code1) == (EXIT_CODE, EXIT_CODE), err0 + err1
    stopped = [line for line in (out0 + out1).splitlines() if line.startswith("stopped at step")]
    assert len(stopped) == 2 and stopped[0] == stopped[1], out0 + out1
    assert f"trainpod: rank 1 received SIGTERM: stopping after this step (grace 20s, {GRACE_VAR})" in err1.splitlines()
    assert f"trainpod: rank 0 stops with the others: another rank received SIGTERM (grace 20s, {GRACE_VAR})" in err0.splitlines()
    assert "did not stop within" not in err0 + err1


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_an_error_of_one_rank_stops_every_rank_after_the_same_step_with_its_code(tmp_path):
    ranks = start_ranks(tmp_path, world=2, grace=20, then="error@5")
    (code0, out0, err0), (code1, out1, err1) = finish(ranks)
    assert (code0, code1) == (73, 73), err0 + err1
    assert out0.splitlines()[-1] == out1.splitlines()[-1] == "stopped at step 5 error 73", out0 + out1
    assert "SIGTERM" not in err0 + err1  # not a pre-emption: no grace message, no watchdog


def test_the_watchdog_exits_143_with_one_line_when_the_grace_runs_out(tmp_path):
    (rank,) = start_ranks(tmp_path, world=1, grace=0.5, then="hang")
    wait_ready(rank)
    signalled = time.monotonic()
    rank.send_signal(signal.SIGTERM)
    ((code, out, err),) = finish([rank])
    elapsed = time.monotonic() - signalled
    assert code == EXIT_CODE, err
    assert 0.5 <= elapsed < 60, elapsed  # the grace ran out: not before it, and not a hang without end
    assert "stopped at step" in out
    lines = [line for line in err.splitlines() if "grace" in line and "did not stop" in line]
    assert lines == [
        f"trainpod: rank 0 did not stop within the 0.5s grace after SIGTERM ({GRACE_VAR}): exiting 143 now; "
        "a checkpoint not yet committed is lost, the previous one stays"
    ], err
