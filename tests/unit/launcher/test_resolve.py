import re

import pytest

from fixtures.pai_runtime import pai_environment
from trainpod.errors import ConfigError, UsageError
from trainpod.launcher.resolve import Options, resolve_topology


def resolve(env, **flags):
    return resolve_topology(Options(**flags), env, resolve_names=False)


def test_nothing_set_is_a_single_node():
    topology = resolve({})
    assert (topology.source, topology.nnodes, topology.node_rank, topology.master_addr) == ("single", 1, 0, "127.0.0.1")
    assert (topology.backend, topology.nproc_per_node, topology.interface) == ("gloo", 1, "lo")


def test_pai_wins_over_leftover_torchrun_variables():
    env = {**pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 1}), "MASTER_ADDR": "elsewhere"}
    assert resolve(env).source == "pai"


def test_source_can_be_forced():
    env = {**pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 1}), "MASTER_ADDR": "10.0.0.5"}
    assert resolve(env, source="torchrun").master_addr == "10.0.0.5"
    assert resolve({**env, "TRAINPOD_SOURCE": "torchrun"}).source == "torchrun"


def test_visible_gpus_set_processes_and_backend():
    topology = resolve({"CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert (topology.nproc_per_node, topology.backend) == (3, "nccl")


def test_nproc_precedence():
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "TRAINPOD_NPROC_PER_NODE": "1", "PET_NPROC_PER_NODE": "5"}
    assert resolve(env).nproc_per_node == 1
    assert resolve(env, nproc_per_node=2).nproc_per_node == 2
    assert resolve({"PET_NPROC_PER_NODE": "auto", "CUDA_VISIBLE_DEVICES": "0,1"}).nproc_per_node == 2


def test_nccl_without_gpus_is_refused():
    with pytest.raises(UsageError, match="--backend=nccl"):
        resolve({}, backend="nccl")
    with pytest.raises(ConfigError, match="TRAINPOD_BACKEND=nccl"):
        resolve({"TRAINPOD_BACKEND": "nccl"})


def test_user_interface_is_kept():
    topology = resolve({"GLOO_SOCKET_IFNAME": "lo"})
    assert topology.interface == "lo" and topology.origins["interface"] == "GLOO_SOCKET_IFNAME"


def test_the_interface_variable_is_the_backends_and_checked_in_its_syntax():
    with pytest.raises(ConfigError, match=r"^GLOO_SOCKET_IFNAME='nonexist0': no such interface here \(have: .*lo"):
        resolve({"GLOO_SOCKET_IFNAME": "nonexist0"})
    # On the CPU (gloo) NCCL's variable is not used, so neither checked nor copied: the route decides.
    topology = resolve({"NCCL_SOCKET_IFNAME": "nonexist0"})
    assert (topology.interface, topology.origins["interface"]) == ("lo", "auto")
    assert topology.warnings == ("NCCL_SOCKET_IFNAME='nonexist0' is ignored: the backend is gloo, which reads GLOO_SOCKET_IFNAME; "
                                 "trainpod picks GLOO_SOCKET_IFNAME itself and leaves NCCL_SOCKET_IFNAME as it is",)
    gpus = {"CUDA_VISIBLE_DEVICES": "0,1"}
    for value in ("l", "^docker", "=lo", "lo,eth", "^=docker0"):  # NCCL's prefixes, exclusions and exact names
        topology = resolve({**gpus, "NCCL_SOCKET_IFNAME": value, "GLOO_SOCKET_IFNAME": "bogus"})
        assert (topology.interface, topology.origins["interface"], topology.warnings) == (value, "NCCL_SOCKET_IFNAME", ())
    for value in ("=l", "nonexist", "^l,e,d,i,w,v,t,b,s,p,w,a,c,x,y,z,n,m,g,f,o,h,j,k,q,r,u"):
        with pytest.raises(ConfigError, match=re.escape(f"NCCL_SOCKET_IFNAME={value!r}: NCCL reads it as")):
            resolve({**gpus, "NCCL_SOCKET_IFNAME": value})


def test_several_sources_or_disagreeing_variables_are_one_warning():
    env = {**pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 1}), "MASTER_ADDR": "10.0.0.5", "NNODES": "2"}
    assert resolve(env).warnings == ("several cluster sources are set: using pai (the first source that detects); "
                                     "ignoring torchrun's NNODES, MASTER_ADDR",)
    assert resolve({**env, "NODE_RANK": "1"}, source="torchrun").warnings == ("several cluster sources are set: using --source torchrun; "
                                                         "ignoring pai's PAI_CURRENT_TASK_ROLE_NAME",)
    assert resolve({"MASTER_ADDR": "10.0.0.5"}).warnings == ()


def test_unknown_interface_flag():
    with pytest.raises(UsageError, match="--interface='nope0'"):
        resolve({}, interface="nope0")


def test_dns_master_is_left_for_run_time_without_network_io():
    topology = resolve({"MASTER_ADDR": "master.invalid", "NNODES": "2", "NODE_RANK": "1"})
    assert topology.interface is None and "run time" in topology.interface_reason


def test_pai_explain_keys():
    env = pai_environment({"worker": 2}, ("worker", 1), {"SyncPort": 1})
    data = resolve(env).to_dict()
    for key in ("source", "nnodes", "node_rank", "nproc_per_node", "world_size", "master_addr", "master_port", "backend", "interface"):
        assert key in data
    assert data["world_size"] == 2


