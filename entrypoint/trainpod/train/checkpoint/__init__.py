"""Checkpoints that survive a kill at any moment and cost the training loop only a memory copy.

The API (used by the examples, meant for your own scripts too):

    ckpt = Checkpointer(directory, keep=3)   # also: trusted=, safe_globals= (Loading, below)
    ckpt.save(step, state)      # returns once `state` is copied; the write goes on in the background
    ckpt.wait()                 # every save so far is durable (or its error is raised here)
    ckpt.load_latest()          # (step, state) of the newest good checkpoint, or None
    ckpt.close()                # wait() and release the snapshot buffer; also `with Checkpointer(...)`

`state` is any dict that torch.save accepts; loading it back takes tensors and plain values (see
Loading for anything else). Failures of a background write are raised as
CheckpointError, one line naming the directory, the file and the OS error ("No space left on
device"), from the next save(), wait() or close().

Errors and their exit codes (CheckpointError.exit_code, for a script that exits with it):
- 78 (configuration): a directory that cannot be used at all (a file, a symbolic link loop, not
  readable, not writable for the writer: check() finds these before training starts; an entry named
  like a checkpoint file that is a directory), a checkpoint that verifies but that torch.load
  cannot read here, one that only the full unpickler would load (Loading, below), or a
  TRAINPOD_TRUST_CHECKPOINTS that is no boolean. Retrying fails the same way: fix the job.
- 73 (EX_CANTCREAT): a save failed for lack of space (ENOSPC, EDQUOT, EFBIG) or of permission
  (EACCES, EPERM, EROFS). Before the error is reported, the newest earlier checkpoint is verified
  (size and sha256), and the line says which step a new run would resume from. `fatal` shows such
  an error as soon as it happened, so a training loop can stop at once instead of at its next save
  (the bundled examples do: every rank stops after the current step and exits 73).
- 1: anything else (a state that does not pickle, an I/O error that may pass).

Progress. Each commit is reported to the agent with trainpod.train.progress.committed(step), and so is
the checkpoint load_latest() resumed from: `trainpod run` gives the restart budget back when a job
committed a newer checkpoint since its last failure (trainpod.supervisor.restarts). A commit also
reports how long its save took, from save() to the commit, and how long save() held the training loop
(waiting for the previous write, then copying the state): the agent serves both as metrics
(--metrics-port: trainpod_checkpoint_save_seconds, trainpod_checkpoint_stall_seconds).

Files. Step 1234 is `ckpt-00001234.pt` (what torch.save wrote) plus `ckpt-00001234.json`, its
manifest: format, version, step, file, size, sha256, created, torch version. The manifest is the
commit point: a data file without one is not a checkpoint. A save writes the data to a temporary
`.ckpt-00001234.pt.*.tmp` in the same directory, fsyncs it, renames it into place and fsyncs the
directory; only then does it write the manifest the same way (temporary, fsync, rename, fsync the
directory). A kill (or power loss) at any point therefore leaves either the old set of
checkpoints or the old set plus the new one, never a manifest that names bytes that are not all
on disk. After each commit, checkpoints beyond the newest `keep` (by step) are deleted, manifest
first; the one just written is never deleted, even if a directory left from another run holds
higher steps (the first save says so in one line, as load_latest() would prefer those). Steps
should grow; saving a step again replaces it. The deleting happens after wait() returns (freeing
a large file costs a good part of what writing it did, and the new checkpoint does not depend on
it); the next save(), close() and load_latest() wait for it.

Loading. load_latest() goes from the highest step down. A checkpoint counts if its manifest
parses, the data file's size and sha256 match it, and torch.load reads it; each one that does not
is reported in one line (truncated, sha256 mismatch, unreadable manifest, no manifest) and the
next older one is tried. With none left it reports "no checkpoint in DIR: starting fresh" and
returns None. Verifying reads every byte once more than loading would (sha256 runs at 0.3 to 2
GB/s, depending on the CPU). A file that matches its sha256 but that torch.load cannot read is not
damage but a mismatch with this environment (an older torch, a class that no longer imports): that
raises CheckpointError instead of quietly starting over. Tensors are loaded onto the CPU.

Loading never runs code, unless you say so. A checkpoint is a pickle, and unpickling may call any
function the file names: a file whose pickle calls os.system runs that command on every rank that
resumes. The sha256 does not help: it proves the bytes are those written, and whoever can write the
data file can write its manifest. So checkpoints are read only by torch's weights-only unpickler
(torch.load(weights_only=True)): tensors, dicts, lists, tuples, numbers, strings, OrderedDict, torch's
dtypes and sizes. That covers what trainpod and the bundled examples save, tested by saving and
loading each (tests/unit/train/checkpoint/test_trust.py): model, optimizer (SGD, Adam; Apex's fused ones,
not runnable on the CPU, keep torch's state layout of tensors and numbers), LR scheduler, GradScaler,
the samplers' and the ledger's records (trainpod.train.samplers, trainpod.examples.elastic), every rank's
trainpod.train.rng.rng_state() (numpy's state stored as tensors for this reason) and the loss curve; with
torch 2.13 none of it needs a type of its own allowlisted.
Anything else (an argparse.Namespace, a numpy array, a class of your script, a function such as
posix.system) is refused: CheckpointError, exit_code 78, one line naming the file and what it holds
(the first global torch's unpickler refused), no older checkpoint tried instead (that would be a
silent roll-back, and whoever wrote this file could write those). Two ways out:
- `safe_globals=[MyConfig, ...]`: types of your own, harmless to build from any file (no side
  effects in __setstate__ or __init__), that the weights-only load may construct. They are allowed
  only while this Checkpointer loads (torch.serialization.safe_globals, scoped: the process's own
  allowlist is left as it was); types your script gave torch.serialization.add_safe_globals count too.
- trusting the directory: `trainpod run --trust-checkpoints` (TRAINPOD_TRUST_CHECKPOINTS=1, which
  the launch plan sets for every rank), or Checkpointer(..., trusted=True), which overrides the
  variable either way. A checkpoint that the weights-only load refuses is then loaded with the full
  unpickler, and one line says so, once per Checkpointer, with the file and what it holds. The risk:
  anyone who can write a file into that directory (a shared volume, a copied checkpoint, another
  job's or user's account) runs their code with your job's identity, its credentials and its data, on
  every node that resumes. Trust only a directory that nobody but your own jobs can write.

Saving without stalling. save() waits for the previous save's write to finish (at most one write
is in flight, so checkpointing needs host memory for one copy of the state and saves complete in
order), copies every tensor to CPU memory, recursively through dicts, lists and tuples (other
values with copy.deepcopy), and hands that snapshot to a background thread: the caller may change
its model as soon as save() returns. The snapshot's buffers are kept and reused by the next save
whenever a tensor has the same shape, dtype and strides, so a save costs a memcpy, not a fresh
allocation and its page faults; close() releases them. GPU tensors go into pinned buffers. The
background thread streams torch.save into the temporary file; a second thread trails it, reading
each 4 MiB block back (from the page cache) as soon as it is written and feeding it to the sha256.
So hashing overlaps the write and the fsync instead of adding to them, and the digest is that of
the bytes in the file, which is what load_latest() checks; a failed read fails the save like a
failed write. Writing, reading and hashing release the GIL, so the training thread runs on.

Interpreter exit. The writer thread is not a daemon: a script that ends (or dies of an exception)
with a save in flight still finishes that save before the process exits. A failure then is
logged, but only wait()/close() can turn it into an exception, so end with close() or use the
Checkpointer as a context manager. A kill loses at most the saves still in flight.

Peer copies. Under `trainpod run --peer-copies` (trainpod.agent.peercopy) every node's agent keeps the
newest checkpoint a rank sent it in memory: before each commit the writer sends the file to its own
node's agent and to the next node's (by group rank, a ring), in the writer thread, so that losing either
node leaves a copy and no node's memory is behind a disk. Before load_latest() reads the directory it asks
every node which copy it holds; one newer than the directory's newest manifest, or as new on a node new to
the job (a joiner, a spare: its first round is not the job's first), is fetched, its size and sha256 checked
against the manifest that came with it, and loaded as a file is (the weights-only unpickler, unless
trusted), with one line naming the node. A node whose disk lost the checkpoint (a node-local directory,
a replacement, a spare) goes on from the job's newest checkpoint instead of an older one or none, and a
new node takes its first step without reading the shared disk. The copy is not written to the directory;
the next save is.
Anything else (no peer answers, a copy that does not verify) leaves the directory to decide, with one line.
One copy per job: a script with two Checkpointers gives peer copies to one of them only (peers=False).

One writer per directory. Only one process may save to a directory (with torchrun: rank 0); every
rank may load from it. Leftovers of an interrupted save (temporary files, data without manifest)
are removed by the writer before its first save, not by constructing a Checkpointer, so a rank
that only loads never deletes a file rank 0 is writing. This module makes no torch.distributed
calls; a DDP script does this (the RNG states of every rank go into rank 0's checkpoint):

    from trainpod.train.rng import rng_state, set_rng_state

    ckpt = Checkpointer(args.checkpoint_dir, keep=args.keep)          # every rank, shared directory
    start = 0
    resumed = ckpt.load_latest()                                        # every rank
    if resumed is not None:
        start, state = resumed
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"][dist.get_rank()])
    for step in range(start + 1, args.steps + 1):
        train_one_step()
        if step % args.checkpoint_every == 0:
            rngs = [None] * dist.get_world_size()
            dist.all_gather_object(rngs, rng_state())                   # a collective: every rank
            if dist.get_rank() == 0:
                ckpt.save(step, {"model": model.module.state_dict(),
                                 "optimizer": optimizer.state_dict(), "rng": rngs})
    ckpt.close()                                                        # rank 0: the last save is durable

Every rank reads the directory on its own, so on a shared file system a rank could see another
newest checkpoint (a late-arriving file, damage seen by one host only); checking that all ranks
resumed from the same step (all_gather the step) turns that into an error instead of a silent
divergence.

The code: this module holds the API, the writer thread and the order of a save's steps;
snapshot.py the copy save() takes; files.py the names, the manifest and the verified read.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import operator
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

import torch

from trainpod import failpoints
from trainpod.atomic import fsync_dir, make_shareable
from trainpod.errors import EXIT_CANTCREAT, EXIT_CONFIG, NO_SPACE, TrainpodError
from trainpod.settings import TRUST_CHECKPOINTS
from trainpod.train import progress
from trainpod.train.checkpoint import files
from trainpod.train.checkpoint.peers import Held, PeerError, Peers
from trainpod.train.checkpoint.snapshot import Snapshot

__all__ = ["CheckpointError", "Checkpointer"]

LOG_PREFIX = "trainpod.train.checkpoint: "


class CheckpointError(TrainpodError):
    """A checkpoint could not be saved (or a verified one not loaded); the message is one line.

    `exit_code`: 78 for an unusable directory or a checkpoint this environment cannot read, 73 for a
    save that failed for lack of space or permission, 1 otherwise (see the module's docstring).
    """


# A save that fails with one of these fails the same way on every retry.
NO_PERMISSION = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
# Listing or creating the directory: these say the path itself is wrong, not that it failed this time.
UNUSABLE = NO_PERMISSION | {errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG, errno.EEXIST}


def _unusable(directory: Path, exc: OSError, doing: str) -> CheckpointError:
    """The one-line error for a checkpoint directory that cannot be used: 78 where the path is wrong."""
    if exc.errno == errno.ENOTDIR:
        what = f"the checkpoint directory {directory} is not a directory (it, or a folder on its path, is a file)"
    elif exc.errno == errno.ELOOP:
        what = f"the checkpoint directory {directory} is a symbolic link loop (too many levels of symbolic links)"
    elif exc.errno == errno.EEXIST:
        what = f"the checkpoint directory {directory} exists but is not a directory (a file or a broken symbolic link)"
    else:
        what = f"cannot {doing} the checkpoint directory {directory}: {exc.strerror or exc}"
    code = EXIT_CONFIG if exc.errno in UNUSABLE else 1
    error = CheckpointError(what + ("; choose another directory or fix this one" if code == EXIT_CONFIG else ""), exit_code=code)
    error.__cause__ = exc
    return error


def _holds(refused: files.Refused) -> str:
    if refused.is_global:
        return f"it holds {refused.what}, which torch.load(weights_only=True) does not allow"
    return f"torch.load(weights_only=True) cannot read it ({refused.what})"


def _refusal(refused: files.Refused, directory: Path) -> str:
    """The one line for a checkpoint that only the full unpickler would load: the file, what it holds, the way out."""
    trust = (f"if nobody but your own jobs can write {directory}, trust it with {TRUST_CHECKPOINTS.flag} "
             f"({TRUST_CHECKPOINTS.var}=1)")
    if not refused.is_global:  # no pickle the weights-only unpickler knows: garbage, or opcodes it never allows
        return (f"{refused.path} matches its manifest's sha256, but torch.load cannot read it here without the full "
                f"unpickler ({refused.what}), which runs any code a file carries: {trust}")
    return (f"{refused.path}: not loaded: {_holds(refused)}, and unpickled in full a checkpoint can run any code; "
            f"{trust}, or pass a harmless type of your own script as Checkpointer(safe_globals=[...])")


def _default_log(message: str) -> None:
    print(LOG_PREFIX + message, file=sys.stderr, flush=True)


def _check_step(step: Any) -> int:
    if isinstance(step, bool):
        raise TypeError(f"step must be an int, got {step!r}")
    try:
        step = operator.index(step)
    except TypeError:
        raise TypeError(f"step must be an int, got {type(step).__name__}") from None
    if step < 0:
        raise ValueError(f"step must be at least 0, got {step}")
    return step


def _find_os_error(exc: BaseException | None) -> OSError | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


# --- writing -----------------------------------------------------------------------------------


_HASH_BLOCK = 4 << 20  # what the hashing thread reads at a time; also how far apart it is woken


class _HashingWriter:
    """The file object torch.save writes to; a thread trailing the write hashes the file's bytes.

    Each block written is published (flushed to the OS, its end announced) and the thread reads it
    back with pread into the sha256: the digest is that of the bytes in the file, whatever torch.save
    does with its buffers after write() returns. The price: a thread and one more copy of each byte,
    from the page cache (or from the disk, slower but still right, if memory pressure evicted it);
    what it buys over hashing each chunk before writing it: the hashing overlaps the write and the
    fsync (bench/checkpoint.py). Use it as a context manager (the thread lives inside it), and
    stop(abort=False) before the fsync so that the thread hashes the tail meanwhile; hexdigest()
    waits for it.
    """

    def __init__(self, file):
        self._file = file
        self._fd = file.fileno()
        self._hash = hashlib.sha256()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._hash_file, name="trainpod-checkpoint-hash")
        self.size = 0  # bytes handed to the file
        self._published = 0  # bytes in the file, which the thread may read
        self._hashed = 0
        self._ended = self._aborted = False
        self._error: BaseException | None = None
        self.os_error: OSError | None = None  # torch.save may re-wrap it; the cause is kept here

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, _HASH_BLOCK):  # a large tensor is hashed while it is written
            piece = view[start : start + _HASH_BLOCK]
            self._keep_os_error(self._file.write, piece)
            self.size += piece.nbytes
            if self.size - self._published >= _HASH_BLOCK:
                self.flush()
        return view.nbytes

    def flush(self) -> None:
        self._keep_os_error(self._file.flush)
        with self._cond:
            self._published = self.size
            self._cond.notify()

    def _keep_os_error(self, call, *args) -> None:
        try:
            call(*args)
        except OSError as exc:
            self.os_error = self.os_error or exc
            raise

    def _hash_file(self) -> None:
        try:
            block = memoryview(bytearray(_HASH_BLOCK))
            while True:
                with self._cond:
                    while self._hashed == self._published and not self._ended:
                        self._cond.wait()
                    if self._aborted or self._hashed == self._published:
                        return
                    n = min(self._published - self._hashed, _HASH_BLOCK)
                n = os.preadv(self._fd, [block[:n]], self._hashed)
                if n == 0:
                    raise OSError(errno.EIO, f"the file ends at {self._hashed} bytes, {self._published} were written")
                self._hash.update(block[:n])
                self._hashed += n
        except BaseException as exc:  # reported by hexdigest(): a digest that missed bytes would condemn a good file
            self._error = exc

    def stop(self, *, abort: bool) -> None:
        """No more writes: the thread hashes the rest of the file, or with abort stops after its block."""
        with self._cond:
            self._ended = True
            self._aborted = self._aborted or abort
            self._cond.notify()

    def hexdigest(self) -> str:
        self.stop(abort=False)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._hash.hexdigest()

    def __enter__(self) -> _HashingWriter:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop(abort=True)
        self._thread.join()


class _Job:
    def __init__(self, step: int, state: Any, started: float, stall: float):
        self.step = step
        self.state = state
        self.started = started  # time.monotonic() as save() was called
        self.stall = stall  # seconds save() held its caller: the previous write, then the copy
        self.os_error: OSError | None = None


class Checkpointer:
    """Atomic, verified, background checkpoints of one training run in `directory`."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3, *, log: Callable[[str], None] | None = None,
                 trusted: bool | None = None, safe_globals: Iterable[Any] = (), peers: Peers | bool = True):
        """`trusted`: load checkpoints that the weights-only unpickler refuses with the full one (which
        runs any code a file carries); None: as --trust-checkpoints (TRAINPOD_TRUST_CHECKPOINTS) says,
        off by default. `safe_globals`: your own types that the weights-only load may build (see the
        module's docstring). `peers`: the nodes whose memory keeps a copy of each checkpoint (Peer copies,
        in the module's docstring); True: the ones `trainpod run --peer-copies` gave this rank, if any; False: none."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int of at least 1, got {keep!r}")
        self.directory = Path(directory)
        self.keep = keep
        self._log = log or _default_log
        if trusted is None:
            try:
                trusted, _ = TRUST_CHECKPOINTS.from_env(os.environ)
            except TrainpodError as bad:  # a value that is no boolean: one line naming the variable, 78
                raise CheckpointError(str(bad), exit_code=bad.exit_code) from None
        self.trusted = bool(trusted)
        self.safe_globals = tuple(safe_globals)
        self._trust_said = False
        self._cond = threading.Condition()
        self._job: _Job | None = None  # the save in flight, until its old checkpoints are deleted
        self._committing = False  # until the save in flight is durable or has failed
        self._error: CheckpointError | None = None
        self._spare: Any = None
        self._prepared = False
        self._closed = False
        self._peers = Peers.from_env() if peers is True else peers or None
        self._copy_failing = False  # the last copies to the nodes' memory failed: said once, until they arrive again
        failpoints.armed()  # a malformed TRAINPOD_FAILPOINTS fails here, not in the writer thread

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.directory)!r}, keep={self.keep})"

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # Already failing: finish the write, but do not hide the original exception behind ours
        # (which the writer logged when it happened).
        with contextlib.suppress(CheckpointError):
            self.close()

    # --- the API ---

    def save(self, step: int, state: Any) -> None:
        """Snapshot `state` as checkpoint `step` and return; the write continues in the background.

        Waits first for the previous save's write (one in flight at a time). Raises CheckpointError
        if the previous save failed (this state is then not saved) or after close().
        """
        step = _check_step(step)
        started = time.monotonic()
        with self._cond:
            if self._closed:
                raise CheckpointError(f"checkpoint step {step} not saved: the Checkpointer for {self.directory} is closed")
            self._wait_idle_locked()
            self._raise_error_locked()
            if not self._prepared:
                self._prepare(step)
                self._prepared = True
            spare, self._spare = self._spare, None
        try:
            state_copy = Snapshot(spare).take(state)
        except Exception as exc:
            with self._cond:
                self._spare = spare
            raise CheckpointError(f"checkpoint step {step} not saved: cannot copy the state ({type(exc).__name__}: {exc})") from exc
        job = _Job(step, state_copy, started, time.monotonic() - started)
        with self._cond:
            # Not a daemon: at interpreter exit the save in flight completes instead of vanishing.
            writer = threading.Thread(target=self._run, args=(job,), name="trainpod-checkpoint-writer", daemon=False)
            self._job, self._committing = job, True
            try:
                writer.start()
            except RuntimeError as exc:  # "can't start new thread"
                self._job, self._committing, self._spare = None, False, state_copy
                raise CheckpointError(f"checkpoint step {step} not saved: {exc}") from exc

    def wait(self) -> None:
        """Block until every save so far is durable; raise CheckpointError if one failed.

        Deleting the checkpoints beyond `keep` may still be under way; the next save(), close()
        and load_latest() wait for it.
        """
        with self._cond:
            while self._committing:
                self._cond.wait()
            self._raise_error_locked()

    def close(self) -> None:
        """wait(), then release the snapshot buffers; save() is refused afterwards, load_latest() is not."""
        with self._cond:
            self._wait_idle_locked()
            self._closed = True
            self._spare = None
            self._raise_error_locked()

    @property
    def fatal(self) -> CheckpointError | None:
        """A background save's failure that no retry can fix (no space, no permission: exit_code 73),
        from the moment it happened; else None. Neither raises nor clears it: the next save(), wait()
        or close() still raises it. Cheap: a training loop may look after every step."""
        error = self._error
        return error if error is not None and error.exit_code == EXIT_CANTCREAT else None

    def check(self, write: bool = True) -> None:
        """Raise CheckpointError now, not at the first save, if the directory cannot be used.

        Not a directory, a symbolic link loop, unreadable, or an entry named like a checkpoint file
        that is not a regular file: exit_code 78. With `write` (the rank that saves): the directory is
        created if missing and a file is created in it and removed again; no permission is 78, no
        space 73. Deletes nothing else: leftovers of interrupted saves are removed by the first save.
        """
        self._list()
        if not write:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _unusable(self.directory, exc, "create") from None
        try:
            fd, probe = tempfile.mkstemp(dir=self.directory, prefix=files.TEMP_PREFIX + "probe.", suffix=files.TEMP_SUFFIX)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            if exc.errno in NO_SPACE:
                raise CheckpointError(f"cannot write in the checkpoint directory {self.directory}: {exc.strerror}",
                                      exit_code=EXIT_CANTCREAT) from exc
            raise _unusable(self.directory, exc, "write in") from None

    def _list(self) -> list[str]:
        """The directory's names ([] if it does not exist yet); CheckpointError (78) if it cannot be used."""
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError as exc:
            if os.path.islink(self.directory):  # a symbolic link to nothing: mkdir would fail later
                raise _unusable(self.directory, OSError(errno.EEXIST, "File exists"), "use") from exc
            return []
        except OSError as exc:
            raise _unusable(self.directory, exc, "read") from None
        for entry in entries:
            if files.is_checkpoint_name(entry.name) and not entry.is_file():
                kind = "a directory" if entry.is_dir() else "a broken symbolic link" if entry.is_symlink() else "not a regular file"
                raise CheckpointError(
                    f"{self.directory / entry.name} is named like a checkpoint file but is {kind}: move it out of the "
                    "checkpoint directory, or choose another directory", exit_code=EXIT_CONFIG)
        return [entry.name for entry in entries]

    def newest_step(self) -> int | None:
        """The newest step whose save finished (it has a manifest), not verified; None without one.
        Waits for our own save in flight first, as load_latest() does."""
        with self._cond:
            self._wait_idle_locked()
        _, manifest_steps = files.listed_steps(self._list())
        return max(manifest_steps, default=None)

    def load_latest(self) -> tuple[int, Any] | None:
        """(step, state) of the newest checkpoint that verifies, reporting each one skipped; or None."""
        with self._cond:
            self._wait_idle_locked()  # our own saves first; their errors stay for save()/wait()
        names = self._list()
        data_steps, manifest_steps = files.listed_steps(names)
        from_peer = self._load_from_peer(max(manifest_steps, default=None))
        if from_peer is not None:
            return from_peer
        for step in sorted(data_steps | manifest_steps, reverse=True):
            if step not in manifest_steps:
                self._log(f"ignoring {self.directory / files.data_name(step)}: no manifest (its save did not finish)")
                continue
            loaded = self._load(step)
            if loaded is not None:
                self._log(f"resuming from step {step} ({self.directory / files.data_name(step)})")
                progress.committed(step)  # what this attempt starts from: the agent compares it after a failure
                return step, loaded[0]
        self._log(f"no checkpoint in {self.directory}: starting fresh")
        return None

    # --- background writing ---

    def _wait_idle_locked(self) -> None:
        while self._job is not None:
            self._cond.wait()

    def _raise_error_locked(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _prepare(self, step: int) -> None:
        """Create the directory and remove what interrupted saves (a killed writer) left behind."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _unusable(self.directory, exc, "create") from None
        names = self._list()  # an entry named like a checkpoint that is no file is refused here, not unlinked
        removed = 0
        for name in files.leftovers(names):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.directory / name)
                removed += 1
        if removed:
            self._log(f"removed {removed} leftover file(s) of interrupted saves from {self.directory}")
        _, manifest_steps = files.listed_steps(names)
        if manifest_steps and max(manifest_steps) > step:
            # Most likely a directory reused from another run: its checkpoints would win on resume.
            self._log(
                f"note: {self.directory} holds a checkpoint of step {max(manifest_steps)}, later than this save's "
                f"step {step}; load_latest() takes the highest step that verifies"
            )

    def _run(self, job: _Job) -> None:
        error = None
        try:
            self._write(job)
            progress.committed(job.step, save_seconds=time.monotonic() - job.started, stall_seconds=job.stall)
        except BaseException as exc:
            error = self._failure(job, exc)
            self._log(str(error))
        with self._cond:
            if error is not None:
                self._error = error
            self._committing = False  # durable (or failed): wait() may return
            self._cond.notify_all()
        try:
            if error is None:
                # After wait() is released: deleting a large file costs as much as a good part of
                # writing it (freeing its pages and blocks), and is no part of the new one's safety.
                self._retain(job.step)
        finally:
            with self._cond:
                self._spare = job.state  # the next save copies into these buffers
                self._job = None
                self._cond.notify_all()

    def _failure(self, job: _Job, exc: BaseException) -> CheckpointError:
        cause = job.os_error or _find_os_error(exc)
        reason = (cause.strerror or str(cause)) if cause is not None else f"{type(exc).__name__}: {exc}"
        message = f"could not save checkpoint step {job.step} in {self.directory} ({files.data_name(job.step)}): {reason}"
        code = 1
        if cause is not None and cause.errno in NO_SPACE | NO_PERMISSION:
            # Every retry would fail the same way: say what a new run would start from, checked now.
            code = EXIT_CANTCREAT
            fix = "free space there" if cause.errno in NO_SPACE else "make it writable for this user"
            message += f"; {self._intact(job.step)}; {fix} (or use another directory), then run the job again"
        error = CheckpointError(message, exit_code=code)
        error.__cause__ = cause or exc
        return error

    def _intact(self, failed_step: int) -> str:
        """Which earlier checkpoint a new run would resume from, verified (size and sha256) now."""
        try:
            _, manifest_steps = files.listed_steps(os.listdir(self.directory))
        except OSError as exc:
            return f"the directory cannot be listed to check the earlier checkpoints ({exc.strerror})"
        damaged = 0
        for step in sorted(manifest_steps - {failed_step}, reverse=True):
            try:
                files.open_verified(self.directory, step).close()
            except files.Damaged:
                damaged += 1
                continue
            skipped = f" ({damaged} newer one(s) damaged)" if damaged else ""
            return f"the checkpoint of step {step} is intact (verified){skipped}: a new run resumes from it"
        if damaged:
            return f"none of the {damaged} earlier checkpoint(s) verifies: a new run starts from the beginning"
        return "there is no earlier checkpoint: a new run starts from the beginning"

    def _write(self, job: _Job) -> None:
        """Data to a temporary file, fsync, rename, fsync the directory; then the manifest the same way."""
        tmp, size, digest = self._write_temp(job)
        data_path = self.directory / files.data_name(job.step)
        manifest_path = self.directory / files.manifest_name(job.step)
        if manifest_path.exists():
            # Saving a step again: uncommit the old one before its data is replaced, so that a crash
            # in between cannot leave the old manifest next to the new bytes.
            os.unlink(manifest_path)
            fsync_dir(self.directory)
        try:
            os.replace(tmp, data_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        try:
            # The data's new name must be durable before the manifest that points at it is.
            fsync_dir(self.directory)
            manifest = files.new_manifest(job.step, size, digest)
            self._send_copies(manifest, data_path)  # before the commit: no node's memory is behind a disk
            files.write_manifest(self.directory, manifest)
        except BaseException:
            # Uncommitted data is no checkpoint; remove it so that a full disk gets its space back.
            with contextlib.suppress(OSError):
                os.unlink(data_path)
            raise

    def _write_temp(self, job: _Job) -> tuple[str, int, str]:
        """torch.save into a temporary file, fsynced: (its path, its size, its sha256)."""
        directory = self.directory
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{files.data_name(job.step)}.", suffix=files.TEMP_SUFFIX)
        writer = None
        try:
            with open(fd, "wb") as f, _HashingWriter(f) as writer:
                make_shareable(f.fileno())
                torch.save(job.state, writer)
                failpoints.hit("checkpoint-write", job.step, directory)
                writer.flush()
                writer.stop(abort=False)  # the hashing thread reads the tail while fsync runs
                os.fsync(f.fileno())
                size = os.fstat(f.fileno()).st_size
                digest = writer.hexdigest()
            if size != writer.size:
                raise OSError(errno.EIO, f"wrote {writer.size} bytes but the file holds {size}")
        except BaseException:
            if writer is not None:
                job.os_error = writer.os_error
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return tmp, size, digest

    def _retain(self, newest: int) -> None:
        try:
            _, manifest_steps = files.listed_steps(os.listdir(self.directory))
            old = sorted(manifest_steps, reverse=True)[self.keep :]
            for step in old:
                if step == newest:
                    continue
                # Manifest first: a crash in between leaves data without a manifest, which is no
                # checkpoint and is cleaned up later, never a manifest that names a missing file.
                (self.directory / files.manifest_name(step)).unlink(missing_ok=True)
                (self.directory / files.data_name(step)).unlink(missing_ok=True)
        except OSError as exc:
            # The new checkpoint is committed; failing it now would be wrong. Say so once.
            self._log(f"could not delete old checkpoints in {self.directory}: {exc.strerror or exc}")

    # --- peer copies ---

    def _send_copies(self, manifest: dict, path: Path) -> None:
        """Checkpoint `manifest` (its data at `path`) to this node's and the next node's memory (Peer copies), before
        its commit. A failure is said once, until the copies arrive again: the disk holds the checkpoint either way."""
        if self._peers is None:
            return
        step = manifest["step"]
        try:
            addresses = self._peers.send(manifest, path)
        except PeerError as error:
            if not self._copy_failing:
                self._log(f"could not copy the checkpoint of step {step} to the nodes' memory ({error}); the disk holds it")
            self._copy_failing = True
            return
        if self._copy_failing:
            self._log(f"the checkpoint of step {step} is in the nodes' memory again ({', '.join(addresses)})")
        self._copy_failing = False

    def _load_from_peer(self, newest_on_disk: int | None) -> tuple[int, Any] | None:
        """(step, state) of a copy in a peer's memory newer than anything on this disk (or as new, on a node new to the
        job); None where there is none, or it does not arrive whole (said in one line: the disk decides)."""
        if self._peers is None:
            return None
        held = self._peers.newest()
        if held is None or (newest_on_disk is not None and held.step < newest_on_disk):
            return None
        if newest_on_disk == held.step and not self._peers.new_node:
            return None  # as new on disk: a node of the job reads its directory; a new node takes the copy in memory
        started = time.monotonic()
        try:
            data = self._peers.fetch(held)
        except PeerError as error:
            self._log(f"the copy of step {held.step} in node {held.node}'s memory did not arrive whole ({error}): "
                      f"loading from {self.directory}")
            return None
        state = self._unpickle(_named_bytes(data, held))
        on_disk = (f"step {newest_on_disk}" + (" too (a node new to the job reads memory)" if newest_on_disk == held.step else "")
                   if newest_on_disk is not None else "no checkpoint")
        self._log(f"resuming from step {held.step}, the copy in the memory of node {held.node} ({held.address}): "
                  f"{len(data) / 1e6:.1f} MB in {time.monotonic() - started:.2f} s; {self.directory} has {on_disk}")
        progress.committed(held.step)
        return held.step, state

    # --- loading ---

    def _trusting(self, refused: files.Refused) -> None:
        if not self._trust_said:  # once: every load of this Checkpointer is trusted alike
            self._trust_said = True
            self._log(f"{refused.path}: {_holds(refused)}; loading it with the full unpickler, which runs any code "
                      f"a checkpoint carries, as {TRUST_CHECKPOINTS.flag} ({TRUST_CHECKPOINTS.var}) trusts {self.directory}")

    def _load(self, step: int) -> tuple[Any] | None:
        try:
            f = files.open_verified(self.directory, step)
        except files.Damaged as exc:
            self._log(f"skipping {exc}")
            return None
        with f:
            return (self._unpickle(f),)

    def _unpickle(self, f) -> Any:
        """What a verified checkpoint (a file, or a peer's copy) holds."""
        try:
            return files.torch_load(f, trusted=self.trusted, safe_globals=self.safe_globals, on_trust=self._trusting)
        except files.Refused as refused:
            # Deterministic: every rank, every retry refuses it alike; an older checkpoint is no answer
            # either (a silent roll-back, and whoever wrote this one may have written those too).
            raise CheckpointError(_refusal(refused, self.directory), exit_code=EXIT_CONFIG) from None
        except Exception as exc:
            # Not damage (the bytes are those written) but a mismatch with this environment.
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise CheckpointError(
                f"{f.name} matches its manifest's sha256, but torch.load cannot read it here: {type(exc).__name__}: {first}",
                exit_code=EXIT_CONFIG,
            ) from exc


def _named_bytes(data: bytes | bytearray, held: Held) -> io.BytesIO:
    """A peer's copy as a file object whose name the load's messages show."""
    buffer = io.BytesIO(data)
    buffer.name = f"the copy of {files.data_name(held.step)} in the memory of node {held.node} ({held.address})"
    return buffer
