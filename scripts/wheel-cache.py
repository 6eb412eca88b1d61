"""A cache of downloaded wheels across wheelhouses and runs (`make wheelhouse`; WHEEL_CACHE).

    python3 scripts/wheel-cache.py seed CACHE DIR REQUIREMENTS...   link into DIR the cached wheels that
                                                                  the pins of REQUIREMENTS name
    python3 scripts/wheel-cache.py save CACHE DIR                   link DIR's wheels into CACHE

`pip download -d DIR` skips a file that DIR already holds, so seeding DIR first makes the download
of several GB (the CUDA flavours) a few seconds when the cache has it. pip's own HTTP cache does
not keep these files everywhere (it stores nothing where a proxy marks the answers uncacheable), and
the wheelhouse of each flavour starts empty: this cache is what lasts. Files are hard links where
CACHE and DIR share a filesystem, copies otherwise. Only `name==version` pins are seeded; pip
downloads anything else as usual.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*==\s*([^\s;#]+)")


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def pins(requirements: Path, seen: set[Path] | None = None) -> set[tuple[str, str]]:
    """(normalized name, version) of every `name==version` line, following `-r file` lines."""
    seen = set() if seen is None else seen
    requirements = requirements.resolve()
    if requirements in seen:
        return set()
    seen.add(requirements)
    found: set[tuple[str, str]] = set()
    for line in requirements.read_text().splitlines():
        include = re.match(r"^\s*(?:-r|--requirement)\s+(\S+)", line)
        if include:
            found |= pins(requirements.parent / include.group(1), seen)
        elif match := PIN.match(line):
            found.add((normalized(match.group(1)), match.group(2)))
    return found


def link(source: Path, target: Path) -> None:
    if target.exists():
        return
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def seed(cache: Path, folder: Path, requirements: list[Path]) -> int:
    wanted = set().union(*(pins(r) for r in requirements))
    folder.mkdir(parents=True, exist_ok=True)
    count = 0
    for wheel in cache.glob("*.whl") if cache.is_dir() else ():
        name, version = wheel.name.split("-")[:2]
        if (normalized(name), version) in wanted:
            link(wheel, folder / wheel.name)
            count += 1
    print(f"wheel-cache: {count} of {len(wanted)} pinned wheels from {cache}")
    return 0


def save(cache: Path, folder: Path) -> int:
    cache.mkdir(parents=True, exist_ok=True)
    for wheel in folder.rglob("*.whl"):
        link(wheel, cache / wheel.name)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "seed":
        return seed(Path(argv[1]), Path(argv[2]), [Path(r) for r in argv[3:]])
    if len(argv) == 3 and argv[0] == "save":
        return save(Path(argv[1]), Path(argv[2]))
    print(__doc__.strip().splitlines()[2], file=sys.stderr)
    print(__doc__.strip().splitlines()[4], file=sys.stderr)
    return 64


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
