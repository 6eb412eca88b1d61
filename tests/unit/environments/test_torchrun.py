import pytest

from trainpod.environments.torchrun import TorchrunEnvironment
from trainpod.errors import ConfigError, UsageError
from trainpod.launcher.resolve import Options, resolve_topology

# What Kubeflow Trainer (TrainJob, torch runtime) sets on a node: torchrun's own PET_* variables.
KUBEFLOW_TRAINER = {
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "4",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "mnist-node-0-0.mnist",
    "PET_MASTER_PORT": "29400",
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    "HOSTNAME": "mnist-node-0-1",
}

# What the older PyTorchJob operator sets on a worker pod (one process per pod).
PYTORCHJOB_V1 = {
    "MASTER_ADDR": "pytorch-dist-mnist-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "3",
    "RANK": "2",
    "PYTHONUNBUFFERED": "0",
}


def discover(env):
    return TorchrunEnvironment(env).discover()


def test_kubeflow_trainer_variables():
    found = discover(KUBEFLOW_TRAINER)
    assert (found.nnodes, found.node_rank, found.master_addr, found.master_port) == (2, 1, "mnist-node-0-0.mnist", 29400)
    assert found.origins["node_rank"] == "PET_NODE_RANK"


def test_pet_nproc_per_node_is_used():
    topology = resolve_topology(Options(), KUBEFLOW_TRAINER, resolve_names=False)
    assert topology.nproc_per_node == 4 and topology.world_size == 8
    assert topology.source == "torchrun"


def test_pytorchjob_world_size_counts_nodes():
    found = discover(PYTORCHJOB_V1)
    assert (found.nnodes, found.node_rank) == (3, 2)
    assert found.origins["nnodes"] == "WORLD_SIZE"


def test_world_size_is_ignored_inside_a_torchrun_worker():
    env = {**PYTORCHJOB_V1, "LOCAL_RANK": "0"}
    found = discover(env)
    assert found.nnodes == 1 and found.node_rank == 0


# What torchrun 2.13 sets in the second worker of `torchrun --nproc-per-node 2 ...` (printed by one).
TORCHRUN_WORKER = {
    "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500", "RANK": "1", "ROLE_NAME": "default", "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "2",
    "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "WORLD_SIZE": "2",
}


@pytest.mark.parametrize("cluster", [{}, KUBEFLOW_TRAINER], ids=["alone", "in-a-kubeflow-pod"])
def test_trainpod_started_by_torchrun_is_refused_in_one_line_naming_the_variable(cluster):
    # `torchrun --nproc-per-node 2 -m trainpod run ...`: each rank would be a job of its own at world 1, on one port.
    with pytest.raises(ConfigError) as error:
        resolve_topology(Options(), {**cluster, **TORCHRUN_WORKER}, resolve_names=False)
    assert str(error.value).startswith("TORCHELASTIC_RUN_ID='none', LOCAL_RANK='1': this trainpod runs as a rank that torchrun started")
    assert "run `trainpod run` in place of torchrun" in str(error.value) and error.value.exit_code == 78


def test_pet_wins_over_plain_variables():
    env = {**KUBEFLOW_TRAINER, "MASTER_ADDR": "other", "NNODES": "7", "NODE_RANK": "6"}
    found = discover(env)
    assert (found.nnodes, found.node_rank, found.master_addr) == (2, 1, "mnist-node-0-0.mnist")


def test_plain_nnodes_and_node_rank():
    found = discover({"MASTER_ADDR": "10.0.0.5", "NNODES": "4", "NODE_RANK": "3"})
    assert (found.nnodes, found.node_rank, found.master_port) == (4, 3, 29500)


def test_equal_elastic_range_is_static():
    assert discover({**KUBEFLOW_TRAINER, "PET_NNODES": "2:2"}).nnodes == 2


def test_flags_override():
    topology = resolve_topology(Options(master_addr="10.1.1.1", master_port=1234, nproc_per_node=1), KUBEFLOW_TRAINER, resolve_names=False)
    assert (topology.master_addr, topology.master_port, topology.nproc_per_node) == ("10.1.1.1", 1234, 1)
    assert topology.origins["master_port"] == "--master-port"


def error(env, **flags):
    with pytest.raises((ConfigError, UsageError)) as caught:
        resolve_topology(Options(**flags), env, resolve_names=False)
    assert "\n" not in str(caught.value)
    return caught.value


def test_node_rank_not_below_nnodes():
    e = error({"MASTER_ADDR": "10.0.0.5", "NNODES": "2", "NODE_RANK": "2"})
    assert e.exit_code == 78 and "NODE_RANK=2" in str(e) and "NNODES=2" in str(e)


def test_conflicting_flags():
    e = error({}, nnodes=2, node_rank=2, master_addr="10.0.0.5")
    assert e.exit_code == 64 and "--node-rank=2" in str(e) and "--nnodes=2" in str(e)


# What Kubeflow's elastic PyTorchJob sets (elasticPolicy: minReplicas/maxReplicas, rdzvBackend c10d).
KUBEFLOW_ELASTIC = {
    "PET_NNODES": "1:4",
    "PET_NPROC_PER_NODE": "1",
    "PET_RDZV_BACKEND": "c10d",
    "PET_RDZV_ENDPOINT": "elastic-example-worker-0:23456",
    "PET_RDZV_ID": "elastic-example",
    "PET_MAX_RESTARTS": "10",
    "HOSTNAME": "elastic-example-worker-2",
}


