"""trainpod.launcher.command: the user's command, checked before anything starts (one line and 64, never restarted)."""

import os
import sys

import pytest

from trainpod.errors import UsageError
from trainpod.launcher.command import check_command


def test_the_command_is_found_before_any_rank_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {"PATH": "/usr/bin:/bin"}
    check_command(["sh", "-c", "true"], env)
    check_command(["python3", "-m", "json.tool"], env)
    (tmp_path / "plain.txt").write_text("")
    (tmp_path / "train.py").write_text("")
    check_command(["python3", "train.py"], env)
    for command, says in [(["nosuchcmd"], "-- nosuchcmd: command not found (searched PATH)"),
                          ([str(tmp_path / "plain.txt")], "not executable"),
                          ([str(tmp_path)], "is a directory"),
                          ([str(tmp_path / "gone")], "no such file"),
                          (["python3", "nosuch.py", "--lr", "1"], "-- python3 nosuch.py: no such file")]:
        with pytest.raises(UsageError) as raised:
            check_command(command, env)
        assert says in str(raised.value) and raised.value.exit_code == 64


# --- check_command: what the command runs (a python script or module, a shell script, a #! interpreter) ---

def refused(command, env):
    """The one line a refused command ends in (64)."""
    with pytest.raises(UsageError) as raised:
        check_command(command, env)
    assert raised.value.exit_code == 64 and "\n" not in str(raised.value)
    return str(raised.value)


def this_python_on_path():
    """A PATH whose `python3` (this interpreter's own name) is this interpreter."""

    return {"PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])}, os.path.basename(sys.executable)


@pytest.mark.parametrize("options", [["-u"], ["-O"], ["-OO"], ["-B"], ["-s"], ["-E"], ["-I"], ["-X", "dev"], ["-Xdev"],
                                     ["-W", "ignore"], ["-Wignore"], ["-uB"], ["-u", "-X", "utf8", "-W", "error"],
                                     ["--check-hash-based-pycs", "always"], ["--"]])
def test_python_options_before_a_missing_script_are_read_as_python_reads_them(tmp_path, monkeypatch, options):
    monkeypatch.chdir(tmp_path)
    line = refused(["python3", *options, str(tmp_path / "nope.py"), "--lr", "1"], {"PATH": "/usr/bin:/bin"})
    assert line == f"-- python3 {' '.join(options)} {tmp_path / 'nope.py'}: no such file ({tmp_path})"
    # not only .py: whatever python is given to open
    assert refused(["python3", *options, "train"], {"PATH": "/usr/bin:/bin"}).endswith(f"train: no such file ({tmp_path})")


@pytest.mark.parametrize("shell, options", [("bash", []), ("sh", []), ("dash", []), ("zsh", []), ("bash", ["-e"]),
                                            ("sh", ["-x"]), ("bash", ["-eu"]), ("bash", ["-o", "pipefail"]),
                                            ("bash", ["-eo", "pipefail", "-x"]), ("bash", ["--norc", "-e", "--"]),
                                            ("bash", ["--rcfile", "rc"]), ("sh", ["-"]), ("bash", ["+x"])])
def test_a_shell_given_a_missing_script_is_64(tmp_path, monkeypatch, shell, options):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "zsh").symlink_to("/bin/sh")  # named zsh: what is checked is the name (zsh need not be here)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}
    (tmp_path / "rc").write_text("")
    line = refused([shell, *options, "/tmp/x/nope.sh", "arg"], env)
    assert line == f"-- {shell} {' '.join([*options, ''])}/tmp/x/nope.sh: no such file ({tmp_path})"
    assert refused([shell, *options, "nope.sh"], env).endswith(f"nope.sh: no such file ({tmp_path})")
    assert refused([shell, *options, str(tmp_path)], env).endswith(": is a directory, not a script")


