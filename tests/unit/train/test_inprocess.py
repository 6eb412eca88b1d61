"""trainpod.train.inprocess: the rank's side of in-process recovery (the whole path runs in
tests/integration/test_inprocess_recovery.py)."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fixtures import stuck_stacks  # noqa: E402
from fixtures.ports import free_port  # noqa: E402
from trainpod.contract import HANGS_DIR, INPROCESS_GENERATION_VAR, OUTPUT_DIR_VAR  # noqa: E402
from trainpod.train import inprocess  # noqa: E402


def rank_env(port: int, world: int = 1, **extra: str) -> dict[str, str]:
    """The environment of a warm rank under a keeper, whose workers' store listens at `port` (set RANK per rank)."""
    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3] / "entrypoint"), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": str(world), "TORCHELASTIC_USE_AGENT_STORE": "True",
            INPROCESS_GENERATION_VAR: "0", **extra}


def test_without_a_keeper_nothing_is_recovered(monkeypatch):
    monkeypatch.delenv(INPROCESS_GENERATION_VAR, raising=False)
    assert not inprocess.enabled() and inprocess.generation() == 0
    error = RuntimeError("Connection closed by peer")
    with pytest.raises(RuntimeError) as raised:
        inprocess.recover(error)
    assert raised.value is error  # the script's own error, untouched: the agent restarts the group
    monkeypatch.setenv(INPROCESS_GENERATION_VAR, "2")
    assert inprocess.enabled() and inprocess.generation() == 2


def test_the_gist_of_a_gloo_error_is_its_first_sentence_without_the_source_location():
    error = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                         "[10.0.0.2]:4711: Connection reset by peer. This is typically caused by a remote worker\nmore")
    assert inprocess.gist(error) == "Read error [10.0.0.2]:4711: Connection reset by peer"
    assert inprocess.gist(RuntimeError("")) == "RuntimeError"


def test_the_host_copy_is_a_copy_and_what_it_restores_is_another():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    copy = inprocess.HostCopy()
    copy.keep(5, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "loss_curve": [[5, 1.0]]})
    kept = copy.state["model"]["weight"].clone()
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on: the copy does not follow
    assert torch.equal(copy.state["model"]["weight"], kept)

    restored = copy.restore()
    optimizer.load_state_dict(restored["optimizer"])  # keeps the tensors it is given (same device and dtype)
    optimizer.state[model.weight]["momentum_buffer"].add_(1.0)  # as the next step does, in place
    assert not torch.equal(copy.state["optimizer"]["state"][0]["momentum_buffer"],
                           optimizer.state[model.weight]["momentum_buffer"])  # the copy is untouched
    assert copy.step == 5 and restored["loss_curve"] == [[5, 1.0]]
    assert restored["loss_curve"] is not copy.state["loss_curve"]


def test_the_group_s_connections_are_kept_and_shut_down_so_that_both_ends_see_it_at_once(monkeypatch):
    server = socket.create_server(("127.0.0.1", 0))
    store = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setenv("MASTER_PORT", str(store.getsockname()[1]))
    earlier = socket.create_connection(server.getsockname())  # not the group's: made before it
    with inprocess._recording():
        link = socket.create_connection(server.getsockname())  # a peer of the group
        to_store = socket.create_connection(store.getsockname())  # the store's
        listener = socket.create_server(("127.0.0.1", 0))
        local_a, local_b = socket.socketpair()
    kept = [fd for fd, _ in inprocess._links]
    assert kept == [link.fileno()], (kept, link.fileno(), to_store.fileno(), listener.fileno(), local_a.fileno())

    ends = dict((address, end) for end, address in (server.accept(), server.accept()))
    peer = ends[link.getsockname()]  # the server's end of `link`
    received: list = []
    waiting = threading.Thread(target=lambda: received.append(link.recv(1)))  # as a gloo thread waits on a peer
    waiting.start()
    inprocess._disconnect()
    waiting.join(timeout=5)
    assert received == [b""] and not waiting.is_alive()  # this rank's own waits end
    peer.settimeout(5)
    assert peer.recv(1) == b""  # and the peer's: it fails its collective now, not at the group's timeout
    assert inprocess._links == []
    link.close()  # the descriptor itself stays this process's to close
    for each in (earlier, to_store, listener, local_a, local_b, *ends.values(), server, store):
        each.close()


