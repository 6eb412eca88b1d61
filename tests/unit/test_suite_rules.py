"""The rules that let `make test` run the test modules side by side (pytest-xdist, issue 25), checked on the sources.

- A compose job's subnet (TRAINPOD_SUBNET_PREFIX, "10.151.N") belongs to one test module: Docker refuses a network
  whose subnet another network holds, so two modules on one subnet fail when xdist runs them at once. The tests of one
  module that share a subnet run on one worker, one after another (pytest.mark.xdist_group).
- A test module's basename is unique across tests/ (pytest imports them by basename: pytest.ini's pythonpath, no
  __init__.py).
"""

import re
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SUBNET = re.compile(r"""["']10\.151\.(\d+)["']""")


def test_each_compose_subnet_belongs_to_one_module():
    users = defaultdict(set)
    for path in TESTS.rglob("*.py"):
        for found in SUBNET.finditer(path.read_text()):
            users[found.group(1)].add(str(path.relative_to(TESTS)))
    assert users, "no subnet found: has the pattern changed?"
    shared = {f"10.151.{octet}": sorted(paths) for octet, paths in users.items() if len(paths) > 1}
    assert not shared, shared


def test_each_test_modules_basename_is_unique():
    names = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        names[path.name].append(str(path.relative_to(TESTS)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}
