"""The nodes' checks after the rendezvous on this host, as `trainpod run` runs them: two nodes of a fixed-size c10d job
(`--nnodes 2`, one process each) with --netcheck on and --devcheck on. Node 0 says the network's figures in one line
(over loopback: the chosen interface) and that no GPU was checked (a CPU host); node 1 says neither; the job trains.
The checks' verdicts are the modules' unit tests; a named node is test_node_checks_compose and test_compose_elastic_nodes.
Nodes that would run different checks end with 78 and one line naming the flags, before either checks anything."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fixtures.elastic_host import clean_env
from fixtures.ports import free_port
from fixtures.processes import communicate_all

pytestmark = pytest.mark.slow

SCRIPT = """\
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def two_nodes(tmp_path, *flags_each: tuple[str, ...]) -> tuple[list[int], list[str]]:
    """Run a 2-node job on this host, node N with `flags_each[N]`: (exit codes, outputs)."""
    (tmp_path / "train.py").write_text(SCRIPT)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "trainpod", "run", "--nnodes", "2", "--node-rank", str(rank),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "--connect-timeout", "60", *flags, "--", sys.executable, "train.py"],
                              cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank, flags in enumerate(flags_each)]
    outputs = communicate_all(procs, 240)
    return [proc.returncode for proc in procs], outputs


def test_two_nodes_with_both_checks_say_their_lines_once_and_train(tmp_path):
    codes, outputs = two_nodes(tmp_path, *[("--netcheck", "on", "--devcheck", "on")] * 2)
    assert codes == [0, 0], outputs
    network = [line for line in outputs[0].splitlines() if "trainpod: network: " in line]
    devices = [line for line in outputs[0].splitlines() if "trainpod: devices: " in line]
    assert len(network) == 1 and "network: 2 nodes over lo, links " in network[0], outputs[0]
    assert len(devices) == 1 and "devices: no GPU checked" in devices[0], outputs[0]
    assert "trainpod: network: " not in outputs[1] and "trainpod: devices: " not in outputs[1], outputs[1]
    print(f"\n{network[0]}\n{devices[0]}")


def test_nodes_that_would_run_different_checks_end_with_78_naming_the_flags_before_any_check(tmp_path):
    # Without the comparison, node 0 measured its links alone, waited out the check's budget for node 1, and named it.
    codes, outputs = two_nodes(tmp_path, ("--netcheck", "on"), ())
    assert codes == [78, 78], outputs
    for output in outputs:
        errors = [line for line in output.splitlines() if "trainpod: error:" in line]
        assert len(errors) == 1, output
        assert ("the nodes run different node checks: checks '--netcheck on --devcheck off' on node 0 "
                in errors[0] and "'--netcheck off --devcheck off' on node 1 " in errors[0]), errors[0]
        assert "give every node the same --netcheck, --min-bandwidth, --devcheck and --peer-copies" in errors[0], errors[0]
        assert "trainpod: network: " not in output, output
