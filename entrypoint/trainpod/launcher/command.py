"""The user's command (`trainpod run -- COMMAND ...`), checked before anything starts: what it runs exists and can
be run here, as every rank would run it. A mistake there is the same on every rank of every node, and restarting
cannot mend it: one line and 64 now, instead of one failure per rank after the job started, restarted.

What is checked: the program (on PATH, executable, not a directory); the interpreter a script's #! line names
(the kernel's "No such file" names the script instead); the script or module `python [options]` runs, read in
CPython's own command-line grammar (-X and -W take a value, -c has no script, `-` is stdin), the module looked
up where the ranks' python will look (their working directory and PYTHONPATH are the launcher's) without running
a package's code; the script a shell (bash, sh, dash, zsh) is given. What this cannot tell for sure (another
interpreter's modules, a package whose __init__ makes its submodules, env's options in a #! line) it leaves to
the ranks: a command refused here that would have run is worse than a failure found late.
"""

from __future__ import annotations

import errno
import importlib.machinery
import os
import re
import shutil
import stat
import sys
from collections.abc import Mapping, Sequence

from trainpod.errors import UsageError
from trainpod.python_command import is_python, parse

_SHELLS = frozenset({"bash", "sh", "dash", "zsh"})
_SHELL_VALUED_LONG = frozenset({"rcfile", "init-file", "emulate"})  # bash's and zsh's long options with a value
_SHEBANG_BYTES = 256  # what Linux reads of a #! line (BINPRM_BUF_SIZE)
# What a package's __init__ may do so that a submodule is found where no file says: this check then stays out.
_DYNAMIC_PACKAGE = re.compile(rb"__path__|sys\.modules|extend_path")


def check_command(command: Sequence[str], env: Mapping[str, str]) -> None:
    """The user's command exists and is executable here (as torchrun's --no-python will run it), and what it
    runs can be: the interpreter of a script's #! line, the script or module a `python [options]` names (in
    CPython's own grammar), the script a shell (bash, sh, dash, zsh) is given. A usage error (64) now, in
    one line, not the same failure on every rank, restarted. What this cannot tell for sure it leaves to the
    ranks: a command refused here would have run is worse than a failure found late."""
    program = command[0]
    if "/" in program:
        if os.path.isdir(program):
            raise UsageError(f"-- {program}: is a directory, not a program to run")
        if not os.path.exists(program):
            raise UsageError(f"-- {program}: no such file")
        if not os.access(program, os.X_OK):
            raise UsageError(f"-- {program}: not executable (chmod +x it, or run it with its interpreter)")
        path = program
    else:
        path = shutil.which(program, path=env.get("PATH", os.defpath))
        if path is None:
            raise UsageError(f"-- {program}: command not found (searched PATH)")
    _check_shebang(program if "/" in program else f"{program} ({path})", path, env)
    name = os.path.basename(path)
    if is_python(path):  # python, python3, python3.12: CPython's command line (not python3-config)
        _check_python(command, path, env)
    elif name.startswith("python") and len(command) > 1:  # python3-dbg, ...: only what is sure, a missing .py
        script = command[1]
        if not script.startswith("-") and script.endswith(".py") and not os.path.isfile(script):
            raise UsageError(f"-- {program} {script}: no such file ({os.getcwd()})")
    elif name in _SHELLS:
        _check_shell(command, env)


