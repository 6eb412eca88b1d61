"""Every node runs the same software: a fingerprint each node publishes at the rendezvous, compared before any rank runs.

A job whose nodes run different code fails in the most confusing ways (a collective that hangs, shapes
that differ, a loss that drifts), and PyTorch checks nothing of it. So each node's agent, after every
rendezvous round, writes its fingerprint into the round's store and reads everyone's; every node
compares the same set and so reaches the same verdict without further talk. `--consistency`:
refuse (the default) ends the job on every node with one line naming the odd node, the field and both
values (78: a deterministic mistake, never retried); warn prints that line and trains; off skips it.

The fingerprint (`explain` shows this node's) is read without importing torch, from what a job's
software is made of:
- trainpod: its version and a digest of the package's files (a patched copy differs);
- python: the interpreter's version;
- torch, cuda, nccl: the installed distributions' versions (torch's local tag names its CUDA build;
  the nvidia-* wheels carry the CUDA runtime and NCCL);
- driver: the NVIDIA kernel driver's version (/proc/driver/nvidia/version), where there is one;
- packages: every installed distribution's name and version, digested. It stands for the image: a
  container cannot see its image's id, but the distributions are what an image gives the job. A
  difference here names the first package that differs;
- script: the user's script (or `-m` module) and the Python files it imports from its own directory and
  the working directory, found by reading their import statements, not by running them; bounded by
  MAX_FILES files and MAX_BYTES bytes (past that, the files the walk reached first are hashed and the field
  says so). A bundled example is trainpod's own code: its name, with the trainpod digest;
- checks: the checks the node runs at the rendezvous (--netcheck, --min-bandwidth, --devcheck). They are
  collective: a node that measured its links while another did not waited out the check's budget, and then
  a healthy node was named as the one that "did not finish the network check".
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trainpod
from trainpod import python_command
from trainpod.agent import round_gather

if TYPE_CHECKING:
    from trainpod.runspec import RunSpec

MODES = ("refuse", "warn", "off")
FIELDS = ("trainpod", "python", "torch", "cuda", "nccl", "driver", "packages", "script", "checks")
SETTINGS_FIELDS = ("checks",)  # the fields that are the run's settings, not its software
MAX_FILES = 500  # a script's local files hashed at most (an import graph larger than this is a package: install it)
MAX_BYTES = 16 << 20
KEY_PREFIX = "trainpod/consistency/"  # + the node's rank in the round, in the round's store
WAIT_S = 60.0  # for the other nodes' fingerprints: they met a moment ago, and each computes its own in well under a second


@dataclass(frozen=True)
class Fingerprint:
    """What one node runs: FIELDS, each a short text; `packages` the distributions it digests."""

    fields: dict[str, str]
    packages: dict[str, str] = field(default_factory=dict)
    host: str = ""

    def to_json(self) -> str:
        return json.dumps({"fields": self.fields, "packages": self.packages, "host": self.host}, sort_keys=True)

    @staticmethod
    def from_json(text: str | bytes) -> Fingerprint:
        data = json.loads(text)
        return Fingerprint(fields=dict(data["fields"]), packages=dict(data.get("packages", {})), host=str(data.get("host", "")))


def _digest(parts: Sequence[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:16]


def package_digest() -> str:
    """trainpod's version and a digest of its .py files (paths and contents)."""
    root = Path(trainpod.__file__).resolve().parent
    files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    parts = [b for p in files for b in (str(p.relative_to(root)).encode(), p.read_bytes())]
    return f"{trainpod.__version__} ({_digest(parts)})"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def distributions(path: Sequence[str] | None = None) -> dict[str, str]:
    """Every installed distribution: normalized name -> version (the first found on sys.path, as import
    would). A wheel's NAME-VERSION.dist-info directory says both, so only other forms (egg-info) are read
    through importlib.metadata: parsing every METADATA file took ten times as long."""
    found: dict[str, str] = {}
    for entry in sys.path if path is None else path:
        try:
            names = sorted(e.name for e in os.scandir(entry or "."))
        except OSError:
            continue
        for name in names:
            stem = name[: -len(".dist-info")]
            if name.endswith(".dist-info") and stem.count("-") == 1:
                dist, version = stem.split("-")
                found.setdefault(_normalized(dist), version)
            elif name.endswith((".dist-info", ".egg-info")):
                try:
                    meta = importlib.metadata.PathDistribution(Path(entry or ".", name))
                    if meta.metadata and meta.metadata["Name"]:
                        found.setdefault(_normalized(meta.metadata["Name"]), meta.version)
                except (OSError, ValueError):
                    continue
    return dict(sorted(found.items()))


