"""Split a venv into image layers: hard-linked trees that the Dockerfile's final stage COPYs one by one.

    python venv-layers.py group VENV TREE PATTERN...   the files of the installed distributions whose
                                                       names match a PATTERN (fnmatch: 'nvidia-*')
    python venv-layers.py rest VENV TREE OTHER_TREE... every file of VENV that no OTHER_TREE holds

Each TREE mirrors absolute paths (TREE/opt/trainpod/venv/...), so `COPY --from=stage TREE/ /` puts
the files back where they were. Files are hard links, which cost nothing inside the same RUN that
installed them; symlinks are copied as symlinks; the venv itself is left as it was. Run it with
the venv's own python, so that it reads that venv's distributions (their RECORD files).

Why: one COPY of the whole venv is one layer of several GB that any change to any package
replaces. With the CUDA runtime wheels, torch and the rest in layers of their own, a change to a
small package (or to trainpod, installed after these) leaves the big layers as they were.

Every TREE also gets a manifest, TREE/opt/trainpod/layers.d/<TREE's name>.txt, naming what it
holds. It says in the image which layer brought which package, and it keeps a TREE from ever being
empty (the CPU flavour has no CUDA wheels): Docker's classic builder fails the COPY that follows a
COPY of an empty folder ("failed to get layer ...: layer does not exist", moby/moby#40591).
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import os
import re
import sys
import sysconfig


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def place(path: str, tree: str) -> bool:
    """Hard-link (or, for a symlink, copy) the file at `path` to the same absolute path under `tree`."""
    if not os.path.lexists(path) or (os.path.isdir(path) and not os.path.islink(path)):
        return False
    target = os.path.join(tree, path.lstrip("/"))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.lexists(target):
        return False
    if os.path.islink(path):
        os.symlink(os.readlink(path), target)
    else:
        os.link(path, target)
    return True


def manifest(tree: str, lines: list[str]) -> None:
    """Write TREE/opt/trainpod/layers.d/<name of TREE>.txt (see the module's docstring)."""
    path = os.path.join(tree, "opt", "trainpod", "layers.d", os.path.basename(os.path.normpath(tree)) + ".txt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def group(venv: str, tree: str, patterns: list[str]) -> None:
    site = sysconfig.get_path("purelib")
    if not os.path.realpath(site).startswith(os.path.realpath(venv) + os.sep):
        sys.exit(f"venv-layers: run this with {venv}/bin/python (this python's site-packages is {site})")
    os.makedirs(tree, exist_ok=True)
    names, count, size = [], 0, 0
    for dist in importlib.metadata.distributions(path=[site]):
        name = normalized(dist.metadata["Name"])
        if not any(fnmatch.fnmatch(name, normalized(p)) for p in patterns):
            continue
        names.append(name)
        for file in dist.files or ():
            path = os.path.normpath(str(dist.locate_file(file)))
            if place(path, tree):
                count += 1
                size += os.lstat(path).st_size
    print(f"venv-layers: {tree}: {count} files, {size / 1e6:.0f} MB of {len(names)} distributions: "
          f"{' '.join(sorted(names)) or '(none)'}")
    manifest(tree, [f"# {count} files of the distributions matching {' '.join(patterns)}", *sorted(names)])


def rest(venv: str, tree: str, others: list[str]) -> None:
    venv = os.path.abspath(venv)
    os.makedirs(tree, exist_ok=True)
    count, size = 0, 0
    for folder, dirs, files in os.walk(venv):
        target_folder = os.path.join(tree, folder.lstrip("/"))
        if not any(os.path.isdir(os.path.join(other, folder.lstrip("/"))) for other in others):
            os.makedirs(target_folder, exist_ok=True)  # empty folders too (the venv's include/)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            path = os.path.join(folder, name)
            if any(os.path.lexists(os.path.join(other, path.lstrip("/"))) for other in others):
                continue
            if place(path, tree):
                count += 1
                size += os.lstat(path).st_size
    print(f"venv-layers: {tree}: {count} files, {size / 1e6:.0f} MB (the rest of {venv})")
    manifest(tree, [f"# {count} files: the rest of {venv}"])


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] not in ("group", "rest"):
        print("\n".join(__doc__.strip().splitlines()[2:4]), file=sys.stderr)
        return 64
    command, venv, tree, *more = argv
    if command == "group":
        group(venv, tree, more)
    else:
        rest(venv, tree, more)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