def test_an_elastic_range_over_c10d_needs_no_node_rank():
    topology = resolve_topology(Options(), {**KUBEFLOW_TRAINER, "PET_NNODES": "1:4"}, resolve_names=False)
    rdzv = topology.rdzv
    assert (rdzv.min_nodes, rdzv.max_nodes, rdzv.elastic, rdzv.nnodes, topology.nnodes) == (1, 4, True, "1:4", 4)
    assert rdzv.backend == "c10d" and rdzv.endpoint == "mnist-node-0-0.mnist:29400"


def test_kubeflow_elastic_variables():
    topology = resolve_topology(Options(), KUBEFLOW_ELASTIC, resolve_names=False)
    rdzv = topology.rdzv
    assert (rdzv.backend, rdzv.endpoint, rdzv.id, rdzv.nnodes) == ("c10d", "elastic-example-worker-0:23456", "elastic-example", "1:4")
    assert (topology.master_addr, topology.master_port) == ("elastic-example-worker-0", 23456)
    assert topology.node_rank is None  # torch picks the store's host by its address
    assert topology.max_restarts == 10 and topology.origins["max_restarts"] == "PET_MAX_RESTARTS"
    assert (topology.origins["rdzv_endpoint"], topology.origins["rdzv_id"]) == ("PET_RDZV_ENDPOINT", "PET_RDZV_ID")


def test_flags_override_the_pet_rendezvous():
    topology = resolve_topology(Options(rdzv_backend="etcd-v3", rdzv_endpoint="etcd:2379", nnodes="2:3"), KUBEFLOW_ELASTIC,
                                resolve_names=False)
    assert (topology.rdzv.backend, topology.rdzv.endpoint, topology.rdzv.nnodes) == ("etcd-v3", "etcd:2379", "2:3")
    assert topology.node_rank is None and topology.origins["rdzv_backend"] == "--rdzv-backend"


@pytest.mark.parametrize("var,value", [("PET_NNODES", "4:1"), ("PET_NNODES", "1:x"), ("PET_RDZV_BACKEND", "zookeeper"),
                                       ("PET_MAX_RESTARTS", "-1")])
def test_bad_rendezvous_variables_name_the_variable(var, value):
    e = error({**KUBEFLOW_ELASTIC, var: value})
    assert e.exit_code == 78 and f"{var}={value!r}" in str(e)


@pytest.mark.parametrize(
    "var,value", [("PET_NODE_RANK", "x"), ("PET_MASTER_PORT", "99999"), ("PET_NNODES", "0"), ("PET_NPROC_PER_NODE", "many")]
)
def test_bad_values_name_the_variable(var, value):
    e = error({**KUBEFLOW_TRAINER, var: value})
    assert e.exit_code == 78 and f"{var}={value!r}" in str(e)


def test_missing_node_rank_on_a_multi_node_job():
    e = error({"MASTER_ADDR": "10.0.0.5", "NNODES": "2"})
    assert e.exit_code == 78 and "NODE_RANK" in str(e)


def test_missing_master_on_a_multi_node_job():
    e = error({"NNODES": "2", "NODE_RANK": "1"})
    assert e.exit_code == 78 and "MASTER_ADDR" in str(e)


def test_pet_and_plain_variables_that_disagree_are_one_warning():
    env = {**KUBEFLOW_TRAINER, "MASTER_ADDR": "other-master", "NODE_RANK": "0", "NNODES": "2"}  # NNODES agrees
    (warning,) = discover(env).warnings
    assert warning == ("PET_* and plain variables disagree: using torchrun's PET_NODE_RANK='1', PET_MASTER_ADDR='mnist-node-0-0.mnist'; "
                       "ignoring NODE_RANK='0', MASTER_ADDR='other-master'")
    assert discover({**KUBEFLOW_TRAINER, "MASTER_ADDR": "mnist-node-0-0.mnist"}).warnings == ()


def test_kubernetes_link_to_a_service_named_master_is_no_port():
    # Every pod of a namespace with a Service named master gets MASTER_PORT=tcp://<cluster IP>:<port> (service links).
    link = {"MASTER_PORT": "tcp://10.96.0.12:29500", "MASTER_SERVICE_HOST": "10.96.0.12", "MASTER_SERVICE_PORT": "29500"}
    assert resolve_topology(Options(), link, resolve_names=False).source == "single"  # not a torchrun job's variable
    topology = resolve_topology(Options(), {**PYTORCHJOB_V1, **link}, resolve_names=False)
    assert (topology.master_port, topology.origins["master_port"]) == (29500, "default")
    assert any(w.startswith("MASTER_PORT='tcp://10.96.0.12:29500' is Kubernetes' link to a Service named master, not a port")
               for w in topology.warnings)


@pytest.mark.parametrize("var,value,flag,given", [
    ("MASTER_PORT", "abc", "master_port", "29400"),
    ("NODE_RANK", "x", "node_rank", "1"),
    ("PET_NNODES", "two", "nnodes", "3"),
    ("PET_NPROC_PER_NODE", "many", "nproc_per_node", "2"),
    ("PET_MAX_RESTARTS", "x", "max_restarts", "3"),
])
def test_a_malformed_variable_that_a_flag_replaces_is_no_error(var, value, flag, given):
    env = {**PYTORCHJOB_V1, var: value}
    with pytest.raises(ConfigError, match=f"^{var}="):
        resolve_topology(Options(), env, resolve_names=False)
    flags = {flag: given, "node_rank": "2"}  # (a node of 3 still says its rank: no variable gives it then)
    resolve_topology(Options(**flags), env, resolve_names=False)  # flags override variables, however they read
