"""The committed OpenPAI job protocols: well-formed, and what trainpod discovers from them is right."""

from pathlib import Path

import pytest
import yaml

from fixtures.pai_runtime import pai_environment
from trainpod.examples import EXAMPLES
from trainpod.resolve import Options, resolve_topology

PROTOCOLS = sorted((Path(__file__).resolve().parents[2] / "job_protocols").glob("*.yaml"))


def test_there_are_protocols():
    assert PROTOCOLS


@pytest.mark.parametrize("path", PROTOCOLS, ids=lambda p: p.name)
def test_protocol_is_a_v2_job_that_trainpod_can_place(path):
    protocol = yaml.safe_load(path.read_text())
    assert protocol["protocolVersion"] == 2 and protocol["type"] == "job"
    images = {p["name"] for p in protocol["prerequisites"] if p["type"] == "dockerimage"}
    assert protocol["extras"]["gangAllocation"] is True
    roles = protocol["taskRoles"]
    for name, role in roles.items():
        assert role["dockerImage"] in images
        command = " ".join(role["commands"])
        assert command.startswith("trainpod run")
        example = command.split("--example ")[1].split()[0]
        assert example in EXAMPLES

        labels = {label: count for label, count in role["resourcePerInstance"].get("ports", {}).items()}
        for index in range(role["instances"]):
            env = pai_environment({r: roles[r]["instances"] for r in roles}, (name, index), labels)
            topology = resolve_topology(Options(), env, resolve_names=False)
            assert (topology.nnodes, topology.node_rank) == (role["instances"], index)
            assert topology.master_port != 29500 and not topology.warnings