def test_a_script_whose_shebang_interpreter_is_missing_is_64(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    scripts = {"badshebang.sh": "#!/nonexistent/interp\necho hi\n", "badenv.sh": "#!/usr/bin/env nosuch_interp_xyz\necho\n",
               "crlf.sh": "#!/bin/sh\r\necho\r\n", "crlfenv.sh": "#!/usr/bin/env sh\r\necho\r\n",
               "dir.sh": f"#! {tmp_path}\n", "envpath.sh": "#!/usr/bin/env /nonexistent/python3\n"}
    for name, text in scripts.items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    assert refused([str(tmp_path / "badshebang.sh")], env) == (
        f"-- {tmp_path / 'badshebang.sh'}: the interpreter its #! line names, /nonexistent/interp, does not exist")
    assert refused(["badshebang.sh", "--x"], env) == (  # found on PATH: named with where
        f"-- badshebang.sh ({tmp_path / 'badshebang.sh'}): the interpreter its #! line names, /nonexistent/interp, does not exist")
    assert refused(["./badenv.sh"], env) == "-- ./badenv.sh: its #!/usr/bin/env line names nosuch_interp_xyz, which is not on PATH"
    assert "Windows line endings" in refused(["./crlf.sh"], env) and "dos2unix" in refused(["./crlfenv.sh"], env)
    assert refused(["./dir.sh"], env).endswith(f"names, {tmp_path}, is a directory")
    assert refused(["./envpath.sh"], env).endswith("line names /nonexistent/python3, which does not exist")


def test_a_directory_or_zip_given_to_python_needs_a_main(tmp_path, monkeypatch):
    import zipfile

    monkeypatch.chdir(tmp_path)
    env = {"PATH": "/usr/bin:/bin"}
    (tmp_path / "d").mkdir()
    assert refused(["python3", str(tmp_path / "d")], env) == (
        f"-- python3 {tmp_path / 'd'}: a directory without a __main__.py (python runs a directory or a zip archive "
        "through its __main__.py; name the script in it)")
    assert "a directory without a __main__.py" in refused(["python3", "-u", "d", "--epochs", "1"], env)
    with zipfile.ZipFile(tmp_path / "app.pyz", "w") as archive:
        archive.writestr("lib.py", "")
    assert refused(["python3", "app.pyz"], env).endswith(": a zip archive without a __main__.py at its top, which python needs to run it")
    # with a __main__: python runs them
    (tmp_path / "d" / "__main__.py").write_text("")
    with zipfile.ZipFile(tmp_path / "app.pyz", "a") as archive:
        archive.writestr("__main__.py", "")
    for command in (["python3", "d"], ["python3", "app.pyz"]):
        check_command(command, env)


def test_an_unreadable_script_is_64(tmp_path, monkeypatch):

    monkeypatch.chdir(tmp_path)
    env = {"PATH": "/usr/bin:/bin"}
    for name in ("noread.py", "noread.sh"):
        (tmp_path / name).write_text("")
        (tmp_path / name).chmod(0)
    (tmp_path / "noread").mkdir(mode=0)
    if os.geteuid() == 0:  # root reads everything: as the job's user would see them
        access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: "noread" not in str(p) and access(p, mode, **kw))
    uid = os.getuid()
    assert refused(["python3", str(tmp_path / "noread.py")], env) == (
        f"-- python3 {tmp_path / 'noread.py'}: not readable by uid {uid} (chmod +r it)")
    assert refused(["python3", "-u", "noread"], env) == f"-- python3 -u noread: a directory not readable by uid {uid} (chmod +rx it)"
    assert refused(["bash", "-e", "noread.sh"], env) == f"-- bash -e noread.sh: not readable by uid {uid} (chmod +r it)"


def test_a_module_this_python_cannot_find_is_64(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env, python = this_python_on_path()
    line = refused([python, "-m", "nonexistent_module_xyz", "--x"], env)
    assert line == (f"-- {python} -m nonexistent_module_xyz: no module named nonexistent_module_xyz for {sys.executable} "
                    f"(looked in the working directory {tmp_path} and this python's sys.path)")
    assert "no module named nonexistent_module_xyz" in refused([sys.executable, "-u", "-mnonexistent_module_xyz"], {})


def test_a_module_is_looked_up_where_the_ranks_python_looks(tmp_path, monkeypatch):
    """The ranks run in this working directory with this environment: `python -m` finds a module there and on
    PYTHONPATH, unless -P, -I or PYTHONSAFEPATH leave the directory out, or -E, -I the environment."""
    monkeypatch.chdir(tmp_path)
    env, python = this_python_on_path()
    (tmp_path / "train_here_xyz.py").write_text("")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "train_lib_xyz.py").write_text("")
    check_command([python, "-m", "train_here_xyz"], env)
    check_command([python, "-u", "-m", "train_lib_xyz"], {**env, "PYTHONPATH": f"/nonexistent:{tmp_path / 'lib'}"})
    check_command([python, "-m", "train_lib_xyz"], {**env, "PYTHONPATH": "lib"})  # relative: to the working directory
    for options in (["-I"], ["-sIu"]) + ((["-P"],) if sys.version_info >= (3, 11) else ()):
        assert "no module named train_here_xyz" in refused([python, *options, "-m", "train_here_xyz"], env)
    if sys.version_info >= (3, 11):  # -P, PYTHONSAFEPATH: 3.11's
        assert "no module named train_here_xyz" in refused([python, "-m", "train_here_xyz"], {**env, "PYTHONSAFEPATH": "1"})
    check_command([python, "-E", "-m", "train_here_xyz"], {**env, "PYTHONSAFEPATH": "1"})  # -E: not read
    for options in (["-E"], ["-I"]):
        assert "no module named train_lib_xyz" in refused([python, *options, "-m", "train_lib_xyz"],
                                                          {**env, "PYTHONPATH": str(tmp_path / "lib")})
    assert "no module named train_lib_xyz" in refused([python, "-m", "train_lib_xyz"], env)


