"""The etcd source: nodes that meet in etcd get their rank from the rendezvous, not from the environment."""

import socket

import pytest

from trainpod.environments import REGISTRY, select
from trainpod.environments.etcd import EtcdEnvironment
from trainpod.errors import ConfigError, UsageError
from trainpod.launcher.resolve import Options, resolve_topology


def test_detected_from_its_variable_and_registered_before_single():
    assert select({"TRAINPOD_RDZV_BACKEND": "etcd-v3"}) is EtcdEnvironment
    assert select({"TRAINPOD_RDZV_BACKEND": "c10d"}) is not EtcdEnvironment
    names = list(REGISTRY)
    assert names.index("etcd") == names.index("single") - 1


def test_the_flags_pick_it_where_no_cluster_source_detects():
    topology = resolve_topology(Options(nnodes="1:3", rdzv_backend="etcd-v3", rdzv_endpoint="10.0.0.7:2379,10.0.0.8"), {},
                                resolve_names=False)
    rdzv = topology.rdzv
    assert topology.source == "etcd" and topology.node_rank is None
    assert topology.node_label == "@" + socket.gethostname().split(".")[0]  # its lines name the host: the rank may change
    assert (rdzv.backend, rdzv.endpoint, rdzv.min_nodes, rdzv.max_nodes) == ("etcd-v3", "10.0.0.7:2379,10.0.0.8:2379", 1, 3)
    assert (topology.master_addr, topology.master_port) == ("10.0.0.7", 2379)  # only the route to etcd
    assert not topology.is_master  # nothing of c10d's: no store to host, no port to keep free


def test_variables_alone():
    env = {"TRAINPOD_RDZV_BACKEND": "etcd-v3", "TRAINPOD_RDZV_ENDPOINT": "etcd:2379", "TRAINPOD_RDZV_ID": "team~run 7"}
    topology = resolve_topology(Options(nnodes="2:4"), env, resolve_names=False)
    # Kept exactly, escaped one-to-one for etcd (trainpod.rendezvous.ids); explain names what was given.
    assert topology.rdzv.id == "team~run@207" and topology.origins["rdzv_id"].startswith("TRAINPOD_RDZV_ID ('team~run 7'")


@pytest.mark.parametrize("flags,env,code,says", [
    ({"nnodes": "1:2", "rdzv_backend": "etcd-v3"}, {}, 64, "--rdzv-backend=etcd-v3: the etcd-v3 rendezvous needs etcd's address"),
    ({"nnodes": "1:2"}, {"TRAINPOD_RDZV_BACKEND": "etcd"}, 78, "--rdzv-endpoint"),
    ({}, {"TRAINPOD_RDZV_BACKEND": "etcd", "TRAINPOD_RDZV_ENDPOINT": "e:1"}, 78, "--nnodes MIN:MAX"),
    ({"nnodes": "1:2", "rdzv_backend": "etcd", "rdzv_endpoint": "ftp://e:2379"}, {}, 64, "--rdzv-endpoint='ftp://e:2379'"),
    ({"nnodes": "1:2", "rdzv_backend": "etcd", "rdzv_endpoint": "e:0"}, {}, 64, "port from 1 to 65535"),
    ({"nnodes": "3:2", "rdzv_backend": "etcd", "rdzv_endpoint": "e"}, {}, 64, "--nnodes='3:2'"),
])
def test_what_is_missing_or_wrong_is_one_line(flags, env, code, says):
    with pytest.raises((ConfigError, UsageError)) as caught:
        resolve_topology(Options(**flags), env, resolve_names=False)
    assert caught.value.exit_code == code and says in str(caught.value) and "\n" not in str(caught.value)


def test_a_node_rank_flag_is_ignored_with_a_warning():
    topology = resolve_topology(Options(nnodes="2", node_rank=1, rdzv_backend="etcd-v3", rdzv_endpoint="e:2379"), {},
                                resolve_names=False)
    assert topology.node_rank is None and any("--node-rank is ignored" in w for w in topology.warnings)


@pytest.mark.parametrize("flags,env,code,origin", [
    ({"rdzv_endpoint": "e0:2379,e1:2379"}, {"TRAINPOD_RDZV_BACKEND": "etcd"}, 64, "--rdzv-endpoint"),
    ({}, {"TRAINPOD_RDZV_BACKEND": "etcd", "TRAINPOD_RDZV_ENDPOINT": "e0:2379,e1:2379"}, 78, "TRAINPOD_RDZV_ENDPOINT"),
])
def test_torchs_etcd_backend_with_several_endpoints_is_one_line(flags, env, code, origin):
    # torch's own etcd handler raises a ValueError on a list: say so before anything starts.
    with pytest.raises((UsageError, ConfigError)) as info:
        resolve_topology(Options(nnodes="1:2", **flags), env, resolve_names=False)
    assert info.value.exit_code == code and str(info.value).startswith(f"{origin}='e0:2379,e1:2379': torch's etcd rendezvous")
    assert "etcd-v3" in str(info.value)


def test_a_node_rank_in_the_environment_does_not_pin_an_etcd_job_to_loopback():
    # NODE_RANK makes the torchrun source detect, and its single-node default master is 127.0.0.1: with
    # etcd the master is only the route to etcd, and must come from the endpoint.
    env = {"NODE_RANK": "1", "TRAINPOD_RDZV_BACKEND": "etcd-v3", "TRAINPOD_RDZV_ENDPOINT": "etcd0:2379"}
    topology = resolve_topology(Options(nnodes="2:4"), env, resolve_names=False)
    assert (topology.source, topology.master_addr, topology.master_port) == ("torchrun", "etcd0", 2379)
    assert topology.origins["master_addr"].startswith("TRAINPOD_RDZV_ENDPOINT")
