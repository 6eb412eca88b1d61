"""What `python [options] ...` runs, read as CPython reads its command line: the one parser behind the launcher's
check of the user's command (trainpod.launcher.command), the agent's warm starts (trainpod.agent.warm) and the
consistency check's look at the job's own script (trainpod.agent.consistency).

CPython's grammar, as its getopt reads it: options come first, each word a cluster of one-letter flags (`-uB`);
-W and -X take a value (the rest of the word, else the next word: `-Wignore`, `-X dev`), and so do -c and -m, which
also end the options (`-um pkg.train`, `-mpkg.train`, `-c CODE`): what follows is the program's argv. `--` ends the
options too; `-`, or nothing, is stdin. A long option other than --check-hash-based-pycs (with its value) is --help
or --version (nothing runs), or one this does not know: a newer or older python's, which is left to it to speak of.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

_PYTHON = re.compile(r"python[0-9.]*")  # python, python3, python3.12 (not python3-config, python3-dbg)
_FLAGS = frozenset("bBdEiIOPqRsSuvx")  # CPython's options without a value (-h, -V, -?: nothing runs)
_VALUED = frozenset("WX")  # options with a value that do not end the options
_LONG_VALUED = frozenset({"--check-hash-based-pycs"})


def is_python(word: str) -> bool:
    """Whether a command's first word names a Python interpreter (python, python3, /usr/bin/python3.11, ...)."""
    return bool(_PYTHON.fullmatch(os.path.basename(word)))


@dataclass(frozen=True)
class PythonCommand:
    """`python [options] SCRIPT|-m MODULE|-c CODE [argv ...]`, parsed."""

    kind: str  # "script", "-m" or "-c"
    what: str  # the script's path, the module's name or the code
    index: int  # the word that holds `what` in the command (python is word 0)
    argv: tuple[str, ...]  # the words after it: the program's own arguments
    flags: frozenset[str]  # the value-less options given, as letters ("u", "B", ...)
    valued: tuple[tuple[str, str], ...]  # the options given with a value: ("-W", "ignore"), ("-X", "dev"), ...


def parse(command: Sequence[str]) -> PythonCommand | None:
    """`command` as CPython would read it when its first word names a python; None where it does not, or where no
    script, module or code is named (stdin, --help, --version, a missing value) or an option is not CPython's."""
    if not command or not is_python(command[0]):
        return None
    flags: set[str] = set()
    valued: list[tuple[str, str]] = []
    i = 1
    while i < len(command):
        word = command[i]
        if word == "--":
            i += 1
            break
        if word == "-" or not word.startswith("-"):
            break
        if word.startswith("--"):
            if word in _LONG_VALUED and i + 1 < len(command):
                valued.append((word, command[i + 1]))
                i += 2
                continue
            return None  # --help, --version: nothing runs; or an option this does not know
        for j in range(1, len(word)):
            letter = word[j]
            if letter in _VALUED or letter in "cm":  # the value: the rest of the word, else the next word
                value = word[j + 1:]
                if not value:
                    i += 1
                    if i >= len(command):
                        return None  # python says "Argument expected"
                    value = command[i]
                if letter in "cm":
                    return PythonCommand(f"-{letter}", value, i, tuple(command[i + 1:]), frozenset(flags), tuple(valued))
                valued.append((f"-{letter}", value))
                break
            if letter not in _FLAGS:
                return None  # -h, -V, -?, or an option this python may not have
            flags.add(letter)
        i += 1
    if i >= len(command) or command[i] == "-":
        return None  # stdin
    return PythonCommand("script", command[i], i, tuple(command[i + 1:]), frozenset(flags), tuple(valued))