def test_a_connection_closed_and_its_number_reused_is_left_alone(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "1")
    server = socket.create_server(("127.0.0.1", 0))
    with inprocess._recording():
        link = socket.create_connection(server.getsockname())
    number = link.fileno()
    link.close()
    other = socket.create_connection(server.getsockname())  # likely the same number, another socket
    inprocess._disconnect()
    peer, _ = server.accept()
    peer2, _ = server.accept()
    other.sendall(b"x")
    peer2.settimeout(5)
    assert peer2.recv(1) == b"x", number  # still connected
    for each in (other, peer, peer2, server):
        each.close()


RECOVER = textwrap.dedent("""
    import gc, os, sys, threading, weakref
    from datetime import timedelta
    import torch, torch.distributed as dist
    from trainpod.train import distributed, inprocess

    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))  # the keeper's store (trainpod.agent.keeper)
    inprocess.init_process_group("gloo")
    gone = weakref.ref(dist.group.WORLD)


    def session():  # a failed step, as the harness's train() ends it
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        try:
            model(torch.ones(1, 2)).sum().backward()
            raise RuntimeError("Connection closed by peer")  # as a collective with a dead peer fails
        finally:
            if sys.argv[1] == "destroyed":
                distributed.shutdown(barrier=False)  # the group is no longer torch's when recover() runs


    try:
        session()
    except RuntimeError as error:
        failed = error
    if sys.argv[2] == "before":  # what the dead rank's keeper does, before this rank's collective fails
        inprocess.counted(store, int(store.add(inprocess.GENERATION_KEY, 1)))
    else:  # once recover() waits for it: the rank's watch sees the count and wakes it (not its bound: the test's timeout)
        class CountedOnceWaitedFor(threading.Condition):
            def wait_for(self, predicate, timeout=None):
                threading.Thread(target=lambda: inprocess.counted(store, int(store.add(inprocess.GENERATION_KEY, 1)))).start()
                return super().wait_for(predicate, timeout)

        inprocess.RECOVERY_WAIT_S, inprocess._counted = 600, CountedOnceWaitedFor()
    assert inprocess.recover(failed) == 1
    gc.collect()
    assert gone() is not None and gone() in inprocess._broken and dist.group.WORLD is not gone()
    total = torch.ones(2)
    dist.all_reduce(total)  # the new generation's group works
    # and its collectives wait as long as generation 0's, not the 60 s its forming may take (issue 29)
    timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    print("generation", inprocess.generation(), total.tolist(), "timeout", timeout, flush=True)
    os._exit(0)  # as a keeper's rank ends (trainpod.agent.keeper): the store's host is this process
""")


