"""The node's fork server as a copy of the job's process (trainpod.agent.zygote): the ranks are its children, with
the agent's environment and thread count as a new server's would be, and a copy that is not wanted does not stay.
How a warm rank runs its script is tested against both kinds of server in test_warm.py."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fixtures.processes import alive, gone_within
from trainpod.agent import zygote

ENTRYPOINT = str(Path(__file__).resolve().parents[3] / "entrypoint")
ENV = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
ENV["PYTHONPATH"] = ENTRYPOINT

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork, /proc and PR_SET_PDEATHSIG are Linux's")

# As the job's process does: torch imported (with no OMP_NUM_THREADS: OpenMP takes every core) on the main thread,
# the copy forked once the checks' thread ended,
# then the launch plan's variables set and the server started for the agent. The rank says who its parent is,
# what it sees of the variables set after the fork, and torch's thread count.
DRIVER = textwrap.dedent("""
    import multiprocessing, os, sys, threading
    import torch
    from trainpod.agent import warm, zygote
    checks = threading.Thread(target=lambda: None)  # the job's preflight thread, joined
    checks.start()
    checks.join()
    copy = zygote.fork(joined=[checks])
    os.environ.update(OMP_NUM_THREADS="1", TP_TEST_LATE="set after the fork")
    warm.start_server([warm.PRELOAD[0], "json"])
    rank = multiprocessing.get_context(warm.START_METHOD).Process(target=warm.run_rank, args=("script", sys.argv[1]))
    rank.start()
    rank.join()
    print("copy", copy.pid, "agent", os.getpid(), "exit", rank.exitcode, flush=True)
""")
RANK = textwrap.dedent("""
    import os, torch
    torch.mm(torch.ones(64, 512), torch.ones(512, 256))  # MKL's allocator (trainpod.supervisor.job): not held
    parent = os.getppid()
    print("rank", parent, open(f"/proc/{parent}/comm").read().strip(), os.environ.get("TP_TEST_LATE"),
          torch.get_num_threads(), flush=True)
""")


@pytest.mark.slow
def test_the_ranks_are_children_of_the_copy_with_the_agents_variables_and_threads(tmp_path):
    (tmp_path / "rank.py").write_text(RANK)
    result = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path / "rank.py")], env=ENV, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rank, end = result.stdout.splitlines()
    _, copy, _, agent, _, code = end.split()
    assert code == "0"
    # forked from the copy (its comm: fork-server), not from a new interpreter; the variables are the agent's at the
    # server's start, and the threads OMP_NUM_THREADS's, though OpenMP read the job's environment when torch loaded
    assert rank.split() == ["rank", copy, zygote.NAME, "set", "after", "the", "fork", "1"], result.stdout


@pytest.mark.slow
def test_where_the_copy_died_before_it_serves_multiprocessing_starts_its_own_server(tmp_path):
    # The failpoint kills the copy as the OOM killer could: the ranks then come from a new interpreter, as they did
    (tmp_path / "rank.py").write_text(RANK)
    result = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path / "rank.py")], capture_output=True, text=True,
                            env={**ENV, "TRAINPOD_FAILPOINTS": "server-copy@0"}, timeout=120)
    assert result.returncode == 0, result.stderr
    rank, end = result.stdout.splitlines()
    copy, parent, name = end.split()[1], rank.split()[1], rank.split()[2]
    assert parent != copy and name != zygote.NAME and rank.split()[-1] == "1", result.stdout
    assert "Traceback" not in result.stderr, result.stderr


COPY_ONLY = textwrap.dedent("""
    import sys, time
    from trainpod.agent import zygote
    copy = zygote.fork()
    print(copy.pid, flush=True)
    if sys.argv[1] == "discard":
        zygote.discard()
        print("discarded", flush=True)
    time.sleep(300)
""")


@pytest.mark.parametrize("end", ["discard", "SIGKILL of the job's process"])
def test_a_copy_no_one_asks_for_exits_when_discarded_or_when_the_jobs_process_dies(end):
    job = subprocess.Popen([sys.executable, "-c", COPY_ONLY, end.split()[0]], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        copy = int(job.stdout.readline())
        if end == "discard":
            assert job.stdout.readline() == "discarded\n"  # reaped by then: discard() waits for it
            assert not alive(copy)
        else:
            assert alive(copy)
            job.kill()
            assert gone_within(copy, 10), "the copy outlived the job's process"
    finally:
        job.kill()
        job.wait()


def test_a_joined_thread_has_ended_once_the_kernel_lists_it_no_more():
    thread = threading.Thread(target=time.sleep, args=(0.2,))
    thread.start()
    assert not zygote.ended(thread, timeout=0)  # running: its task is listed
    thread.join()
    assert zygote.ended(thread) and not os.path.exists(f"/proc/self/task/{thread.native_id}")


def test_no_copy_is_made_while_another_python_thread_runs():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="tp-test-thread")
    thread.start()
    try:
        assert "tp-test-thread" in (zygote.why_not() or "")
        assert zygote.fork() is None  # then multiprocessing starts its own server
    finally:
        stop.set()
        thread.join()


def test_this_pythons_forkserver_is_the_one_the_copy_speaks_to():
    # The images' Python (3.11): where this fails, warm starts still work, through a new interpreter each node start.
    # In a process of its own, as the job's: this one runs the threads other tests left.
    check = "from trainpod.agent import zygote; print(zygote.why_not())"
    result = subprocess.run([sys.executable, "-c", check], env=ENV, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "None", result.stdout + result.stderr


def test_a_job_started_by_the_launcher_has_room_for_its_ranks_titles():
    from trainpod.contract import JOB_TITLE_ROOM, job_command

    probe = ("from trainpod import proctitle; room = proctitle.room(); proctitle.set_command_line(['python', '-m', 'x']); "
             "print(room, open('/proc/self/cmdline', 'rb').read().rstrip(b'\\0'))")
    command = job_command(sys.executable)
    result = subprocess.run([command[0], "-c", probe, *command[3:]], env=ENV, capture_output=True, text=True, timeout=60)
    room, title = result.stdout.split(" ", 1)
    assert int(room) > JOB_TITLE_ROOM and title.strip() == repr(b"python\0-m\0x"), result.stderr


@pytest.mark.slow
def test_a_signal_to_the_jobs_group_does_not_reach_a_serving_copy(tmp_path):
    # The copy leaves the job's session once it serves (trainpod.agent.warm_server), as multiprocessing's server does
    (tmp_path / "rank.py").write_text("import time\ntime.sleep(300)\n")
    driver = DRIVER.replace("rank.join()", "print('rank', rank.pid, flush=True); rank.join()")
    job = subprocess.Popen([sys.executable, "-c", driver, str(tmp_path / "rank.py")], env=ENV, stdout=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        rank = int(job.stdout.readline().split()[1])
        copy = int(Path(f"/proc/{rank}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert os.getsid(copy) != job.pid
        os.kill(copy, signal.SIGTERM)  # ignored, as a job's stop signals are by the server
        time.sleep(0.3)
        assert alive(copy) and alive(rank)
    finally:
        job.kill()
        job.wait()
    assert gone_within(rank, 10), "the rank outlived its agent"
