"""A checkpoint on disk: its file names, its manifest, and reading it back only once it verifies.

Step N is `ckpt-0000000N.pt` (what torch.save wrote) plus `ckpt-0000000N.json`, its manifest (the
commit point); temporary files are `.ckpt-*.tmp`. Only canonical names count: `ckpt-1.pt` or a
manifest that names another file is no part of any checkpoint.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch

from trainpod.atomic import write_bytes_atomic

FORMAT = "trainpod-checkpoint"
VERSION = 1
TEMP_PREFIX = ".ckpt-"
TEMP_SUFFIX = ".tmp"

_NAME = re.compile(r"ckpt-(\d+)\.(pt|json)")
_READ_CHUNK = 4 << 20


class Damaged(Exception):
    """A checkpoint that does not verify; the message is "PATH: what is wrong", one line."""


def data_name(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


def manifest_name(step: int) -> str:
    return f"ckpt-{step:08d}.json"


def listed_steps(names: list[str]) -> tuple[set[int], set[int]]:
    """The steps that have a data file and those that have a manifest, by canonical name only."""
    data, manifests = set(), set()
    for name in names:
        match = _NAME.fullmatch(name)
        if not match:
            continue
        step = int(match.group(1))
        if match.group(2) == "pt" and name == data_name(step):
            data.add(step)
        elif match.group(2) == "json" and name == manifest_name(step):
            manifests.add(step)
    return data, manifests


def is_checkpoint_name(name: str) -> bool:
    """A name this module writes: a canonical data file or manifest, or a temporary file of a save."""
    return bool(_NAME.fullmatch(name)) or (name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX))


def leftovers(names: list[str]) -> list[str]:
    """What interrupted saves left among `names`: temporary files, then data without a manifest."""
    data_steps, manifest_steps = listed_steps(names)
    found = [n for n in names if n.startswith(TEMP_PREFIX) and n.endswith(TEMP_SUFFIX)]
    return found + [data_name(step) for step in sorted(data_steps - manifest_steps)]


def new_manifest(step: int, size: int, digest: str) -> dict:
    """The manifest of checkpoint `step`: what its data file must be."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "file": data_name(step),
        "size": size,
        "sha256": digest,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
    }


def write_manifest(directory: Path, manifest: dict) -> None:
    """Commit a checkpoint: its manifest via a temporary file, fsync, rename, fsync the directory."""
    path = directory / manifest_name(manifest["step"])
    write_bytes_atomic(path, (json.dumps(manifest, indent=2) + "\n").encode(), temp_suffix=TEMP_SUFFIX)


def read_manifest(path: Path, step: int) -> dict:
    with open(path, "rb") as f:
        manifest = json.loads(f.read().decode())
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise ValueError(f"format version {manifest.get('version')!r}, this trainpod reads {VERSION}")
    if manifest.get("step") != step or manifest.get("file") != data_name(step):
        raise ValueError(f"it describes step {manifest.get('step')!r}, file {manifest.get('file')!r}")
    size, digest = manifest.get("size"), manifest.get("sha256")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"bad size {size!r}")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ValueError(f"bad sha256 {digest!r}")
    return manifest


def open_verified(directory: Path, step: int) -> BinaryIO:
    """Checkpoint `step`'s data file, open, once its manifest, size and sha256 check out; else Damaged."""
    manifest_path = directory / manifest_name(step)
    data_path = directory / data_name(step)
    try:
        manifest = read_manifest(manifest_path, step)
    except (OSError, ValueError) as exc:
        raise Damaged(f"{manifest_path}: unreadable manifest ({exc})") from exc
    try:
        f = open(data_path, "rb")  # noqa: SIM115 (returned open, closed here if it does not verify)
    except FileNotFoundError:
        raise Damaged(f"{data_path}: missing, though its manifest names it") from None
    except OSError as exc:
        raise Damaged(f"{data_path}: cannot open it ({exc.strerror})") from exc
    try:
        _verify(f, data_path, manifest)
    except BaseException:
        f.close()
        raise
    return f


def _verify(f: BinaryIO, path: Path, manifest: dict) -> None:
    size, expected_size = os.fstat(f.fileno()).st_size, manifest["size"]
    if size != expected_size:
        what = "truncated" if size < expected_size else "size mismatch"
        raise Damaged(f"{path}: {what} ({size} bytes, its manifest says {expected_size})")
    try:
        digest = sha256_file(f)
    except OSError as exc:
        raise Damaged(f"{path}: cannot read it ({exc.strerror})") from exc
    expected_digest = manifest["sha256"]
    if digest != expected_digest:
        raise Damaged(f"{path}: corrupt (sha256 mismatch: {digest[:12]}..., its manifest says {expected_digest[:12]}...)")


def sha256_file(f: BinaryIO) -> str:
    h = hashlib.sha256()
    buffer = bytearray(_READ_CHUNK)
    view = memoryview(buffer)
    while True:
        n = f.readinto(buffer)
        if not n:
            return h.hexdigest()
        h.update(view[:n])


class Refused(Exception):
    """A verified checkpoint that the weights-only unpickler refused; `what` names what it holds."""

    def __init__(self, path: str, what: str, is_global: bool):
        super().__init__(f"{path}: {what}")
        self.path, self.what, self.is_global = path, what, is_global


# torch names a refused global in its message ("GLOBAL posix.system whose module posix is blocked",
# "Unsupported global: GLOBAL argparse.Namespace was not an allowed global by default").
_GLOBAL = re.compile(r"\bGLOBAL ([A-Za-z_][\w.]*[\w])")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# torch's advice around the reason ("Re-running `torch.load` with `weights_only` set to `False` will
# likely succeed"): advice to run the file's code, which is exactly what trainpod does not do unasked.
_BOILERPLATE = ("Weights only load failed", "Check the documentation", "(1) ", "(2) ", "In PyTorch 2.6", "Please file an issue")
_REASON = "WeightsUnpickler error:"


def refused_what(message: str) -> tuple[str, bool]:
    """(what the weights-only unpickler refused, whether it is a global) from torch's UnpicklingError text:
    the global it names, else its reason ("Unsupported operand 110": no pickle it reads)."""
    message = _ANSI.sub("", message)
    found = _GLOBAL.search(message)
    if found:
        return found.group(1), True
    for line in message.splitlines():
        line = line.strip()
        if _REASON in line:
            line = line.partition(_REASON)[2].strip()
        if line and not line.startswith(_BOILERPLATE):
            return line, False
    return "no reason given", False


def torch_load(f: BinaryIO, *, trusted: bool = False, safe_globals: tuple = (),
               on_trust: Callable[[Refused], None] | None = None) -> Any:
    """What torch.save wrote to f, tensors on the CPU, by torch's weights-only unpickler: tensors,
    plain values and the types in `safe_globals` (registered for this load only). Anything else
    raises Refused, unless `trusted`: then on_trust(the refusal) and the full unpickler, which runs
    whatever code the file carries (see the manual: trainpod.train.checkpoint's docstring)."""
    f.seek(0)
    # Only what torch does not know yet, and only while this load runs: the context manager's exit
    # removes what it added, which would also drop a global the script had registered itself.
    added = [g for g in safe_globals if g not in torch.serialization.get_safe_globals()]
    try:
        with torch.serialization.safe_globals(added):
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = Refused(getattr(f, "name", "checkpoint"), *refused_what(str(exc)))
    if not trusted:
        raise refused
    if on_trust is not None:
        on_trust(refused)
    f.seek(0)
    return torch.load(f, map_location="cpu", weights_only=False)