def _stat(shown: str, path: str, where: str = "") -> os.stat_result:
    """`path`'s stat, or the usage error: no such file, a folder on its path not searchable."""
    try:
        return os.stat(path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise UsageError(f"-- {shown}: no such file{where}") from None
        raise UsageError(f"-- {shown}: cannot be opened by uid {os.getuid()} ({exc.strerror or exc})") from None


def _check_python(command: Sequence[str], path: str, env: Mapping[str, str]) -> None:
    entry = parse(command)
    if entry is None or entry.kind == "-c":
        return
    kind, name, flags = entry.kind, entry.what, entry.flags
    shown = " ".join(command[:entry.index + 1])
    if kind == "-m":
        if _same_interpreter(path):
            _check_module(shown, name, flags, env)
        return
    info = _stat(shown, name, f" ({os.getcwd()})")
    if stat.S_ISDIR(info.st_mode):
        if not os.access(name, os.R_OK | os.X_OK):
            raise UsageError(f"-- {shown}: a directory not readable by uid {os.getuid()} (chmod +rx it)")
        if not _has_main(name):
            raise UsageError(f"-- {shown}: a directory without a __main__.py (python runs a directory or a zip "
                             "archive through its __main__.py; name the script in it)")
    elif not os.access(name, os.R_OK):
        raise UsageError(f"-- {shown}: not readable by uid {os.getuid()} (chmod +r it)")
    elif stat.S_ISREG(info.st_mode) and _zip_without_main(name):
        raise UsageError(f"-- {shown}: a zip archive without a __main__.py at its top, which python needs to run it")
    # Anything else that can be read is a script python can open: a regular file, /dev/stdin, a fifo.


def _has_main(directory: str) -> bool:
    """Whether python finds a __main__ module in `directory` (source, bytecode, extension or package)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return True  # cannot tell: leave it to python
    stems = {"__main__" + suffix for suffix in importlib.machinery.all_suffixes()} | {"__main__"}
    return any(entry in stems for entry in names)


def _zip_without_main(path: str) -> bool:
    """A zip archive (python runs one through the zipimporter) without __main__.py or .pyc at its top."""
    import zipfile

    try:
        if not zipfile.is_zipfile(path):
            return False
        with zipfile.ZipFile(path) as archive:
            return not {"__main__.py", "__main__.pyc"} & set(archive.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def _same_interpreter(path: str) -> bool:
    """Whether `path` (a python the command names) is this interpreter, so that what it imports is what this
    one finds: the same file in the same directory (a venv's python, python3 and python3.X are links to one
    binary; the system's python, the same binary elsewhere, sees other packages)."""
    if not sys.executable:
        return False
    try:
        same = os.path.realpath(path) == os.path.realpath(sys.executable)
        return same and (os.path.realpath(os.path.dirname(os.path.abspath(path)))
                         == os.path.realpath(os.path.dirname(os.path.abspath(sys.executable))))
    except OSError:
        return False


def _module_paths(flags: frozenset[str], env: Mapping[str, str]) -> tuple[list[str], str]:
    """Where `python [flags] -m` looks, as a rank runs it (in this working directory, with this environment),
    and those places in words. This interpreter's own sys.path is added whole: more places than the rank's
    (its first entry: where this launcher was started from), never fewer."""
    isolated = "I" in flags
    ignore_env = isolated or "E" in flags
    paths, said = [], []
    safe_path = sys.version_info >= (3, 11) and ("P" in flags or (not ignore_env and env.get("PYTHONSAFEPATH")))  # 3.11's
    if not (isolated or safe_path):
        paths.append(os.getcwd())
        said.append(f"the working directory {os.getcwd()}")
    if not ignore_env and env.get("PYTHONPATH"):
        paths += [os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep) if p]  # relative: to this directory
        said.append("PYTHONPATH")
    paths += [p for p in sys.path if p]
    return paths, ", ".join(said) + (" and " if said else "") + "this python's sys.path"


def _dynamic(spec) -> bool:
    """Whether a package's __init__ may make submodules that no file on its path holds (or it cannot be read)."""
    if spec is None:
        return True
    if spec.origin in (None, "namespace") and spec.submodule_search_locations is not None:
        return False  # a namespace package: no code
    origin = spec.origin or ""
    if not origin.endswith(".py"):
        return True
    try:
        with open(origin, "rb") as source:
            return bool(_DYNAMIC_PACKAGE.search(source.read()))
    except OSError:
        return True


def _find_top(name: str, paths: list[str]):
    """The spec of a top-level module, without running code of its own: loaded already, on `paths`, or from
    an import hook of this interpreter (an editable install's finder). None where none finds it; raises
    LookupError where the lookup itself failed (cannot tell)."""
    from importlib.machinery import PathFinder

    if name in sys.modules:
        spec = getattr(sys.modules[name], "__spec__", None)
        if spec is None:
            raise LookupError(name)
        return spec
    try:
        spec = PathFinder.find_spec(name, paths)
        for finder in sys.meta_path:  # built-in and frozen modules, an editable install's finder
            if spec is not None:
                break
            if finder is not PathFinder and hasattr(finder, "find_spec"):  # PathFinder: on `paths`, done
                spec = finder.find_spec(name, None)
    except Exception:  # noqa: BLE001 - a finder that fails: cannot tell
        raise LookupError(name) from None
    return spec


def _check_module(shown: str, module: str, flags: frozenset[str], env: Mapping[str, str]) -> None:
    """`python -m module`: the module (each package on its way) is found where the rank's python will look. A
    package's __init__ is never run: a submodule is looked up in the package's folders (each place on the path
    that holds one: a namespace package's too); where the package's code may put it elsewhere, or a parent is
    not a package, the check stays out."""
    from importlib.machinery import PathFinder

    parts = module.split(".")
    if not all(parts):
        return  # a relative or empty name: python's own message
    paths, looked = _module_paths(flags, env)
    try:
        spec = _find_top(parts[0], paths)
    except LookupError:
        return
    if spec is None:
        raise UsageError(f"-- {shown}: no module named {parts[0]} for {sys.executable} (looked in {looked})")
    wanted = parts[1:] + ["__main__"]  # a package runs as its __main__ module
    for depth, part in enumerate(wanted, start=1):
        parent, full = ".".join(parts[:depth]), ".".join(parts[:depth] + [part])
        if full in sys.modules:
            spec = getattr(sys.modules[full], "__spec__", None)
            if spec is None:
                return
            continue
        if spec.submodule_search_locations is None:  # a module, not a package
            if part == "__main__" or _dynamic(spec):
                return  # it runs; or its code may set `full` up (os sets os.path up)
            hint = f": python -m takes a module's name, -m {parent}" if part in ("py", "pyc") else ""
            raise UsageError(f"-- {shown}: {parent} is a module ({spec.origin}), not a package: it has no {part}{hint}")
        loaded = getattr(sys.modules.get(parent), "__path__", None)
        locations = list(loaded or spec.submodule_search_locations)
        locations += [d for d in (os.path.join(p, *parts[:depth]) for p in paths) if d not in locations and os.path.isdir(d)]
        try:
            found = PathFinder.find_spec(full, locations)
        except Exception:  # noqa: BLE001 - cannot tell
            return
        if found is None:
            if _dynamic(spec):
                return  # its __init__ may put `full` where no file says
            if part == "__main__":
                raise UsageError(f"-- {shown}: {module} is a package without a __main__ module, which python -m needs "
                                 "to run it (name the module in it to run)")
            raise UsageError(f"-- {shown}: no module named {full} for {sys.executable} (looked in {', '.join(locations)})")
        spec = found


def _check_shell(command: Sequence[str], env: Mapping[str, str]) -> None:
    """`bash [options] SCRIPT`: the first word after the options is a script to read (none with -c or -s)."""
    i = 1
    while i < len(command):
        word = command[i]
        if word in ("--", "-"):
            i += 1
            break
        if word.startswith("--"):
            long = word[2:]
            if long in ("help", "version"):
                return
            i += 2 if long in _SHELL_VALUED_LONG else 1
            continue
        if word[0] not in "-+" or len(word) == 1:
            break
        letters = word[1:]
        if "c" in letters or "s" in letters:
            return  # a command string, or stdin
        i += 1 + letters.count("o") + letters.count("O")  # -o OPTION (and bash's -O OPTION) take the next word
    if i >= len(command):
        return
    script = command[i]
    shown = " ".join(command[:i + 1])
    on_path = (os.path.join(d or os.curdir, script) for d in env.get("PATH", os.defpath).split(os.pathsep))
    if "/" not in script and not os.path.exists(script) and any(map(os.path.isfile, on_path)):
        return  # bash looks a script it does not find here up on PATH
    info = _stat(shown, script, f" ({os.getcwd()})")
    if stat.S_ISDIR(info.st_mode):
        raise UsageError(f"-- {shown}: is a directory, not a script")
    if not os.access(script, os.R_OK):
        raise UsageError(f"-- {shown}: not readable by uid {os.getuid()} (chmod +r it)")


def _check_shebang(shown: str, path: str, env: Mapping[str, str]) -> None:
    """A script run as a program: the interpreter its #! line names exists (the kernel's "No such file" names
    the script, not the interpreter), and for `#!/usr/bin/env NAME`, NAME is on PATH."""
    try:
        with open(path, "rb") as program:
            head = program.read(_SHEBANG_BYTES)
    except OSError:
        return  # a binary run without read permission; a script without it fails with a clear message
    if not head.startswith(b"#!"):
        return
    # As the kernel reads it: spaces and tabs around, the interpreter, then one argument (a \r stays: CRLF)
    line = head[2:].split(b"\n", 1)[0].decode(errors="replace").strip(" \t")
    interpreter, _, argument = line.replace("\t", " ").partition(" ")
    argument = argument.strip(" ")
    if not interpreter or (b"\n" not in head and len(head) == _SHEBANG_BYTES and not argument):
        return  # a #! line longer than the kernel reads: it says ENOEXEC itself
    crlf = "its #! line ends in a carriage return (Windows line endings), which Linux takes as part of the name: " \
           "convert the file with dos2unix"
    if interpreter.endswith("\r") and not os.path.exists(interpreter):
        raise UsageError(f"-- {shown}: {crlf}")
    if os.path.isdir(interpreter) or not os.path.exists(interpreter):
        what = "is a directory" if os.path.isdir(interpreter) else "does not exist"
        raise UsageError(f"-- {shown}: the interpreter its #! line names, {interpreter}, {what}")
    if not os.access(interpreter, os.X_OK):
        raise UsageError(f"-- {shown}: the interpreter its #! line names, {interpreter}, is not executable")
    if os.path.basename(interpreter) != "env" or not argument:
        return
    words = argument.split(" ")  # Linux passes the argument whole: `env python3 -u` looks for "python3 -u"
    if words[0].startswith("-S"):  # env -S splits it into words
        words = ([words[0][2:]] if len(words[0]) > 2 else []) + words[1:]
        words = " ".join(words).split()
    words = [w for w in words if w]
    if not words or words[0].startswith("-") or "=" in words[0]:
        return  # env's other options, or variables: cannot tell
    name = words[0]
    if name.endswith("\r"):
        raise UsageError(f"-- {shown}: {crlf}")
    if "/" in name:
        if not os.path.exists(name):
            raise UsageError(f"-- {shown}: its #!{interpreter} line names {name}, which does not exist")
    elif shutil.which(name, path=env.get("PATH", os.defpath)) is None:
        raise UsageError(f"-- {shown}: its #!{interpreter} line names {name}, which is not on PATH")
