"""The SLURM source, from the variables SLURM's sbatch and srun manuals document for a job step."""

import pytest

from trainpod import environments
from trainpod.environments.slurm import PORT_BASE, SlurmEnvironment, derived_port, expand_counts, expand_hostlist
from trainpod.errors import ConfigError
from trainpod.launcher.resolve import Options, resolve_topology

# What srun sets in the task it starts on the second node of `sbatch --nodes=3 --ntasks-per-node=1`
# followed by `srun trainpod run ...` (names as in the srun manual's OUTPUT ENVIRONMENT VARIABLES).
STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOBID": "4242",
    "SLURM_JOB_NAME": "trainpod-cifar10-ddp",
    "SLURM_JOB_NODELIST": "node[01-02],gpu-a7",
    "SLURM_NODELIST": "node[01-02],gpu-a7",
    "SLURM_NNODES": "3",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_STEP_NODELIST": "node[01-02],gpu-a7",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
    "SLURM_TASKS_PER_NODE": "1(x3)",
    "SLURM_NTASKS": "3",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURMD_NODENAME": "node02",
    "SLURM_CPUS_ON_NODE": "8",
    "SLURM_SUBMIT_DIR": "/home/alice",
}


@pytest.mark.parametrize("expression,hosts", [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[01-03,07],gpu-a[1-2]", ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("a,b,c", ["a", "b", "c"]),
    ("rack[1-2]-gpu[1,3]", ["rack1-gpu1", "rack1-gpu3", "rack2-gpu1", "rack2-gpu3"]),
    ("tux[2,1-2]x", ["tux2x", "tux1x", "tux2x"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
])
def test_hostlist_expressions_expand_in_order(expression, hosts):
    assert expand_hostlist(expression) == hosts


@pytest.mark.parametrize("expression", ["", "node[1-", "node1-3]", "node[a-b]", "node[3-1]", "node[]", "a,,b", "node[1-2", "x y"])
def test_malformed_hostlists_are_refused(expression):
    with pytest.raises(ValueError):
        expand_hostlist(expression)


def test_a_step_on_the_second_node():
    found = SlurmEnvironment(STEP).discover()
    assert (found.nnodes, found.node_rank, found.master_addr) == (3, 1, "node01")
    assert found.master_port == derived_port(4242) == PORT_BASE + 4242
    assert found.nproc_per_node is None  # one task per node: the node decides (its GPUs, else 1)
    assert found.origins["node_rank"] == "SLURM_NODEID" and found.origins["nnodes"] == "SLURM_STEP_NUM_NODES"
    assert found.origins["master_addr"] == "SLURM_STEP_NODELIST (first host)"


def test_detected_before_torchrun_and_resolved():
    env = {**STEP, "MASTER_ADDR": "ignored-by-slurm"}  # scripts often export it; SLURM's own list wins
    assert environments.select(env).name == "slurm"
    topology = resolve_topology(Options(), env, resolve_names=False)
    assert (topology.source, topology.nnodes, topology.node_rank, topology.master_addr) == ("slurm", 3, 1, "node01")
    assert topology.nproc_per_node == 1 and topology.backend == "gloo"


def test_the_job_list_serves_outside_a_step_and_the_step_list_wins_inside_one():
    batch = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP_")}
    batch["SLURM_NODEID"] = "0"
    assert SlurmEnvironment(batch).discover().origins["nnodes"] == "SLURM_NNODES"
    sub_step = {**STEP, "SLURM_STEP_NODELIST": "node02,gpu-a7", "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "0"}
    found = SlurmEnvironment(sub_step).discover()
    assert (found.nnodes, found.master_addr) == (2, "node02")


def test_gpus_on_the_node_give_the_processes():
    found = SlurmEnvironment({**STEP, "SLURM_GPUS_ON_NODE": "4"}).discover()
    assert (found.nproc_per_node, found.origins["nproc_per_node"]) == (4, "SLURM_GPUS_ON_NODE")
    topology = resolve_topology(Options(), {**STEP, "SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1,2,3"},
                                resolve_names=False)
    assert topology.nproc_per_node == 4 and topology.world_size == 12 and topology.backend == "nccl"


def test_tasks_per_node_give_the_processes_without_gpus():
    found = SlurmEnvironment({**STEP, "SLURM_NTASKS_PER_NODE": "2"}).discover()
    assert (found.nproc_per_node, found.origins["nproc_per_node"]) == (2, "SLURM_NTASKS_PER_NODE")


@pytest.mark.parametrize("expression,counts", [("1", [1]), ("1(x3)", [1, 1, 1]), ("2(x2),1", [2, 2, 1]), ("1,4(x2)", [1, 4, 4])])
def test_tasks_per_node_expressions_expand_in_node_order(expression, counts):
    assert expand_counts(expression) == counts


@pytest.mark.parametrize("local_id", ["0", "1"])
def test_a_step_that_runs_two_tasks_per_node_is_refused_by_each_of_them(local_id):
    # `#SBATCH --nodes=3 --ntasks-per-node=2` then a bare `srun trainpod run ...` (one task per GPU, as other
    # launchers want): two trainpods per node would each claim the node's rank and the master's port.
    step = {**STEP, "SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_TASKS_PER_NODE": "2(x3)", "SLURM_TASKS_PER_NODE": "2(x3)",
            "SLURM_NTASKS": "6", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": str(2 + int(local_id)), "SLURM_LOCALID": local_id}
    with pytest.raises(ConfigError) as error:
        resolve_topology(Options(), step, resolve_names=False)
    message = str(error.value)
    assert message.startswith("SLURM_STEP_TASKS_PER_NODE='2(x3)': srun started 2 tasks on a node")
    assert "`srun --ntasks=$SLURM_NNODES --ntasks-per-node=1 trainpod run ...`" in message  # the fix, checked on compose/slurm
    assert "\n" not in message and error.value.exit_code == 78


def test_a_second_task_on_a_node_is_refused_where_srun_does_not_say_the_steps_layout():
    step = {k: v for k, v in STEP.items() if k != "SLURM_STEP_TASKS_PER_NODE"}
    with pytest.raises(ConfigError, match=r"^SLURM_LOCALID=1: srun started more than one task on this node"):
        SlurmEnvironment({**step, "SLURM_LOCALID": "1"}).discover()
    assert SlurmEnvironment({**step, "SLURM_LOCALID": "0"}).discover().node_rank == 1


def test_master_port_given_or_derived_and_flags_win():
    assert SlurmEnvironment({**STEP, "MASTER_PORT": "29400"}).discover().master_port == 29400
    assert SlurmEnvironment({**STEP, "SLURM_JOB_ID": "99999"}).discover().master_port == PORT_BASE + 99999 % 15000
    topology = resolve_topology(Options(master_port="31000", master_addr="10.0.0.1"), STEP, resolve_names=False)
    assert (topology.master_port, topology.master_addr) == (31000, "10.0.0.1")


@pytest.mark.parametrize("change,named", [
    ({"SLURM_STEP_NODELIST": "node[1-"}, "SLURM_STEP_NODELIST='node[1-'"),
    ({"SLURM_STEP_NUM_NODES": "2"}, "SLURM_STEP_NUM_NODES=2 but SLURM_STEP_NODELIST"),
    ({"SLURM_STEP_NUM_NODES": "x"}, "SLURM_STEP_NUM_NODES='x'"),
    ({"SLURM_NODEID": "3"}, "SLURM_NODEID=3"),
    ({"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID='abc'"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT='0'"),
    ({"SLURM_GPUS_ON_NODE": "many"}, "SLURM_GPUS_ON_NODE='many'"),
    ({"SLURM_STEP_NODELIST": "a,a"}, "names a host twice"),
    ({"SLURM_STEP_TASKS_PER_NODE": "1(3)"}, "SLURM_STEP_TASKS_PER_NODE='1(3)': expected srun's tasks per node"),
    ({"SLURM_LOCALID": "first"}, "SLURM_LOCALID='first'"),
])
def test_bad_variables_are_one_line_configuration_errors(change, named):
    with pytest.raises(ConfigError, match=None) as error:
        resolve_topology(Options(), {**STEP, **change}, resolve_names=False)
    assert named in str(error.value) and error.value.exit_code == 78


def test_a_node_without_a_node_id_needs_srun():
    env = {k: v for k, v in STEP.items() if k != "SLURM_NODEID"}
    with pytest.raises(ConfigError, match="SLURM_NODEID is not set"):
        resolve_topology(Options(), env, resolve_names=False)
    topology = resolve_topology(Options(node_rank="2"), env, resolve_names=False)
    assert topology.node_rank == 2


def test_forced_outside_slurm():
    with pytest.raises(ConfigError, match="SLURM_JOB_ID is not set"):
        resolve_topology(Options(source="slurm"), {}, resolve_names=False)


def test_the_job_its_step_and_its_restart_count_name_the_rendezvous():
    found = SlurmEnvironment({**STEP, "SLURM_STEP_ID": "3", "SLURM_RESTART_COUNT": "1"}).discover()
    assert found.job_id == "slurm-4242-s3-r1"
    assert found.origins["job_id"] == "SLURM_JOB_ID + SLURM_STEP_ID + SLURM_RESTART_COUNT"


@pytest.mark.parametrize("expression", ["a[1-65535]b[1-65535]", "a[1-60000,1-60000]", "a[1-40000],b[1-40000]", "a[1-" + "9" * 5000 + "]"])
def test_a_hostlist_of_more_nodes_than_any_job_is_refused_before_it_is_expanded(expression):
    # (found by tests/unit/test_fuzz.py: 'a[1-65535]b[1-65535]' was expanded to 4.3e9 names, hanging the node)
    with pytest.raises(ValueError):
        expand_hostlist(expression)
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST="):
        SlurmEnvironment({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": expression}).discover()
    assert len(expand_hostlist("a[1-65535],b")) == 65536
