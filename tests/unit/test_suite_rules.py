"""The rules that let `make test` run the test modules side by side (pytest-xdist, issue 25), checked on the sources.

- A compose job's subnet (TRAINPOD_SUBNET_PREFIX, "10.151.N") is never written in a test: Docker refuses a network
  whose subnet another network holds (another module's job run beside it by xdist, a network a killed run left, another
  checkout's suite on the same engine), so ComposeJob takes a free one for each project (fixtures.subnets).
- A test module's basename is unique across tests/ (pytest imports them by basename: pytest.ini's pythonpath, no
  __init__.py).
"""

import re
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SUBNET = re.compile(r"""["']10\.151\.\d+["']|["']TRAINPOD_SUBNET_PREFIX["']\s*:""")
ALLOCATOR = {TESTS / "fixtures" / "subnets.py", TESTS / "unit" / "test_fixture_subnets.py"}  # it, and its tests


def test_no_test_fixes_a_compose_subnet():
    fixed = {str(path.relative_to(TESTS)): found.group(0) for path in TESTS.rglob("*.py") if path not in ALLOCATOR
             if (found := SUBNET.search(path.read_text()))}
    assert fixed == {}, f"take the project's own subnet (ComposeJob.prefix) instead: {fixed}"


def test_each_test_modules_basename_is_unique():
    names = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        names[path.name].append(str(path.relative_to(TESTS)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}
