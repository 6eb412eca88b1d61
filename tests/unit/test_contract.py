"""trainpod.contract: every name that crosses a process has one home."""

import ast
import re
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from trainpod import contract, errors
from trainpod.runspec import RUN_SETTINGS, RunSpec, Target
from trainpod.topology import Topology

PACKAGE = Path(__file__).resolve().parents[2] / "entrypoint" / "trainpod"
NAME = re.compile(r"TRAINPOD_[A-Z0-9_]+")


def literal_names() -> dict[str, set[str]]:
    """TRAINPOD_* name -> the modules that write it as a string literal of its own (a docstring or help text
    that mentions it is prose, not a name)."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                found[node.value].add(str(path.relative_to(PACKAGE)))
    return found


@pytest.mark.slow
def test_every_trainpod_variable_is_written_in_one_module():
    shared = {name: sorted(modules) for name, modules in literal_names().items() if len(modules) > 1}
    assert not shared, f"TRAINPOD_* names written as literals in several modules (name them once, in trainpod.contract " \
                       f"or the Setting that owns them, and import that): {shared}"


def test_the_contract_names_each_variable_once():
    names = [value for key, value in vars(contract).items() if key.endswith("_VAR")]
    assert len(names) == len(set(names)) and all(NAME.fullmatch(name) for name in names)


def test_the_exit_codes_have_one_home():
    assert (errors.EXIT_USAGE, errors.EXIT_UNAVAILABLE, errors.EXIT_CONFIG) == (64, 69, 78)
    codes = [row.code for row in contract.EXIT_CODES]
    for code in (contract.EXIT_USAGE, contract.EXIT_UNAVAILABLE, contract.EXIT_CANTCREAT, contract.EXIT_CONFIG,
                 contract.EXIT_HANG, contract.EXIT_INTERRUPTED, contract.EXIT_TERMINATED):
        assert str(code) in codes


TOPOLOGY = Topology(source="pai", nnodes=2, node_rank=1, nproc_per_node=2, master_addr="10.0.0.2", master_port=29877,
                    backend="gloo", interface=None, max_restarts=7, origins={"max_restarts": "PAI_TASK_ROLE_RETRY_COUNT"})


def test_a_run_spec_round_trips_through_the_environment():
    spec = RunSpec(topology=TOPOLOGY, target=Target.for_example("cifar10-ddp", ["--epochs", "1"], env={}), term_grace=40.5,
                   warm_start="off", trust_checkpoints=True, lock_timeout=0.0)
    assert RunSpec.from_env(spec.to_env()) == spec
    assert RunSpec.from_env({}) is None


def test_each_run_setting_is_a_field_with_its_default():
    assert {s.name for s in RUN_SETTINGS} <= set(RunSpec.__dataclass_fields__)
    spec = RunSpec(topology=TOPOLOGY, target=Target(command=("x",)))
    for setting in RUN_SETTINGS:
        assert getattr(spec, setting.name) == setting.default, setting.name


def test_the_clusters_restart_budget_stands_in_for_the_default_only():
    from trainpod import settings

    run_settings = (*RUN_SETTINGS,)
    default = settings.resolve(run_settings, {}, {})
    assert RunSpec.from_values(TOPOLOGY, Target(command=("x",)), default).max_restarts == 7
    flagged = settings.resolve(run_settings, {"max_restarts": "2"}, {})
    assert RunSpec.from_values(TOPOLOGY, Target(command=("x",)), flagged).max_restarts == 2


def test_a_spec_that_does_not_parse_names_its_variable():
    import pytest

    from trainpod.errors import ConfigError

    with pytest.raises(ConfigError, match=contract.RUN_SPEC_VAR):
        RunSpec.from_env({contract.RUN_SPEC_VAR: "{not json"})


def test_the_node_checks_are_said_in_their_flags_words_and_a_bound_asks_for_the_network_check():
    spec = RunSpec(topology=TOPOLOGY, target=Target(command=("x",)))
    assert spec.node_checks() == "--netcheck off --devcheck off"
    assert replace(spec, min_bandwidth=0.5).node_checks() == "--netcheck on --min-bandwidth 0.5 --devcheck off"
    assert replace(spec, netcheck="on", devcheck="on").node_checks() == "--netcheck on --devcheck on"
    assert replace(spec, peer_copies=True).node_checks() == "--netcheck off --devcheck off --peer-copies"
