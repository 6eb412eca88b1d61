"""trainpod.python_command reads `python ...` as CPython does: each parse here is also run by this Python, whose own
sys.argv, warnings and -X options say what it made of the same words."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainpod.python_command import PythonCommand, is_python, parse

SHOW = "import json, sys; print(json.dumps([sys.argv, sys.warnoptions, sorted(sys._xoptions), sys.flags.optimize]))"

CASES = {
    "a script": (["python3", "train.py", "--lr", "1"], ("script", "train.py", 1, ("--lr", "1"), "", ())),
    "a module after a flag": (["python3", "-u", "-m", "pkg.train", "-x"], ("-m", "pkg.train", 3, ("-x",), "u", ())),
    "-m in a cluster of flags": (["python3", "-uBm", "pkg.train"], ("-m", "pkg.train", 2, (), "uB", ())),
    "-m with its module in the word": (["python3", "-mpkg.train", "a"], ("-m", "pkg.train", 1, ("a",), "", ())),
    "-W and -O, then a script": (["python3", "-W", "ignore", "-O", "train.py"],
                                 ("script", "train.py", 4, (), "O", (("-W", "ignore"),))),
    "-W and -X with their values in the word": (["python3", "-Wignore", "-Xutf8", "train.py", "-m", "x"],
                                                ("script", "train.py", 3, ("-m", "x"), "", (("-W", "ignore"), ("-X", "utf8")))),
    "-c after -X": (["python3", "-X", "utf8", "-c", SHOW, "a"], ("-c", SHOW, 4, ("a",), "", (("-X", "utf8"),))),
    "-- before a script named like an option": (["python3", "--", "-train.py", "-u"], ("script", "-train.py", 2, ("-u",), "", ())),
    "--check-hash-based-pycs and its value": (["python3", "--check-hash-based-pycs", "always", "train.py"],
                                              ("script", "train.py", 3, (), "", (("--check-hash-based-pycs", "always"),))),
}


@pytest.mark.parametrize("case", CASES)
def test_a_command_parses_as_cpython_runs_it(tmp_path, case):
    command, (kind, what, index, argv, flags, valued) = CASES[case]
    parsed = parse(command)
    assert parsed == PythonCommand(kind, what, index, argv, frozenset(flags), valued)
    assert command[index].endswith(what)  # the word that holds it
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    for script in ("train.py", "-train.py", "pkg/train.py"):
        (tmp_path / script).write_text(SHOW)
    ran = subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    sys_argv, warnoptions, xoptions, optimize = json.loads(ran.stdout)
    assert sys_argv[1:] == list(parsed.argv)
    assert sys_argv[0] == {"script": what, "-m": str(tmp_path / "pkg" / "train.py"), "-c": "-c"}[kind]
    assert warnoptions == [value for option, value in valued if option == "-W"]
    assert xoptions == [value for option, value in valued if option == "-X"]
    assert optimize == ("O" in flags)


@pytest.mark.parametrize("command", [
    ["python3"], ["python3", "-"], ["python3", "-u", "-"],  # stdin
    ["python3", "-h"], ["python3", "--version"], ["python3", "-V", "train.py"],  # nothing runs
    ["python3", "-W"], ["python3", "-m"], ["python3", "--check-hash-based-pycs"],  # python: "Argument expected"
    ["python3", "--frobnicate", "train.py"], ["python3", "-Z", "train.py"],  # not CPython's: left to it to say
    ["bash", "train.py"], ["python3-config", "--libs"], [],  # not a python
])
def test_what_names_no_script_module_or_code_is_none(command):
    assert parse(command) is None


def test_a_python_is_named_python_with_a_version_at_most():
    assert all(is_python(word) for word in ("python", "python3", "python3.11", "/usr/bin/python3.12", "venv/bin/python"))
    assert not any(is_python(word) for word in ("python3-config", "python3-dbg", "ipython", "pythonw", "/usr/bin/py"))
