"""Files that readers see whole or not at all, and that survive a crash once written."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make the renames and unlinks in directory durable (file fsync does not cover the name)."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some network and FUSE file systems refuse fsync on a directory; there is nothing more to do.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def make_shareable(fd: int) -> None:
    # mkstemp makes files 0600; a shared directory (checkpoints, metrics) is read by other ranks and
    # tools, which may run as another user on another host.
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, temp_suffix: str = ".tmp") -> Path:
    """Write data to path via a temporary file in the same directory: fsync, rename, fsync the directory."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=temp_suffix)
    try:
        with open(fd, "wb") as f:
            make_shareable(f.fileno())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path