@pytest.mark.slow
@pytest.mark.parametrize("group, count", [("destroyed", "before"), ("kept", "before"), ("kept", "after")])
def test_recover_joins_the_next_generation_and_keeps_the_broken_group_unfreed(tmp_path, group, count):
    # Freeing a gloo group joins its threads; one with tensors left to free needs the GIL that the
    # freeing thread holds. The group is kept instead, its connections shut down (_disconnect): also
    # when the script destroyed it before recover() (the harness does, in train()'s `finally`), and
    # only the failed step's objects, which recover() frees, still held it. A keeper's count that comes after
    # the failure (a dead peer's connection told this rank first) is waited for.
    done = subprocess.run([sys.executable, "-c", RECOVER, group, count], env=rank_env(free_port()), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generation 1 [1.0, 1.0] timeout 0:30:00" in done.stdout  # torch's default for gloo, as env:// gave gen 0


WATCHED = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    from trainpod.train import inprocess

    inprocess.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 0:
        time.sleep(60)  # alive, connected, and never receiving: as a peer that waits elsewhere
    else:
        sending = dist.isend(torch.ones(1 << 20), 0)
        print("sending", flush=True)
        try:
            sending.wait()
        except RuntimeError as error:
            print("failed:", inprocess.gist(error), flush=True)
""")


@pytest.mark.slow
def test_a_rank_blocked_on_a_live_peer_leaves_its_group_once_a_keeper_counts_the_next_generation(store):
    # What the compose fault test caught under load: a rank waited in a collective on a peer that never
    # answered, and no failure reached it. Its watch shuts its connections down when a generation is counted.
    store, port = store
    env = rank_env(port, world=2)
    ranks = [subprocess.Popen([sys.executable, "-c", WATCHED], env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for rank in (0, 1)]
    try:
        assert ranks[1].stdout.readline() == "sending\n"
        with pytest.raises(subprocess.TimeoutExpired):
            ranks[1].wait(timeout=2)  # blocked: nothing has failed
        inprocess.counted(store, 1)  # what the keeper of a killed rank does
        out, _ = ranks[1].communicate(timeout=20)
        assert out.startswith("failed: "), out
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()



# The rank says "formed" only once its main thread is where it stays: the watch takes the main thread's place when the
# group is given up, and follows it when it moves (test_a_rank_whose_receive_was_cut_mid_message...); said at once, the
# STUCK_S count would start over as the main thread went on into the wait, and the test's bounds were set without
# that. (Before the watch followed a moving main thread, such a rank was never ended.) Where it stays: the same
# instruction within stay() twice, 0.05 s apart, while this thread held no GIL (a main thread waiting for the GIL
# would have taken it and moved).
STUCK = textwrap.dedent("""
    import hashlib, sys, threading, time
    import torch
    from trainpod.train import inprocess

    def stay(main):
        if main == "idle":  # blocked in a C++ wait that nothing ends, as a collective the shut-down connections did not
            torch.futures.Future().wait()
        else:  # one long call that computes (the GIL released), as a long backward pass
            hashlib.pbkdf2_hmac("sha256", b"p", b"s", int(sys.argv[2]))

    def say_formed_once_there(main_thread):
        seen = None
        while True:
            frame = sys._current_frames().get(main_thread.ident)
            where = (id(frame), frame.f_lasti) if frame is not None else None
            callers = set()
            while frame is not None:
                callers.add(frame.f_code.co_name)
                frame = frame.f_back
            if "stay" in callers and where == seen:
                print("formed", flush=True)
                return
            seen = where
            time.sleep(0.05)

    inprocess.STUCK_S = 1.0
    inprocess.init_process_group("gloo")  # a group of 1 whose keeper's store the test hosts
    threading.Thread(target=say_formed_once_there, args=(threading.main_thread(),), daemon=True).start()
    stay(sys.argv[1])
    print("done", flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("main", ["idle", "busy"])
def test_a_rank_whose_main_thread_stays_idle_where_it_was_after_its_group_was_given_up_ends(tmp_path, main, store):
    # Its keeper then replaces it as any dead rank. One that computes is let be: a long backward pass is no hang.
    import hashlib
    import time

    store, port = store
    started = time.monotonic()
    hashlib.pbkdf2_hmac("sha256", b"p", b"s", 100_000)
    rounds = int(100_000 * 4.0 / (time.monotonic() - started))  # about 4 s of this machine's CPU: four STUCK_S
    rank = subprocess.Popen([sys.executable, "-c", STUCK, main, str(rounds)],
                            env=rank_env(port, **{OUTPUT_DIR_VAR: str(tmp_path / "out")}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline() == "formed\n"
        inprocess.counted(store, 1)  # what the keeper of a killed rank does
        out, err = rank.communicate(timeout=60)
    finally:
        rank.kill()
    if main == "idle":
        assert rank.returncode == -9, (out, err)
        line = err.strip().splitlines()[-1]
        assert line.startswith("trainpod: rank 0: still idle in wait (") and " 1s after its group was given up" in line, err
        assert line.endswith(": the rank ends, and its keeper replaces it"), err
        if shutil.which("py-spy"):  # the C++ wait, and every thread's stack in the output's hangs/
            assert ", waiting in torch::jit::PythonFutureWrapper::wait" in line, line
            (dump,) = (tmp_path / "out" / HANGS_DIR).glob("*-rank0-stuck.txt")
            assert f"(every thread's stack: {dump})" in line and "MainThread" in dump.read_text(), line
    else:
        assert (rank.returncode, out) == (0, "done\n"), err


# Rank 0's main thread sleeps MOVES_AFTER_S before it waits for its receive: the watch, woken as the test counts the next
# generation, first finds it in the sleep, and must follow it into the wait. A watch that let a main thread go once it
# moved (to recover(), it assumed) never ended this rank when its main thread was still on its way into the wait as the
# group was given up (seen once in a suite run: the test waited out its 30 s).
MOVES_AFTER_S = 3.0
ORPHAN = textwrap.dedent("""
    import sys, time, torch
    from trainpod.train import inprocess

    inprocess.STUCK_S = 60.0  # within the test's bounds only the look for a wait that gloo no longer ends can end it
    inprocess.init_process_group("gloo")
    data = torch.zeros(16 * 2**20)  # 64 MiB: far more than the two sockets buffer while the receiver is stopped
    if sys.argv[1] == "0":
        work = torch.distributed.irecv(data, 1)  # posted (its peer is told) before irecv returns
        print("posted", flush=True)
        time.sleep(float(sys.argv[2]))  # longer than the test keeps it stopped: still asleep when the watch wakes
        try:
            work.wait()
            print("received", flush=True)
        except RuntimeError as error:
            print("failed:", inprocess.gist(error), flush=True)
    else:
        print("formed", flush=True)
        sys.stdin.readline()
        print("sending", flush=True)
        torch.distributed.send(data, 0)
""")


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("py-spy"), reason="the look at the native stacks needs py-spy")
@pytest.mark.parametrize("cut", ["receive", "send"])
def test_a_rank_whose_receive_or_send_was_cut_mid_message_ends_without_waiting_out_the_stuck_rank_watch(tmp_path, store, cut):
    # gloo's tcp transport fails every pending operation of a connection that closes, but not a receive whose message
    # had begun to arrive, nor a send whose message had begun to be written: either waits for the group's timeout (30
    # min). The choreography makes both: the receiver is stopped, the sender fills both sockets' buffers with the start
    # of its message. Then, for a cut receive, the sender is killed, and the receiver goes on to read that start and
    # then the end of the connection; for a cut send, the receiver is killed, and the sender's send stays where it was.
    # If the rank left says "failed: ..." instead, gloo now fails such an operation at once, and the in-process tests'
    # allowance for it (fixtures.stuck_stacks) can go.
    import time

    store, port = store
    env = rank_env(port, world=2, **{OUTPUT_DIR_VAR: str(tmp_path / "out")})
    ranks = [subprocess.Popen([sys.executable, "-c", ORPHAN, str(rank), str(MOVES_AFTER_S)], env={**env, "RANK": str(rank)},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    left, killed = (0, 1) if cut == "receive" else (1, 0)
    try:
        assert ranks[1].stdout.readline() == "formed\n"
        assert ranks[0].stdout.readline() == "posted\n"
        os.kill(ranks[0].pid, signal.SIGSTOP)
        ranks[1].stdin.write("send\n")
        ranks[1].stdin.flush()
        assert ranks[1].stdout.readline() == "sending\n"
        time.sleep(1.0)  # the sender blocks once the buffers are full
        ranks[killed].kill()
        ranks[killed].wait()
        if cut == "receive":
            os.kill(ranks[0].pid, signal.SIGCONT)
        inprocess.counted(store, 1)  # what the keeper of the killed rank does
        started = time.monotonic()
        out, err = ranks[left].communicate(timeout=30)
        ended = time.monotonic() - started
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    assert ranks[left].returncode == -9, (out, err)
    line = err.strip().splitlines()[-1]
    wait = f"gloo::transport::tcp::UnboundBuffer::wait{'Recv' if cut == 'receive' else 'Send'}"
    assert inprocess.ORPHANED[wait] == f"a {cut}"
    assert line.startswith(f"trainpod: rank {left}: a {cut} in progress when its group was given up ({wait}), "
                           "which gloo ends only at the group's timeout, after "), err
    assert line.endswith(f"-rank{left}-stuck.txt): the rank ends, and its keeper replaces it"), line
    assert ended < MOVES_AFTER_S + inprocess.ORPHAN_S + 8, ended  # its first look there, on a loaded machine (STUCK_S: 60 s)


# A collective runs on a worker thread of gloo's, which py-spy does not show: a receive or send of it cut mid-message is
# seen as the main thread's wait for the collective (c10d::Work::wait; CI, test_faults: a survivor's all_reduce in
# Preemption.should_stop, ended only after STUCK_S as "still idle"). Made here without a cut: a broadcast in a group of
# the script's own, whose connections the watch leaves (it shuts down the job's group's), from a rank that never sends.
COLLECTIVE = textwrap.dedent("""
    import sys, torch
    from trainpod.train import inprocess

    inprocess.STUCK_S = 60.0  # within the test's bounds only the look for a wait that gloo no longer ends can end it
    inprocess.init_process_group("gloo")
    group = torch.distributed.new_group([0, 1])
    if sys.argv[1] == "0":
        print("waiting", flush=True)
        torch.distributed.broadcast(torch.zeros(4), 1, group=group)
        print("received", flush=True)
    else:
        print("formed", flush=True)
        sys.stdin.readline()
""")


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("py-spy"), reason="the look at the native stacks needs py-spy")
def test_a_rank_whose_main_thread_waits_for_a_collective_after_its_group_was_given_up_ends_without_the_stuck_rank_watch(
        tmp_path, store):
    store, port = store
    env = rank_env(port, world=2, **{OUTPUT_DIR_VAR: str(tmp_path / "out")})
    ranks = [subprocess.Popen([sys.executable, "-c", COLLECTIVE, str(rank)], env={**env, "RANK": str(rank)},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    try:
        assert ranks[1].stdout.readline() == "formed\n"
        assert ranks[0].stdout.readline() == "waiting\n"
        inprocess.counted(store, 1)  # what the keeper of a killed rank does
        started = time.monotonic()
        out, err = ranks[0].communicate(timeout=30)
        ended = time.monotonic() - started
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    assert ranks[0].returncode == -9, (out, err)
    line = err.strip().splitlines()[-1]
    assert line.startswith("trainpod: rank 0: a collective in progress when its group was given up (c10d::Work::wait), "
                           "which gloo ends only at the group's timeout, after "), err
    assert stuck_stacks.orphaned(err) == [0]
    assert ended < inprocess.ORPHAN_S + 10, ended  # its first look there, on a loaded machine (STUCK_S: 60 s)


def meet_all(store_port: int, starts: list[int], world: int | None = None, timeout_s: float | list[float] = 30) -> list:
    """Ranks 0, 1, ... (threads, each with its own store client) meet from the generations `starts`, in a world
    of `world` ranks (all of them by default), each within `timeout_s` (or its own of a list); what each returned
    or raised."""
    from datetime import timedelta

    timeouts = timeout_s if isinstance(timeout_s, list) else [timeout_s] * len(starts)

    def one(rank: int, number: int) -> None:
        client = torch.distributed.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=30))
        try:
            met[rank] = inprocess._meet(client, number, rank, world or len(starts), time.monotonic() + timeouts[rank])
        except inprocess.NotFormed as error:
            met[rank] = error

    met: list = [None] * len(starts)
    threads = [threading.Thread(target=one, args=(rank, number)) for rank, number in enumerate(starts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(timeouts) + 30)
    return met


@pytest.fixture
def store(monkeypatch):
    """(the workers' store as rank 0's keeper hosts it, its port); _meet sets this process's generation, undone after"""
    from datetime import timedelta

    monkeypatch.setenv(INPROCESS_GENERATION_VAR, "0")

    port = free_port()
    host = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                      timeout=timedelta(seconds=30))
    return host, port


def test_ranks_that_start_at_two_generations_counted_together_all_meet_at_the_newest(store):
    # Two ranks died about together: two keepers counted 1 and 2. The survivors saw either count, and
    # each replacement starts at its own keeper's: all of them form one group, the newest generation's.
    host, port = store
    for _ in range(2):  # what each keeper does
        inprocess.counted(host, int(host.add(inprocess.GENERATION_KEY, 1)))
    assert meet_all(port, [1, 2, 1, 2]) == [2, 2, 2, 2]


def test_ranks_that_wait_at_a_generation_move_on_when_a_keeper_counts_the_next_one(store):
    # Ranks 0 and 1 check in at generation 1 and wait (rank 2 never comes to it: it died meanwhile). Its keeper's
    # count of generation 2 ends their meeting, not a poll of theirs: all three meet at 2.
    host, port = store
    inprocess.counted(host, int(host.add(inprocess.GENERATION_KEY, 1)))

    def count_the_next() -> None:
        time.sleep(1.0)
        inprocess.counted(host, int(host.add(inprocess.GENERATION_KEY, 1)))

    keeper = threading.Thread(target=count_the_next)
    keeper.start()
    assert meet_all(port, [1, 1, 2], timeout_s=20) == [2, 2, 2]
    keeper.join()


def test_ranks_of_one_generation_meet_at_it(store):
    host, port = store
    host.add(inprocess.GENERATION_KEY, 1)
    assert meet_all(port, [1, 1, 1]) == [1, 1, 1]


def test_a_generation_that_a_rank_never_comes_to_fails_naming_the_rank(store, capfd):
    # Ranks 0 and 1 of 3 wait; rank 2 never comes. The first deadline to pass (rank 0's) ends both waits, as an
    # outcome in the store: rank 1 does not wait out its own, and no wait times out in c10d (which would say so in
    # two warning lines of its own, socket.cpp's "likely a timeout", before the rank's one line).
    host, port = store
    host.add(inprocess.GENERATION_KEY, 1)
    started = time.monotonic()
    failed = meet_all(port, [1, 1], world=3, timeout_s=[0.5, 20])
    assert time.monotonic() - started < 10
    for error in failed:
        assert isinstance(error, inprocess.NotFormed), error
        assert str(error) == f"generation 1 did not form within {inprocess.REFORM_TIMEOUT_S:g}s: rank(s) 2 did not come"
    assert "likely a timeout" not in capfd.readouterr().err  # socket.cpp's line (not another test's thread's)
