"""The Checkpointer: saves in the background, in order, keep K, one-line errors, kills and exits."""

import errno
import hashlib
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fixtures.checkpoints import data_name, load, manifest_name, save_steps  # noqa: E402
from fixtures.states import assert_same, training_state  # noqa: E402
from trainpod.contract import PROGRESS_DIR_VAR  # noqa: E402
from trainpod.train import checkpoint, progress  # noqa: E402
from trainpod.train.checkpoint import Checkpointer, CheckpointError  # noqa: E402

ENTRYPOINT = str(Path(__file__).resolve().parents[4] / "entrypoint")
BLOCK = checkpoint._HASH_BLOCK  # what the hashing thread reads at a time


def hashing_threads():
    return [thread for thread in threading.enumerate() if thread.name == "trainpod-checkpoint-hash"]


def assert_manifest_matches(directory, step):
    manifest = json.loads((directory / manifest_name(step)).read_text())
    data = (directory / data_name(step)).read_bytes()
    assert (manifest["size"], manifest["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())


def unavailable(reason):
    """Skip on a laptop; under CI=true a skip would hide an untested guarantee, so fail (see fixtures/docker_env.py)."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)


# --- round trip ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_round_trip_of_a_training_state_is_bit_identical(tmp_path):
    model, optimizer, state = training_state()
    lines = []
    ckpt = Checkpointer(tmp_path, log=lines.append)
    ckpt.save(120, state)
    ckpt.wait()

    step, loaded = ckpt.load_latest()
    assert step == 120
    assert_same(loaded, state)
    assert loaded["model"]._metadata == state["model"]._metadata  # load_state_dict reads versions from it
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    assert lines == [f"resuming from step 120 ({tmp_path / data_name(120)})"]

    manifest = json.loads((tmp_path / manifest_name(120)).read_text())
    data = (tmp_path / data_name(120)).read_bytes()
    assert manifest["format"] == "trainpod-checkpoint" and manifest["version"] == 1
    assert (manifest["step"], manifest["file"], manifest["size"]) == (120, data_name(120), len(data))
    assert manifest["sha256"] == hashlib.sha256(data).hexdigest()
    # The usual state, RNG states included, loads without the full unpickler.
    torch.load(tmp_path / data_name(120), weights_only=True)


def test_many_quick_saves_complete_in_order_and_keep_the_last_k(tmp_path):
    save_steps(tmp_path, range(1, 21), keep=3)
    assert sorted(os.listdir(tmp_path)) == sorted([data_name(s) for s in (18, 19, 20)] + [manifest_name(s) for s in (18, 19, 20)])
    (step, state), _ = load(tmp_path)
    assert step == 20 and state["step"] == 20 and torch.equal(state["value"], torch.full((64,), 20.0))


def test_saving_a_step_again_replaces_it(tmp_path):
    with Checkpointer(tmp_path, log=lambda line: None) as ckpt:
        ckpt.save(5, {"v": 1})
        ckpt.save(5, {"v": 2})
    (step, state), _ = load(tmp_path)
    assert (step, state) == (5, {"v": 2})


def test_a_directory_with_later_steps_is_noted_and_the_new_checkpoint_kept(tmp_path):
    save_steps(tmp_path, [100, 200], keep=1)  # keep=1: only 200 is left
    lines = []
    with Checkpointer(tmp_path, keep=1, log=lines.append) as ckpt:
        ckpt.save(5, {"step": 5})
    assert lines == [f"note: {tmp_path} holds a checkpoint of step 200, later than this save's step 5; "
                     "load_latest() takes the highest step that verifies"]
    assert sorted(os.listdir(tmp_path)) == sorted([data_name(s) for s in (5, 200)] + [manifest_name(s) for s in (5, 200)])


# --- failures -----------------------------------------------------------------------------------


def test_a_background_failure_is_raised_once_by_the_next_call(tmp_path):
    lines = []
    ckpt = Checkpointer(tmp_path, log=lines.append)
    ckpt.save(1, {"fn": lambda: None})  # deep-copies fine, but pickle refuses a lambda
    with pytest.raises(CheckpointError, match=rf"could not save checkpoint step 1 in {tmp_path} .*pickle"):
        ckpt.save(2, {"v": 2})
    assert [line for line in lines if "could not save" in line]  # also logged when it happened
    ckpt.save(2, {"v": 2})  # the error was reported; saving goes on
    ckpt.close()
    assert sorted(os.listdir(tmp_path)) == sorted([data_name(2), manifest_name(2)])


def test_save_checks_its_arguments_and_refuses_after_close(tmp_path):
    with pytest.raises(ValueError):
        Checkpointer(tmp_path, keep=0)
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(TypeError):
        ckpt.save("1", {})
    with pytest.raises(ValueError):
        ckpt.save(-1, {})
    ckpt.close()
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.save(1, {})


# --- the sha256, hashed by a thread that reads the file back behind the write ---------------------


@pytest.mark.parametrize("nbytes", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 4000, 3 * BLOCK + 4000])
def test_the_sha256_covers_every_byte_whatever_the_chunk_sizes(tmp_path, nbytes):
    generator = torch.Generator().manual_seed(nbytes)
    # torch.save writes each tensor's bytes as one chunk, between small headers.
    state = {"a": torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator), "b": torch.arange(BLOCK // 8 + 3)}
    with Checkpointer(tmp_path, log=lambda line: None) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        assert not hashing_threads()
    assert_manifest_matches(tmp_path, 1)
    (step, loaded), _ = load(tmp_path)
    assert step == 1 and torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])


def test_the_sha256_is_of_the_bytes_in_the_file_though_the_writer_reuses_its_buffer(tmp_path, monkeypatch):
    def save_through_one_buffer(state, f):
        buffer = bytearray(BLOCK + 5)
        for fill in range(4):
            buffer[:] = bytes([fill]) * len(buffer)
            f.write(buffer)
            buffer[:] = b"\xff" * len(buffer)  # changed as soon as write() returns, before it is hashed
        f.flush()

    monkeypatch.setattr(torch, "save", save_through_one_buffer)
    with Checkpointer(tmp_path, log=lambda line: None) as ckpt:
        ckpt.save(1, {})
    assert (tmp_path / data_name(1)).read_bytes() == b"".join(bytes([fill]) * (BLOCK + 5) for fill in range(4))
    assert_manifest_matches(tmp_path, 1)


@pytest.mark.parametrize("failure", ["error", "short"])
def test_a_failed_read_of_the_hashing_thread_fails_the_save_and_stops_it(tmp_path, monkeypatch, failure):
    preadv, reads = os.preadv, []

    def failing_preadv(fd, buffers, offset):
        reads.append(offset)
        if len(reads) < 2:  # the first block hashes; the second read fails
            return preadv(fd, buffers, offset)
        if failure == "short":
            return 0
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    ckpt = Checkpointer(tmp_path, log=lambda line: None)
    ckpt.save(1, {"w": torch.ones(10)})
    ckpt.wait()
    monkeypatch.setattr(os, "preadv", failing_preadv)
    ckpt.save(2, {"w": torch.ones(3 * BLOCK // 4)})  # 3 blocks
    with pytest.raises(CheckpointError) as raised:
        ckpt.wait()
    monkeypatch.undo()
    reason = "Input/output error" if failure == "error" else f"the file ends at {BLOCK} bytes, "
    assert str(raised.value).startswith(f"could not save checkpoint step 2 in {tmp_path} ({data_name(2)}): {reason}")
    assert len(reads) == 2 and not hashing_threads()
    assert sorted(os.listdir(tmp_path)) == sorted([data_name(1), manifest_name(1)])  # no temporary file left
    ckpt.save(3, {"w": torch.ones(BLOCK)})
    ckpt.close()
    assert_manifest_matches(tmp_path, 3)


def tmpfs(tmp_path, options):
    """A tmpfs mounted with `options` (needs root or CAP_SYS_ADMIN), unmounted afterwards."""
    if sys.platform != "linux" or not shutil.which("mount"):
        unavailable("no Linux mount(8) to make a small tmpfs")
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mountpoint)], capture_output=True, text=True)
    if result.returncode != 0:
        unavailable(f"cannot mount a tmpfs ({result.stderr.strip() or result.returncode}): the test needs root")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs: a full disk on demand."""
    yield from tmpfs(tmp_path, "size=2m")


@pytest.fixture
def read_only(tmp_path):
    """A read-only file system (EROFS: refused even to root)."""
    yield from tmpfs(tmp_path, "ro,size=1m")


def test_a_full_disk_fails_clearly_and_keeps_the_previous_checkpoint(small_disk):
    ckpt = Checkpointer(small_disk, log=lambda line: None)
    ckpt.save(1, {"w": torch.ones(10_000)})
    ckpt.wait()
    ckpt.save(2, {"w": torch.ones(1_000_000)})  # 4 MB into 2 MiB
    deadline = time.monotonic() + 30
    while ckpt.fatal is None:  # seen as soon as the write failed, without a call that raises it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert ckpt.fatal.exit_code == 73
    with pytest.raises(CheckpointError) as raised:
        ckpt.wait()
    assert ckpt.fatal is None  # raised once
    message = str(raised.value)
    assert raised.value.exit_code == 73 and "\n" not in message
    assert "No space left on device" in message and str(small_disk) in message
    assert "the checkpoint of step 1 is intact (verified): a new run resumes from it; free space there" in message
    assert sorted(os.listdir(small_disk)) == sorted([data_name(1), manifest_name(1)])  # no temporary file left
    (step, state), _ = load(small_disk)
    assert step == 1 and torch.equal(state["w"], torch.ones(10_000))
    ckpt.save(3, {"w": torch.ones(10)})  # the space came back with the removed temporary file
    ckpt.close()


def test_a_full_disk_names_a_damaged_previous_checkpoint(small_disk):
    with Checkpointer(small_disk, log=lambda line: None) as ckpt:
        ckpt.save(1, {"w": torch.ones(10_000)})
    (small_disk / data_name(1)).write_bytes(b"damaged")
    ckpt = Checkpointer(small_disk, log=lambda line: None)
    ckpt.save(2, {"w": torch.ones(1_000_000)})
    with pytest.raises(CheckpointError, match="none of the 1 earlier checkpoint.s. verifies: a new run starts from the beginning"):
        ckpt.close()


# --- directories that cannot be used: 78, before training ----------------------------------------


def unusable(tmp_path):
    (tmp_path / "a-file").write_text("x")
    os.symlink("loop", tmp_path / "loop")
    os.symlink("nowhere", tmp_path / "dangling")
    (tmp_path / "named" / data_name(10)).mkdir(parents=True)
    (tmp_path / "temp" / f".{data_name(3)}.x.tmp").mkdir(parents=True)
    return {
        "a-file": "is not a directory (it, or a folder on its path, is a file)",
        "a-file/sub": "is not a directory",
        "loop": "is a symbolic link loop",
        "dangling": "exists but is not a directory (a file or a broken symbolic link)",
        "named": f"named/{data_name(10)} is named like a checkpoint file but is a directory",
        "temp": "is named like a checkpoint file but is a directory",
    }


@pytest.mark.parametrize("write", [False, True])
def test_an_unusable_directory_is_a_configuration_error(tmp_path, write):
    for name, says in unusable(tmp_path).items():
        ckpt = Checkpointer(tmp_path / name, log=lambda line: None)
        for call in ((lambda c=ckpt: c.check(write=write)), ckpt.load_latest):
            with pytest.raises(CheckpointError) as raised:
                call()
            assert raised.value.exit_code == 78, name
            assert says in str(raised.value) and "\n" not in str(raised.value)
    assert sorted(os.listdir(tmp_path / "named")) == [data_name(10)]  # nothing was removed


def test_the_first_save_refuses_a_directory_named_like_a_checkpoint(tmp_path):
    (tmp_path / data_name(4)).mkdir()  # a leftover data file without manifest, were it a file: it would be removed
    ckpt = Checkpointer(tmp_path, log=lambda line: None)
    with pytest.raises(CheckpointError, match="named like a checkpoint file but is a directory") as raised:
        ckpt.save(5, {"v": 1})
    assert raised.value.exit_code == 78 and (tmp_path / data_name(4)).is_dir()


def test_a_read_only_directory_is_refused_by_the_writer_only(read_only):
    Checkpointer(read_only).check(write=False)  # a rank that only loads: fine
    assert Checkpointer(read_only, log=lambda line: None).load_latest() is None
    with pytest.raises(CheckpointError, match=rf"cannot write in the checkpoint directory {read_only}: Read-only file system") as raised:
        Checkpointer(read_only).check(write=True)
    assert raised.value.exit_code == 78
    with pytest.raises(CheckpointError, match="cannot create the checkpoint directory") as raised:
        Checkpointer(read_only / "sub").check(write=True)
    assert raised.value.exit_code == 78


def test_a_save_into_a_read_only_directory_is_73(read_only):
    ckpt = Checkpointer(read_only, log=lambda line: None)
    ckpt.save(1, {"v": 1})  # without check(): the writer thread meets EROFS
    with pytest.raises(CheckpointError, match="Read-only file system; there is no earlier checkpoint") as raised:
        ckpt.close()
    assert raised.value.exit_code == 73 and "make it writable for this user" in str(raised.value)


def test_check_creates_a_missing_directory_and_leaves_nothing_behind(tmp_path):
    Checkpointer(tmp_path / "new" / "dir").check()
    assert os.listdir(tmp_path / "new" / "dir") == []


def test_commits_and_the_resumed_step_are_reported_as_progress(tmp_path, monkeypatch):
    monkeypatch.setenv(PROGRESS_DIR_VAR, str(tmp_path / "progress"))
    (tmp_path / "progress").mkdir()
    monkeypatch.setattr(progress, "_reporter", progress._Reporter())  # opens the file under this variable
    with Checkpointer(tmp_path / "ckpt", log=lambda line: None) as ckpt:
        ckpt.save(4, {"v": 4})
        ckpt.wait()
        record = progress.read(tmp_path / "progress")[0]
        assert record.committed == 4
        # How long the save took to commit, and held its caller: a part of it (the metrics' checkpoint figures).
        assert record.save > 0 and 0 <= record.stall <= record.save, record
        ckpt.save(5, {"v": 5})
        ckpt.wait()
        assert progress.read(tmp_path / "progress")[0].committed == 5
    monkeypatch.setattr(progress, "_reporter", progress._Reporter())  # a restarted rank
    assert Checkpointer(tmp_path / "ckpt", log=lambda line: None).load_latest()[0] == 5
    record = progress.read(tmp_path / "progress")[0]
    assert (record.committed, record.save, record.stall) == (5, 0.0, 0.0)  # resumed from, not saved by this rank


# --- kills and exits: child processes -------------------------------------------------------------

# One interpreter imports torch once (2 s here) and forks a child per command: "loop DIR" saves in a
# loop until it is killed, "exit DIR" saves and ends the interpreter without wait(), "fsize DIR"
# saves under a file size limit (RLIMIT_FSIZE: a real write error without root).
ZYGOTE = r"""
import os, resource, signal, sys, threading
import torch
from trainpod.train.checkpoint import Checkpointer, CheckpointError

def loop(directory):
    ckpt = Checkpointer(directory, keep=2, log=lambda line: None)
    resumed = ckpt.load_latest()
    step = resumed[0] if resumed else 0
    payload = torch.empty(256, 1024)  # 1 MiB
    first = step + 1
    while True:
        step += 1
        payload.fill_(step)
        ckpt.save(step, {"step": step, "payload": payload, "log": list(range(step % 1000))})
        if step == first:
            ckpt.wait()
            print(f"committed {step}", flush=True)

def exit_without_wait(directory):
    ckpt = Checkpointer(directory, log=lambda line: None)
    ckpt.save(7, {"step": 7, "payload": torch.full((4 << 20,), 7.0)})  # 16 MiB: still writing at exit
    print("saved", flush=True)
    sys.exit(0)  # the interpreter's normal exit, in the child

def file_too_large(directory):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (9 << 20, 9 << 20))
    ckpt = Checkpointer(directory, log=lambda line: print("log", line, flush=True))
    ckpt.save(1, {"w": torch.ones(4_000_000)})  # 16 MB past a 9 MiB limit: after two hashed blocks
    for call in (ckpt.wait, ckpt.wait, lambda: ckpt.save(2, {"w": torch.ones(10)}), ckpt.close):
        try:
            call()
            print("ok", flush=True)
        except CheckpointError as exc:
            print("raised", exc, flush=True)
    print("threads", " ".join(sorted(thread.name for thread in threading.enumerate())), flush=True)
    sys.exit(0)

for line in sys.stdin:
    command, directory = line.split()
    pid = os.fork()
    if pid == 0:
        {"loop": loop, "exit": exit_without_wait, "fsize": file_too_large}[command](directory)
    print(f"pid {pid}", flush=True)
    _, status = os.waitpid(pid, 0)
    print(f"reaped {status}", flush=True)
"""


class Zygote:
    def __init__(self):
        env = {**os.environ, "PYTHONPATH": ENTRYPOINT}  # this checkout's trainpod, whichever is installed
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     env=env)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def send(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def lines_until(self, prefix, timeout=60):
        """Every line up to and including the first that starts with prefix."""
        lines = []
        while not lines or not (lines[-1] == prefix or lines[-1].startswith(prefix + " ")):
            line = self.lines.get(timeout=timeout)
            assert line is not None, f"the zygote ended (exit code {self.proc.wait()})"
            lines.append(line)
        return lines

    def expect(self, *prefixes, timeout=60):
        """The lines that start with each prefix, in whatever order they come."""
        found = {}
        while len(found) < len(prefixes):
            line = self.lines.get(timeout=timeout)
            assert line is not None, f"the zygote ended (exit code {self.proc.wait()})"
            for prefix in prefixes:
                if line.startswith(prefix + " ") or line == prefix:
                    found[prefix] = line[len(prefix) :].strip()
        return [found[prefix] for prefix in prefixes]

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


@pytest.mark.slow
def test_a_kill_at_any_moment_leaves_a_good_checkpoint(tmp_path, zygote):
    rng = random.Random(20240611)
    committed = 0
    for _ in range(5):
        zygote.send(f"loop {tmp_path}")
        pid, first = zygote.expect("pid", "committed")
        try:
            assert int(first) > committed  # it resumed from the last good checkpoint
            time.sleep(rng.uniform(0.0, 0.4))  # a seeded moment somewhere in the save loop
        finally:
            os.kill(int(pid), signal.SIGKILL)  # also when the test fails: never leave it saving
        (status,) = zygote.expect("reaped")
        assert os.WIFSIGNALED(int(status)) and os.WTERMSIG(int(status)) == signal.SIGKILL

        result, lines = load(tmp_path)
        assert result is not None
        step, state = result
        assert step >= int(first) and state["step"] == step and torch.all(state["payload"] == step)
        assert not [line for line in lines if line.startswith("skipping")], lines
        committed = step
    temps = [name for name in os.listdir(tmp_path) if name.startswith(".")]
    assert len(temps) <= 2  # at most the last kill's; the earlier ones were cleaned up


@pytest.mark.slow
def test_a_save_in_flight_completes_at_interpreter_exit(tmp_path, zygote):
    zygote.send(f"exit {tmp_path}")
    zygote.expect("saved")
    (status,) = zygote.expect("reaped")
    assert os.WIFEXITED(int(status)) and os.WEXITSTATUS(int(status)) == 0
    (step, state), _ = load(tmp_path)
    assert step == 7 and torch.all(state["payload"] == 7.0)


@pytest.mark.slow
def test_a_write_error_is_raised_once_naming_the_os_error(tmp_path, zygote):
    zygote.send(f"fsize {tmp_path}")
    *lines, reaped = [line for line in zygote.lines_until("reaped") if not line.startswith("pid ")]
    status = int(reaped.split()[1])
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    error = (f"could not save checkpoint step 1 in {tmp_path} ({data_name(1)}): File too large; there is no earlier "
             "checkpoint: a new run starts from the beginning; free space there (or use another directory), then run the job again")
    # torch.save re-wraps the failed write in its own RuntimeError; the OS error is what is reported.
    assert lines == [f"log {error}", f"raised {error}", "ok", "ok", "ok", "threads MainThread"]  # no thread left behind
    assert sorted(os.listdir(tmp_path)) == sorted([data_name(2), manifest_name(2)])  # no temporary file left