def _nvidia(packages: Mapping[str, str], stem: str) -> str:
    versions = sorted(f"{name} {version}" for name, version in packages.items() if name.startswith(f"nvidia-{stem}"))
    return ", ".join(versions) or "none"


def driver_version(path: str = "/proc/driver/nvidia/version") -> str:
    """'580.82.07' from the kernel module's banner, or 'none' without an NVIDIA driver."""
    try:
        first = Path(path).read_text(errors="replace").splitlines()[0]
    except (OSError, IndexError):
        return "none"
    found = re.search(r"Kernel Module(?: for [\w-]+)?\s+([0-9][0-9.]*)", first)
    return found.group(1) if found else first.strip()[:80]


def script_entry(command: Sequence[str]) -> tuple[str, str] | None:
    """("script", PATH) or ("-m", MODULE) for `python [options] train.py ...` / `python -m pkg.mod ...`
    (trainpod.python_command's grammar, CPython's); ("file", PATH) for another command that is a file (a shell
    script); else None."""
    if not command:
        return None
    parsed = python_command.parse(command)
    if parsed is not None:
        return (parsed.kind, parsed.what) if parsed.kind != "-c" else None
    if python_command.is_python(command[0]):
        return None  # python with no script: nothing of the job's own to compare
    return ("file", command[0]) if os.path.isfile(command[0]) else None


