"""trainpod.agent.consistency: each node's fingerprint, the verdict over all of them, the exchange in a real store."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from trainpod.agent import consistency
from trainpod.agent.consistency import Fingerprint, verdict

BASE = {"trainpod": "0.1.0 (aaaa)", "python": "CPython 3.11.7", "torch": "2.13.0+cpu", "cuda": "none", "nccl": "none",
        "driver": "none", "packages": "bbbb (140 distributions)", "script": "cccc (2 file(s))"}


def node(host: str, installed: dict[str, str] | None = None, **fields: str) -> Fingerprint:
    return Fingerprint(fields={**BASE, **fields}, packages=installed or {"torch": "2.13.0+cpu"}, host=host)


def test_the_same_software_everywhere_is_no_verdict():
    assert verdict({0: node("a"), 1: node("b"), 2: node("c")}) is None


def test_one_odd_node_of_three_is_named_with_the_field_and_both_values():
    line = verdict({0: node("a"), 1: node("b", torch="2.12.0+cpu"), 2: node("c")})
    assert line == ("node 1 (b) runs other software than the rest: torch '2.12.0+cpu' on node 1 (b), "
                    "'2.13.0+cpu' on nodes 0 (a), 2 (c)")


def test_two_nodes_that_differ_are_both_named_and_the_first_field_in_order_decides():
    line = verdict({0: node("a", script="dddd (1 file(s))", python="CPython 3.12.1"), 1: node("b")})
    assert line is not None and line.startswith("the nodes run different software: python ")
    assert "'CPython 3.12.1' on node 0 (a)" in line and "'CPython 3.11.7' on node 1 (b)" in line


def test_a_difference_in_packages_names_the_first_package_that_differs():
    line = verdict({0: node("a", {"numpy": "2.1.0", "torch": "2.13.0"}),
                    1: node("b", {"numpy": "2.1.0", "torch": "2.13.0"}),
                    2: node("c", {"numpy": "2.2.0", "torch": "2.13.0"}, packages="eeee (140 distributions)")})
    assert line is not None and line.endswith(": numpy 2.1.0 against 2.2.0") and "node 2 (c)" in line


def test_the_fingerprint_survives_the_store_as_json():
    mine = consistency.fingerprint("trainpod.examples.cifar10", ())
    assert Fingerprint.from_json(mine.to_json()) == mine
    assert set(mine.fields) == set(consistency.FIELDS)
    assert mine.fields["script"] == "example module trainpod.examples.cifar10 (trainpod's own code)"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_script_digest_covers_the_local_files_it_imports_and_nothing_else(tmp_path):
    code = tmp_path / "code"
    train = write(code / "train.py", "import os\nimport numpy\nimport helpers\nfrom model import net\n"
                                     "def main():\n    import lazy\n")
    write(code / "helpers.py", "X = 1\n")
    write(code / "model" / "__init__.py", "from .net import Net\n")
    write(code / "model" / "net.py", "from . import layers\n")
    write(code / "model" / "layers.py", "")
    write(code / "lazy.py", "")
    write(code / "unused.py", "")
    files, cut = consistency.local_files(train, [code])
    assert [p.relative_to(code).as_posix() for p in files] == [
        "helpers.py", "lazy.py", "model/__init__.py", "model/layers.py", "model/net.py", "train.py"] and not cut
    before = consistency.script_digest(["python", "-u", "code/train.py", "--epochs", "1"], tmp_path)
    assert before.endswith("(6 file(s))")
    (code / "unused.py").write_text("changed = True\n")
    assert consistency.script_digest(["python", "code/train.py"], tmp_path) == before  # not imported: not counted
    (code / "model" / "layers.py").write_text("changed = True\n")
    assert consistency.script_digest(["python", "code/train.py"], tmp_path) != before


def test_the_walk_is_bounded_and_says_so(tmp_path, monkeypatch):
    train = write(tmp_path / "train.py", "import a\nimport b\nimport c\n")
    for name in "abc":
        write(tmp_path / f"{name}.py", "")
    monkeypatch.setattr(consistency, "MAX_FILES", 2)
    files, cut = consistency.local_files(train, [tmp_path])
    assert len(files) == 2 and cut
    assert consistency.script_digest(["python", "train.py"], tmp_path).endswith("(2 file(s), the first 2 the walk reached (bounded))")


def test_a_module_a_file_and_no_script(tmp_path):
    write(tmp_path / "pkg" / "__init__.py", "")
    write(tmp_path / "pkg" / "train.py", "from pkg import data\n")
    write(tmp_path / "pkg" / "data.py", "")
    assert consistency.script_digest(["python3", "-m", "pkg.train"], tmp_path).endswith("(3 file(s))")
    assert consistency.script_digest(["python3", "-m", "somewhere.else"], tmp_path).startswith("-m somewhere.else (not in")
    run = write(tmp_path / "run.sh", "#!/bin/sh\n")
    assert consistency.script_digest([str(run)], tmp_path).endswith("(1 file(s))")
    assert consistency.script_digest(["sleep", "1"], tmp_path).startswith("none")
    assert consistency.script_digest(["python", "missing.py"], tmp_path) == "missing.py (no such file here)"


def test_distributions_from_wheel_directories_and_egg_info(tmp_path):
    (tmp_path / "torch-2.13.0+cpu.dist-info").mkdir()
    (tmp_path / "Typing_Extensions-4.12.2.dist-info").mkdir()
    write(tmp_path / "old.egg-info" / "PKG-INFO", "Metadata-Version: 1.1\nName: Old.Thing\nVersion: 0.9\n")
    (tmp_path / "not_a_dist").mkdir()
    assert consistency.distributions([str(tmp_path)]) == {"old-thing": "0.9", "torch": "2.13.0+cpu",
                                                         "typing-extensions": "4.12.2"}


@pytest.mark.parametrize("banner, version", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023", "535.104.05"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  (dvs-builder@U16-I3-B03-4-3)  "
     "Thu Jan 16 06:11:03 UTC 2025", "570.86.15"),
])
def test_the_drivers_version_from_its_banner(tmp_path, banner, version):
    path = write(tmp_path / "version", banner + "\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    assert consistency.driver_version(str(path)) == version
    assert consistency.driver_version(str(tmp_path / "none")) == "none"


def test_nodes_exchange_their_fingerprints_in_a_real_tcp_store():
    from torch.distributed import TCPStore

    host = TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    prints = {0: node("a"), 1: node("b", torch="2.12.0+cpu"), 2: node("c")}
    seen: dict[int, dict] = {}

    def member(rank: int) -> None:
        store = host if rank == 0 else TCPStore("127.0.0.1", host.port, 3, is_master=False)
        seen[rank] = consistency.exchange(store, rank, 3, prints[rank], wait_s=30)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in (2, 1, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert seen == {0: prints, 1: prints, 2: prints}  # every node reads the same set, so reaches the same verdict
    assert "node 1 (b)" in verdict(seen[0])


def test_the_script_is_found_in_pythons_own_grammar():
    assert consistency.script_entry(["python3", "-W", "ignore", "-O", "train.py", "--lr", "1"]) == ("script", "train.py")
    assert consistency.script_entry(["python3", "-Xdev", "-m", "pkg.train"]) == ("-m", "pkg.train")
    assert consistency.script_entry(["/usr/bin/python3", "-c", "print(1)"]) is None  # not a file of the job's


def test_a_node_with_other_node_checks_is_named_with_the_flags_that_make_them_agree():
    # A node that measured its links while the other did not waited out the check's budget, then named the healthy one.
    checks = "--netcheck on --min-bandwidth 0.5 --devcheck off"
    line = verdict({0: node("a", checks=checks), 1: node("b", checks="--netcheck off --devcheck off"), 2: node("c", checks=checks)})
    assert line == ("node 1 (b) runs other node checks than the rest: checks '--netcheck off --devcheck off' on node 1 (b), "
                    f"'{checks}' on nodes 0 (a), 2 (c)")
    assert consistency.remedy(line) == "give every node the same --netcheck, --min-bandwidth, --devcheck and --peer-copies"
    software = verdict({0: node("a", torch="2.12.0+cpu"), 1: node("b")})
    assert software is not None and consistency.remedy(software) == "give every node the same software"