def test_a_dotted_module_is_looked_up_without_running_its_packages(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env, python = this_python_on_path()
    pkg = tmp_path / "mypkg_xyz"
    (pkg / "inner").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise SystemExit('the package ran')\n")  # user code: never run by the check
    (pkg / "train.py").write_text("")
    (pkg / "inner" / "__init__.py").write_text("")
    (pkg / "inner" / "step.py").write_text("")
    check_command([python, "-m", "mypkg_xyz.train"], env)
    check_command([python, "-m", "mypkg_xyz.inner.step"], env)
    assert "mypkg_xyz" not in sys.modules
    assert refused([python, "-m", "mypkg_xyz.trian"], env) == (
        f"-- {python} -m mypkg_xyz.trian: no module named mypkg_xyz.trian for {sys.executable} (looked in {pkg})")
    assert "no module named mypkg_xyz.inner.nope" in refused([python, "-m", "mypkg_xyz.inner.nope"], env)
    assert refused([python, "-m", "mypkg_xyz"], env) == (
        f"-- {python} -m mypkg_xyz: mypkg_xyz is a package without a __main__ module, which python -m needs to run it "
        "(name the module in it to run)")
    (pkg / "__main__.py").write_text("")
    check_command([python, "-m", "mypkg_xyz"], env)
    # `-m train.py`: a module is no package
    (tmp_path / "train_xyz.py").write_text("")
    line = refused([python, "-m", "train_xyz.py"], env)
    assert line.endswith("not a package: it has no py: python -m takes a module's name, -m train_xyz")
    # a namespace package (no __init__.py), here and on PYTHONPATH both
    (tmp_path / "ns_xyz").mkdir()
    (tmp_path / "lib" / "ns_xyz").mkdir(parents=True)
    (tmp_path / "lib" / "ns_xyz" / "job.py").write_text("")
    check_command([python, "-m", "ns_xyz.job"], {**env, "PYTHONPATH": str(tmp_path / "lib")})
    assert "no module named ns_xyz.job" in refused([python, "-m", "ns_xyz.job"], env)


def test_a_module_is_not_refused_where_the_check_cannot_tell(tmp_path, monkeypatch):
    """A false refusal is worse than a failure found late: a package whose code may make its submodules, a
    module set up by its parent (os.path), a module only an import hook knows, another python's module."""
    import importlib.machinery

    monkeypatch.chdir(tmp_path)
    env, python = this_python_on_path()
    (tmp_path / "dyn_xyz").mkdir()
    (tmp_path / "dyn_xyz" / "__init__.py").write_text("from pkgutil import extend_path\n__path__ = extend_path(__path__, __name__)\n")
    check_command([python, "-m", "dyn_xyz.elsewhere"], env)
    check_command([python, "-m", "os.path"], env)

    class Hook:  # an editable install's finder, say: on no path entry
        @staticmethod
        def find_spec(name, path=None, target=None):
            return importlib.machinery.ModuleSpec(name, None) if name == "hooked_only_xyz" else None

    monkeypatch.setattr(sys, "meta_path", [Hook, *sys.meta_path])
    check_command([python, "-m", "hooked_only_xyz"], env)
    # another python (the same binary elsewhere sees other packages): its modules are not looked up here
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "python3").symlink_to(os.path.realpath(sys.executable))
    check_command(["python3", "-m", "nonexistent_module_xyz"], {"PATH": f"{tmp_path / 'other'}:/usr/bin:/bin"})


def test_commands_that_run_stay_accepted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env, python = this_python_on_path()
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "job.sh").write_text("echo\n")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "onpath.sh").write_text("echo\n")  # bash looks a script up on PATH too
    for name, text in {"good.sh": "#!/bin/sh\necho\n", "goodenv.sh": "#!/usr/bin/env bash\necho\n",
                       "split.sh": "#!/usr/bin/env -S python3 -u\n", "long.sh": "#!/bin/sh " + "x" * 300 + "\n"}.items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    for command in ([python, "-u", "train.py"], ["python3", "-u", "train.py", "--lr", "1"], [python, "-m", "http.server"],
                    [python, "-m", "json.tool"], [python, "-u", "-m", "unittest", "-h"],
                    [python, "-c", "print(1)"], [python, "-uc", "print(1)"], [python, "-"], [python], [python, "-V"],
                    [python, "--version"], [python, "-i"], [python, "/dev/stdin"], [python, "--", "train.py"],
                    ["bash", "-c", "echo"], ["sh", "-ec", "echo"], ["bash", "-s", "arg"], ["bash"], ["bash", "job.sh"],
                    ["sh", "-e", "job.sh"], ["bash", "-o", "pipefail", "job.sh"], ["bash", "onpath.sh"], ["bash", "/dev/stdin"],
                    ["./good.sh"], ["./goodenv.sh"], ["./split.sh"], ["./long.sh"]):
        check_command(command, {**env, "PATH": f"{env['PATH']}:{tmp_path / 'bin'}"})
