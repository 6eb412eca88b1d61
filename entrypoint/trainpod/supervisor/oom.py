"""The kernel's OOM killer, named: the memory limit of this process's cgroup and how often the OOM killer
struck in it.

A process killed by the OOM killer dies of SIGKILL, as one that a person or a supervisor killed does:
its exit status cannot tell them apart, and a job that ran out of memory used to end in "exited with
137 (SIGKILL)", or in a lost fork server's traceback, without a word about memory. The cgroup can
tell: the kernel counts every process it kills for lack of memory in it.

    cgroup v2   <mount>/<path>/memory.events: "oom_kill N"; the limit: memory.max ("max": none),
                the smallest of this cgroup's and its ancestors' up to the mount (a container's)
    cgroup v1   <mount>/memory/<path>/memory.oom_control: "oom_kill N" (Linux 4.13 and later);
                the limit: memory.limit_in_bytes, or memory.stat's hierarchical_memory_limit if smaller

<path> is this process's cgroup as /proc/self/cgroup gives it ("0::/path" for v2, "N:memory:/path"
for v1). Inside a container the mount shows the container's own cgroup at its root while
/proc/self/cgroup may still give the host's path (cgroup v1, or v2 without a cgroup namespace): the
path's longest tail that exists under the mount is taken (the whole path on a host, "" in such a
container). The ranks, the fork server and the agent share the agent's cgroup unless something moved
them, so the agent reads its own.

The agent reads the count when it starts (Watch) and again when a rank or its fork server died of
SIGKILL: a count that grew since means the OOM killer did it (trainpod.agent.policy says so, with
the limit, exit 137). The supervisor's listener does the same for the agent itself (trainpod.supervisor.supervise).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ROOT = "/sys/fs/cgroup"
SELF = "/proc/self/cgroup"
# restarts.Failure.where of a death by the OOM killer: a second one at the same step is the same failure, whichever
# process it took (trainpod.agent.policy, trainpod.supervisor.supervise)
WHERE = "killed by the kernel's OOM killer"
UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as the largest page-aligned 64-bit value (9223372036854771712)


@dataclass(frozen=True)
class Memory:
    """What the cgroup says of memory."""

    directory: str  # the cgroup's directory
    version: int  # 1 or 2
    limit: int | None  # bytes; None: no limit
    oom_kills: int | None  # processes the OOM killer killed in it so far; None: this kernel does not count them

    @property
    def counter(self) -> str:
        """The file that holds the count."""
        return os.path.join(self.directory, "memory.events" if self.version == 2 else "memory.oom_control")


def read(root: str | os.PathLike = ROOT, cgroup_file: str | os.PathLike = SELF) -> Memory | None:
    """The memory of this process's cgroup (root and cgroup_file: for tests), or None where there is none
    to read (not Linux, no memory controller mounted)."""
    try:
        lines = Path(cgroup_file).read_text().splitlines()
    except OSError:
        return None
    paths = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths[controller] = parts[2]
    root = Path(root)
    if "" in paths and (root / "cgroup.controllers").exists():  # the unified hierarchy, mounted: cgroup v2
        directory = _existing(root, paths[""], "memory.events")
        if directory is not None:
            return Memory(str(directory), 2, _v2_limit(root, directory), _count(directory / "memory.events"))
    if "memory" in paths:
        mount = root / "memory"
        directory = _existing(mount, paths["memory"], "memory.limit_in_bytes")
        if directory is not None:
            return Memory(str(directory), 1, _v1_limit(directory), _count(directory / "memory.oom_control"))
    return None


def _existing(mount: Path, path: str, marker: str) -> Path | None:
    """The directory of cgroup `path` under `mount`: the path's longest tail there that holds `marker`."""
    parts = [part for part in path.split("/") if part]
    for start in range(len(parts) + 1):
        directory = mount.joinpath(*parts[start:])
        if (directory / marker).is_file():
            return directory
    return None


def _number(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None  # v2's "max": no limit


def _v2_limit(mount: Path, directory: Path) -> int | None:
    """The smallest memory.max of the cgroup and its ancestors under the mount (the root has none)."""
    limits = []
    while True:
        try:
            value = _number((directory / "memory.max").read_text())
        except OSError:
            value = None
        if value is not None:
            limits.append(value)
        if directory == mount or mount not in directory.parents:
            break
        directory = directory.parent
    return min(limits, default=None)


def _v1_limit(directory: Path) -> int | None:
    limits = [_number(text) for text in _lines(directory / "memory.limit_in_bytes")[:1]]
    for line in _lines(directory / "memory.stat"):
        key, _, value = line.partition(" ")
        if key == "hierarchical_memory_limit":
            limits.append(_number(value))
    limits = [limit for limit in limits if limit is not None and limit < UNLIMITED]
    return min(limits, default=None)


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def _count(path: Path) -> int | None:
    """The 'oom_kill N' line of memory.events (v2) or memory.oom_control (v1)."""
    for line in _lines(path):
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return _number(value)
    return None


def size(value: int) -> str:
    """'400 MiB', '1.5 GiB'."""
    if value >= 1 << 30:
        return f"{value / (1 << 30):.3g} GiB"
    return f"{value / (1 << 20):.4g} MiB"


def describe(memory: Memory) -> str:
    """'its cgroup's memory limit is 400 MiB, oom_kill 2 in /sys/fs/cgroup/memory.events': the facts of a kill."""
    limit = f"its cgroup's memory limit is {size(memory.limit)}" if memory.limit is not None else "its cgroup has no memory limit"
    return f"{limit}, oom_kill {memory.oom_kills} in {memory.counter}"


class Watch:
    """The cgroup's OOM kills since the last look: started with the count at the time, then killed() after
    each death by SIGKILL."""

    def __init__(self, reader=read):
        self._read = reader
        first = reader()
        self._seen = first.oom_kills if first is not None and first.oom_kills is not None else 0

    def killed(self) -> Memory | None:
        """The cgroup's memory if the OOM killer has killed a process in it since the last look, else None."""
        memory = self._read()
        if memory is None or memory.oom_kills is None:
            return None
        grew = memory.oom_kills > self._seen
        self._seen = max(self._seen, memory.oom_kills)
        return memory if grew else None
