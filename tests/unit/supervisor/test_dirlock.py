"""trainpod.supervisor.dirlock on real files and threads: one job per directory, the same job shares it, a dead
holder is taken over after its heartbeat stops, a live one refuses the second job (78)."""

import json
import threading
import time

import pytest

from trainpod.contract import LOCK_FILE
from trainpod.errors import ConfigError
from trainpod.supervisor import dirlock

TIMEOUT = 0.8  # seconds: the tests run past it several times


def hold(tmp_path, job, lines=None, timeout=TIMEOUT):
    say = (lines if lines is not None else []).append
    return dirlock.hold([(str(tmp_path), "checkpoint directory {path}")], job, "0", timeout, say)


def lock_of(tmp_path):
    return dirlock.read(str(tmp_path / LOCK_FILE))


def test_the_first_job_holds_the_directory_and_its_lock_names_it(tmp_path):
    held = hold(tmp_path, "team-a")
    holder = lock_of(tmp_path)
    assert isinstance(holder, dirlock.Holder) and holder.job == "team-a" and not holder.ended
    raw = (tmp_path / LOCK_FILE).read_bytes()
    assert len(raw) == dirlock.RECORD_BYTES and json.loads(raw)["job"] == "team-a"
    held.release(ended=True)
    assert lock_of(tmp_path).ended


def test_the_same_job_shares_it_at_once_on_another_node_or_after_a_restart(tmp_path):
    first = hold(tmp_path, "team-a")
    began = time.monotonic()
    again = hold(tmp_path, "team-a")  # another node, or this node's job started again by supervisord
    assert time.monotonic() - began < TIMEOUT / 2
    assert again is not None and first is not None


@pytest.mark.slow
def test_a_second_job_is_refused_while_the_heartbeat_moves_and_the_line_names_the_holder(tmp_path):
    """The issue's case: two jobs with one checkpoint directory both ran and overwrote each other's files."""
    held = hold(tmp_path, "team-a")
    held.start()
    try:
        time.sleep(TIMEOUT * 2)  # past the timeout: the live holder's heartbeat keeps the directory
        began = time.monotonic()
        with pytest.raises(ConfigError) as error:
            hold(tmp_path, "team-b")
        assert time.monotonic() - began < TIMEOUT  # a heartbeat comes every third of it
        assert error.value.exit_code == 78
        line = str(error.value)
        assert "\n" not in line
        assert line.startswith(f"the checkpoint directory {tmp_path} is in use by job 'team-a' (node 0 on ")
        assert lock_of(tmp_path).job == "team-a"
    finally:
        held.release(ended=True)


def test_a_holder_whose_heartbeat_stopped_is_taken_over_after_the_timeout_and_said(tmp_path):
    hold(tmp_path, "team-a")  # held, and never a heartbeat: a job that was killed
    lines = []
    began = time.monotonic()
    taker = hold(tmp_path, "team-b", lines)
    waited = time.monotonic() - began
    assert TIMEOUT <= waited < TIMEOUT + 1.0
    assert lock_of(tmp_path).job == "team-b"
    assert len(lines) == 1 and lines[0].startswith(f"the checkpoint directory {tmp_path} was held by job 'team-a'")
    assert "whose heartbeat stopped" in lines[0] and "this job takes it over" in lines[0]
    assert taker is not None


def test_a_job_that_ended_hands_the_directory_on_at_once(tmp_path):
    hold(tmp_path, "team-a").release(ended=True)
    lines = []
    began = time.monotonic()
    hold(tmp_path, "team-b", lines)
    assert time.monotonic() - began < TIMEOUT / 2
    assert lock_of(tmp_path).job == "team-b" and "which ended" in lines[0]


def test_a_job_about_to_be_restarted_keeps_the_directory(tmp_path):
    held = hold(tmp_path, "team-a")
    held.start()
    held.release(ended=False)  # the agent failed and supervisord starts it again: no "ended" mark
    assert not lock_of(tmp_path).ended


def test_a_heartbeat_very_old_by_this_clock_is_dead_at_once(tmp_path):
    holder = dirlock.Holder(job="team-a", host="gone", pid=1, node="0", beat=3, time=time.time() - 3600)
    (tmp_path / LOCK_FILE).write_bytes(holder.encode())
    began = time.monotonic()
    hold(tmp_path, "team-b", timeout=30)
    assert time.monotonic() - began < 10 and lock_of(tmp_path).job == "team-b"  # at once, not after the 30 s


def test_a_holder_that_comes_back_after_a_take_over_finds_it_lost(tmp_path):
    stalled = hold(tmp_path, "team-a")  # stopped (SIGSTOP, a hung volume) for longer than the timeout
    hold(tmp_path, "team-b")
    stalled.beat_once()
    assert stalled.lost and "taken over by job 'team-b'" in stalled.lost
    assert lock_of(tmp_path).job == "team-b"  # its heartbeat did not overwrite the new holder's


def test_two_jobs_starting_at_once_on_an_empty_directory_one_holds_it(tmp_path):
    results = {}

    def start(job):
        try:
            held = hold(tmp_path, job)
            held.start()
            results[job] = held
        except ConfigError as error:
            results[job] = error

    threads = [threading.Thread(target=start, args=(job,)) for job in ("team-a", "team-b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    held = [r for r in results.values() if isinstance(r, dirlock.Hold)]
    refused = [r for r in results.values() if isinstance(r, ConfigError)]
    assert len(held) == 1 and len(refused) == 1, results
    assert lock_of(tmp_path).job == held[0].holder.job
    held[0].release(ended=True)


def test_the_output_and_checkpoint_directory_are_each_held_and_one_spelling_is_one_lock(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "out" / "ckpt"
    held = dirlock.hold([(str(out), "output directory {path}"), (f"{out}/../out", "output directory {path}"),
                         (str(ckpt), "checkpoint directory {path}"), (None, "unknown")], "team-a", "0", TIMEOUT, print)
    assert [p for p, _ in held.directories] == [str(out), str(ckpt)]
    assert lock_of(out).job == lock_of(ckpt).job == "team-a"


def test_the_lock_is_off_with_a_zero_timeout(tmp_path):
    assert hold(tmp_path, "team-a", timeout=0) is None
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_c10d_job_without_an_id_is_keyed_by_its_store():
    assert dirlock.job_key("team/a", "etcd-v3", "etcd", 2379, "trainpod") == "team/a"
    assert dirlock.job_key("mine", "c10d", "10.0.0.1", 29500, "trainpod") == "mine"
    assert dirlock.job_key("trainpod", "c10d", "10.0.0.1", 29500, "trainpod") == "c10d@10.0.0.1:29500"
    import socket

    assert dirlock.job_key("trainpod", "c10d", "127.0.0.1", 29500, "trainpod") == f"c10d@127.0.0.1:29500@{socket.gethostname()}"
