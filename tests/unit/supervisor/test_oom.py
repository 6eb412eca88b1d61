"""trainpod.supervisor.oom: the cgroup's memory limit and OOM kills, read from the kernel's files as cgroup v2 and v1 lay
them out (written to a directory here), from where /proc/self/cgroup says this process is."""

from pathlib import Path

from trainpod.supervisor import oom

CONTAINER = "/docker/33a1966f5236"


def write(directory: Path, files: dict[str, str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


def events(kills: int) -> str:
    return f"low 0\nhigh 0\nmax 12\noom {kills}\noom_kill {kills}\noom_group_kill 0\n"


def proc_cgroup(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "proc-self-cgroup"
    path.write_text(text)
    return path


def v2(tmp_path: Path) -> Path:
    """A cgroup v2 host: the root (no memory.max there), a slice with a limit, the job's cgroup below it without."""
    root = write(tmp_path / "cgroup2", {"cgroup.controllers": "cpu memory pids\n"})
    write(root / "job.slice", {"memory.max": str(400 << 20) + "\n", "memory.events": events(0)})
    write(root / "job.slice" / "run-1.scope", {"memory.max": "max\n", "memory.events": events(2)})
    return root


def test_cgroup_v2_the_smallest_limit_up_the_tree_and_the_cgroups_own_kills(tmp_path):
    root = v2(tmp_path)
    memory = oom.read(root, proc_cgroup(tmp_path, "0::/job.slice/run-1.scope\n"))
    assert memory == oom.Memory(str(root / "job.slice" / "run-1.scope"), 2, 400 << 20, 2)
    assert oom.describe(memory) == (f"its cgroup's memory limit is 400 MiB, oom_kill 2 in "
                                    f"{root}/job.slice/run-1.scope/memory.events")


def test_cgroup_v2_in_a_container_whose_mount_is_its_own_cgroup(tmp_path):
    # Without a cgroup namespace /proc/self/cgroup gives the host's path; the mount shows the container's cgroup.
    root = write(tmp_path / "cgroup2", {"cgroup.controllers": "memory\n", "memory.max": str(1 << 30),
                                        "memory.events": events(1)})
    assert oom.read(root, proc_cgroup(tmp_path, f"0::{CONTAINER}\n")) == oom.Memory(str(root), 2, 1 << 30, 1)
    assert oom.read(root, proc_cgroup(tmp_path, "0::/\n")) == oom.Memory(str(root), 2, 1 << 30, 1)  # with a namespace


def test_cgroup_v1_in_a_container_with_the_limit_and_oom_control(tmp_path):
    # docker on cgroup v1: memory's mount is the container's cgroup, /proc/self/cgroup names the host's path.
    root = tmp_path / "cgroup"
    write(root / "memory", {"memory.limit_in_bytes": f"{400 << 20}\n", "memory.stat": "cache 0\nhierarchical_memory_limit "
                            f"{400 << 20}\n", "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"})
    write(root / "unified", {})  # a hybrid host: the unified hierarchy without a memory controller
    cgroups = proc_cgroup(tmp_path, f"12:pids:{CONTAINER}\n4:memory:{CONTAINER}\n1:name=systemd:{CONTAINER}\n0::{CONTAINER}\n")
    memory = oom.read(root, cgroups)
    assert memory == oom.Memory(str(root / "memory"), 1, 400 << 20, 3)
    assert oom.describe(memory).endswith(f"oom_kill 3 in {root}/memory/memory.oom_control")


def test_cgroup_v1_on_a_host_without_a_limit_but_a_parents(tmp_path):
    root = tmp_path / "cgroup"
    unlimited = "9223372036854771712\n"  # what v1 writes for none
    write(root / "memory" / "batch" / "job7", {"memory.limit_in_bytes": unlimited, "memory.oom_control": "oom_kill 0\n",
                                               "memory.stat": f"hierarchical_memory_limit {3 << 30}\n"})
    assert oom.read(root, proc_cgroup(tmp_path, "6:memory:/batch/job7\n")).limit == 3 << 30
    write(root / "memory" / "batch" / "job7", {"memory.stat": f"hierarchical_memory_limit {unlimited}"})
    memory = oom.read(root, proc_cgroup(tmp_path, "6:memory:/batch/job7\n"))
    assert memory.limit is None and oom.describe(memory).startswith("its cgroup has no memory limit, oom_kill 0")


def test_no_cgroup_to_read(tmp_path):
    assert oom.read(tmp_path, tmp_path / "missing") is None
    assert oom.read(tmp_path, proc_cgroup(tmp_path, "0::/\n")) is None  # nothing mounted there
    old = write(tmp_path / "old" / "memory", {"memory.limit_in_bytes": "1048576\n", "memory.oom_control": "under_oom 0\n"})
    memory = oom.read(old.parent, proc_cgroup(tmp_path, "3:memory:/\n"))
    assert memory == oom.Memory(str(old), 1, 1 << 20, None)  # a kernel before 4.13 counts no kills


def test_the_watch_names_only_kills_since_its_last_look(tmp_path):
    root = v2(tmp_path)
    cgroups = proc_cgroup(tmp_path, "0::/job.slice/run-1.scope\n")
    watch = oom.Watch(lambda: oom.read(root, cgroups))  # 2 kills before the agent started: not its ranks'
    assert watch.killed() is None
    (root / "job.slice" / "run-1.scope" / "memory.events").write_text(events(3))
    assert watch.killed().oom_kills == 3
    assert watch.killed() is None  # the same kill is named once
    assert oom.Watch(lambda: None).killed() is None


def test_sizes():
    assert oom.size(400 << 20) == "400 MiB"
    assert oom.size(1536 << 20) == "1.5 GiB"
    assert oom.size(80 << 30) == "80 GiB"