@pytest.mark.parametrize("env", [
    {"TRAINPOD_NNODES": "2:4", "TRAINPOD_RDZV_ENDPOINT": "10.0.0.1:29400"},  # elastic
    {"TRAINPOD_NNODES": "3", "TRAINPOD_RDZV_ENDPOINT": "10.0.0.1:29400"},  # fixed size, the store at an endpoint
])
def test_with_nothing_else_set_a_multi_node_c10d_jobs_rendezvous_numbers_the_nodes(env):
    # Not the single source's node 0 for every node: torch picks the store's host by its address.
    topology = resolve(env)
    assert (topology.source, topology.node_rank) == ("single", None)
    assert topology.origins["node_rank"].startswith("the c10d rendezvous")


def test_spares_are_an_elastic_jobs_on_a_dynamic_rendezvous():
    elastic = {"nnodes": "2:3", "rdzv_backend": "etcd-v3", "rdzv_endpoint": "etcd0:2379"}
    topology = resolve({}, **elastic, spares=1)
    assert topology.rdzv.spares == 1 and topology.origins["spares"] == "--spares"
    assert resolve({"TRAINPOD_SPARES": "2"}, **elastic).rdzv.spares == 2
    assert resolve({}, **elastic).rdzv.spares == 0
    with pytest.raises(UsageError, match=r"^--spares=1: spares are for an elastic job .*a fixed size of 2 node"):
        resolve({}, nnodes="2", master_addr="node0", master_port=29500, node_rank=0, spares=1)
    with pytest.raises(ConfigError, match=r"^TRAINPOD_SPARES=1: torch's etcd rendezvous has no spares .* etcd-v3 or c10d"):
        resolve({"TRAINPOD_SPARES": "1"}, **{**elastic, "rdzv_backend": "etcd"})
    with pytest.raises(ConfigError, match=r"TRAINPOD_SPARES"):
        resolve({"TRAINPOD_SPARES": "-1"}, **elastic)


@pytest.mark.parametrize("flags,needed", [
    ({"nnodes": "2"}, "--master-addr and --node-rank"),
    ({"nnodes": "2", "master_addr": "10.0.0.5"}, "--node-rank"),
    ({"nnodes": "1:2"}, "--master-addr"),
])
def test_nodes_set_up_by_flags_alone_need_the_master_and_their_rank_before_anything_waits(flags, needed):
    # Else every node is node 0 at 127.0.0.1 and waits out the rendezvous alone, restarted to wait again.
    with pytest.raises(UsageError) as error:
        resolve({}, **flags)
    assert str(error.value).startswith(f"--nnodes={flags['nnodes']}: a job of several nodes needs {needed} on every node")
    topology = resolve({}, nnodes="2", master_addr="10.0.0.5", node_rank="1")
    assert (topology.node_rank, topology.master_addr) == (1, "10.0.0.5")
    assert resolve({}, nnodes="2", rdzv_endpoint="10.0.0.5:29400").node_rank is None  # the rendezvous numbers them


@pytest.mark.parametrize("env,flags,refused", [
    ({}, {"rdzv_conf": "is_host=false"}, "--rdzv-conf is_host=false: node 0 hosts the c10d store"),
    ({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "TRAINPOD_RDZV_CONF": "is_host=1"}, {},
     "TRAINPOD_RDZV_CONF is_host=1: node 1 does not host the c10d store"),
    ({}, {"rdzv_conf": "is_host=yes"}, None),  # what trainpod tells torch anyway
])
def test_an_is_host_that_contradicts_the_node_rank_is_refused(env, flags, refused):
    # (A single node told is_host=false waited past --connect-timeout for a store nobody hosts, then a C++ trace.)
    if refused is None:
        assert resolve(env, **flags).rdzv.settings["is_host"] == "yes"
        return
    with pytest.raises((UsageError, ConfigError)) as error:
        resolve(env, **flags)
    assert str(error.value).startswith(refused) and error.value.exit_code == (64 if flags else 78)


def test_what_is_wrong_with_a_value_is_said_as_it_is(tmp_path):
    etcd = {"nnodes": "1:2", "rdzv_backend": "etcd-v3"}
    with pytest.raises(UsageError, match=r"^--rdzv-endpoint='étcd:2379': the host 'étcd': expected a host name \(ASCII"):
        resolve({}, **etcd, rdzv_endpoint="étcd:2379")
    with pytest.raises(UsageError, match=r"^--etcd-password-file='.*': expected a file, and it is a directory$"):
        resolve({}, **etcd, rdzv_endpoint="etcd:2379", etcd_user="u", etcd_password_file=str(tmp_path))
    with pytest.raises(UsageError, match=r"^--etcd-cacert='/dev/null': expected a file, and it is no regular file$"):
        resolve({}, **etcd, rdzv_endpoint="https://etcd:2379", etcd_cacert="/dev/null")
    with pytest.raises(UsageError, match=r"^--node-rank=5: expected a node rank from 0 to 0: the job has 1 node\(s\) \(single"):
        resolve({}, node_rank="5")


def test_another_sources_own_flag_is_a_usage_error_and_its_variable_a_warning():
    # (--pai-roles outside OpenPAI did nothing, without a word; --etcd-* beside c10d were refused already.)
    with pytest.raises(UsageError, match=r"^--pai-roles \(the pai source's\): only for that source, and this job's is single"):
        resolve({}, pai_roles="a,b")
    topology = resolve({"TRAINPOD_PAI_PORT_LABEL": "SyncPort"})
    assert "TRAINPOD_PAI_PORT_LABEL ignored: the single source does not read them" in topology.warnings