def _module_file(name: str, roots: Sequence[Path]) -> Path | None:
    for root in roots:
        base = root.joinpath(*name.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _statements(body: list[ast.stmt]):
    """Every statement, nested ones too (in functions, classes, if/try/with/loops): an import is a statement, so
    expressions, most of a file's nodes, are not walked."""
    for node in body:
        yield node
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            nested = getattr(node, name, None)
            if isinstance(nested, list):
                yield from _statements(nested)


def _imported(path: Path) -> list[tuple[str, int]]:
    """(module name, level) of every import statement in a Python file (all of them, lazy ones too)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return []
    names: list[tuple[str, int]] = []
    for node in _statements(tree.body):
        if isinstance(node, ast.Import):
            names += [(alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names.append((base, node.level))
            names += [(f"{base}.{alias.name}" if base else alias.name, node.level) for alias in node.names]
    return names


def local_files(entry: Path, roots: Sequence[Path]) -> tuple[list[Path], bool]:
    """`entry` and the Python files under `roots` it imports, transitively; (files by path, whether the
    bound cut the walk)."""
    roots = [r.resolve() for r in roots]
    found: dict[Path, None] = {}
    queue, size, cut = [entry.resolve()], 0, False
    while queue:
        path = queue.pop(0)
        if path in found or not path.is_file():
            continue
        file_size = path.stat().st_size
        if len(found) >= MAX_FILES or size + file_size > MAX_BYTES:
            cut = True
            break
        found[path] = None
        size += file_size
        if path.suffix != ".py":
            continue
        for name, level in _imported(path):
            if level:  # relative: from the file's package
                base = path.parents[level - 1]
                target = _module_file(name, [base]) if name else base / "__init__.py"
                if target is not None:
                    queue.append(target)
                continue
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # a.b.c: a's and a.b's __init__ run too
                step = _module_file(".".join(parts[:i]), roots)
                if step is not None and step not in found:
                    queue.append(step)
    return sorted(found, key=str), cut


def script_digest(command: Sequence[str], cwd: Path) -> str:
    """The script field for a command: its files' digest, with how many files; 'none' where it names none."""
    entry = script_entry(command)
    if entry is None:
        return "none (not a Python script or a file)"
    kind, name = entry
    if kind == "-m":
        path = _module_file(name, [cwd])
        if path is None:
            return f"-m {name} (not in the working directory: an installed module, in packages)"
        roots = [cwd]
    else:
        path = (cwd / name) if not os.path.isabs(name) else Path(name)
        if not path.is_file():
            return f"{name} (no such file here)"
        roots = [path.resolve().parent, cwd]
    files, cut = local_files(path, roots)
    digest = _digest([b for p in files for b in (_shown(p, cwd).encode(), p.read_bytes())])
    more = f", the first {len(files)} the walk reached (bounded)" if cut else ""
    return f"{digest} ({len(files)} file(s){more})"


def _shown(path: Path, cwd: Path) -> str:
    """A file's name as digested: relative to the working directory where it is under it (nodes may mount
    the job's code at different places; what it holds counts)."""
    try:
        return str(path.relative_to(cwd.resolve()))
    except ValueError:
        return path.name


def fingerprint(target_module: str | None, command: Sequence[str], cwd: Path | None = None, checks: str = "") -> Fingerprint:
    """This node's fingerprint for a run of an example's module or of a command; `checks`: RunSpec.node_checks()."""
    packages = distributions()
    cwd = Path.cwd() if cwd is None else cwd
    script = f"example module {target_module} (trainpod's own code)" if target_module else script_digest(command, cwd)
    fields = {
        "trainpod": package_digest(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "torch": packages.get("torch", "none"),
        "cuda": _nvidia(packages, "cuda-runtime"),
        "nccl": _nvidia(packages, "nccl"),
        "driver": driver_version(),
        "packages": f"{_digest([f'{n}=={v}'.encode() for n, v in packages.items()])} ({len(packages)} distributions)",
        "script": script,
        "checks": checks,
    }
    return Fingerprint(fields=fields, packages=packages, host=socket.gethostname())


def of_run(run: RunSpec) -> Fingerprint:
    """This node's fingerprint for `run`: its target, and the node checks it runs with the others."""
    return fingerprint(run.target.module, run.target.command, checks=run.node_checks())


class Pending:
    """of_run() computed on a daemon thread from now on; result() waits for it (an error in it is raised there)."""

    def __init__(self, run: RunSpec):
        self._value: Fingerprint | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(run,), daemon=True, name="trainpod-fingerprint")
        self._thread.start()

    def _run(self, run: RunSpec) -> None:
        try:
            self._value = of_run(run)
        except BaseException as error:  # handed to result()
            self._error = error

    def result(self) -> Fingerprint:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value


def _nodes(ranks: Sequence[int], prints: Mapping[int, Fingerprint]) -> str:
    words = [f"{rank} ({prints[rank].host})" if prints[rank].host else str(rank) for rank in sorted(ranks)]
    return ("node " if len(words) == 1 else "nodes ") + ", ".join(words)


def _package_difference(groups: list[list[int]], prints: Mapping[int, Fingerprint]) -> str:
    """' (numpy 2.1.0 on ..., 2.2.0 on ...)': the first distribution whose version differs between the first two groups."""
    a, b = prints[groups[0][0]].packages, prints[groups[1][0]].packages
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            return f": {name} {a.get(name, 'absent')} against {b.get(name, 'absent')}"
    return ""


def verdict(prints: Mapping[int, Fingerprint]) -> str | None:
    """None when every node's fingerprint is the same; else one line: the first field that differs, and who
    runs what. The largest group is the norm where there is one; the others are named as the odd ones."""
    for name in FIELDS:
        by_value: dict[str, list[int]] = {}
        for rank in sorted(prints):
            by_value.setdefault(prints[rank].fields.get(name, "absent"), []).append(rank)
        if len(by_value) < 2:
            continue
        groups = sorted(by_value.values(), key=lambda ranks: (-len(ranks), ranks[0]))
        value = {tuple(ranks): v for v, ranks in by_value.items()}
        extra = _package_difference(groups, prints) if name == "packages" else ""
        what = "node checks" if name in SETTINGS_FIELDS else "software"
        if len(groups[0]) > len(groups[1]):
            odd = [r for g in groups[1:] for r in g]
            there = "; ".join(f"{value[tuple(g)]!r} on {_nodes(g, prints)}" for g in groups[1:])
            verb = "runs" if len(odd) == 1 else "run"
            return (f"{_nodes(odd, prints)} {verb} other {what} than the rest: {name} {there}, "
                    f"{value[tuple(groups[0])]!r} on {_nodes(groups[0], prints)}{extra}")
        there = "; ".join(f"{value[tuple(g)]!r} on {_nodes(g, prints)}" for g in groups)
        return f"the nodes run different {what}: {name} {there}{extra}"
    return None


def remedy(line: str) -> str:
    """What makes the nodes of a verdict's `line` agree."""
    if "node checks" in line.split(":", 1)[0]:
        return "give every node the same --netcheck, --min-bandwidth, --devcheck and --peer-copies"
    return "give every node the same software"


def exchange(store, rank: int, world: int, mine: Fingerprint, wait_s: float = WAIT_S) -> dict[int, Fingerprint]:
    """Publish this node's fingerprint in the round's store and read every node's (torch's Store API)."""
    found = round_gather.all_gather(store, KEY_PREFIX, rank, world, mine.to_json(), wait_s)
    return {other: Fingerprint.from_json(text) for other, text in found.items()}
