import socket

import pytest

from trainpod.errors import UsageError
from trainpod.launcher.launch import build_plan
from trainpod.launcher.resolve import Options, resolve_topology
from trainpod.runspec import RunSpec, Target
from trainpod.topology import Topology


def plan_for(topology, target, env=None, cpus=1, **run):
    return build_plan(RunSpec(topology=topology, target=target, **run), env or {}, cpus=cpus)


TOPOLOGY = Topology(source="pai", nnodes=2, node_rank=1, nproc_per_node=2, master_addr="10.0.0.2",
                    master_port=29877, backend="gloo", interface="eth1", local_addr="10.0.0.3")


def test_torchrun_arguments():
    plan = plan_for(TOPOLOGY, Target.for_example("cifar10-ddp"), {}, cpus=4)
    argv = plan.argv
    assert argv[1:3] == ["-m", "trainpod.agent"]
    assert plan.agent_args == argv[3:] and plan.agent_args[:2] == ["--nnodes", "2"]  # what trainpod.supervisor.job hands the agent
    joined = " ".join(argv)
    for part in ("--nnodes 2", "--nproc-per-node 2", "--rdzv-backend c10d", "--rdzv-endpoint 10.0.0.2:29877",
                 "--rdzv-conf is_host=false,join_timeout=300", "--local-addr 10.0.0.3", "--max-restarts 3",
                 "--shutdown-timeout 30", "-m trainpod.examples.cifar10"):
        assert part in joined
    assert plan.env["OMP_NUM_THREADS"] == "2"
    assert (plan.env["TRAINPOD_TERM_GRACE"], plan.env["TRAINPOD_BACKEND"]) == ("25", "gloo")  # for the ranks
    run = RunSpec.from_env(plan.env)  # for the agent: the whole run
    assert (run.progress_window, run.rejoin_timeout, run.topology) == (600, 60, TOPOLOGY)
    # torch's default: the agent hosts the workers' store (a new one each round: agent_policy._fresh_workers_store)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in plan.env


def test_node_zero_hosts_the_rendezvous_and_restart_settings_pass_through():
    master = Topology(**{**TOPOLOGY.__dict__, "node_rank": 0, "local_addr": None, "master_addr": "fd00::2", "rendezvous": None})
    plan = plan_for(master, Target(command=("x",)), {}, max_restarts=2, term_grace=40.5, connect_timeout=12)
    joined = " ".join(plan.argv)
    for part in ("--rdzv-endpoint [fd00::2]:29877", "--rdzv-conf is_host=true,join_timeout=12", "--max-restarts 2",
                 "--shutdown-timeout 46"):
        assert part in joined
    assert "--local-addr" not in plan.argv  # unknown: torchrun falls back to the host name
    assert plan.env["TRAINPOD_TERM_GRACE"] == "40.5"


def test_user_command_runs_as_given():
    plan = plan_for(TOPOLOGY, Target(command=("python", "train.py", "--lr", "0.1")), {})
    assert plan.argv[-5:] == ["--no-python", "python", "train.py", "--lr", "0.1"]


def test_interface_is_set_unless_the_user_set_it():
    assert plan_for(TOPOLOGY, Target(command=("x",)), {}).env["GLOO_SOCKET_IFNAME"] == "eth1"
    env = plan_for(TOPOLOGY, Target(command=("x",)), {"NCCL_SOCKET_IFNAME": "^docker"}).env
    assert env["GLOO_SOCKET_IFNAME"] == "eth1" and "NCCL_SOCKET_IFNAME" not in env


def test_no_proxy_includes_the_master():
    env = plan_for(TOPOLOGY, Target(command=("x",)), {"NO_PROXY": "corp.example"}).env
    assert env["NO_PROXY"].split(",")[:2] == ["corp.example", "10.0.0.2"]
    assert env["no_proxy"] == env["NO_PROXY"]


def test_log_prefix_names_node_and_rank():
    assert plan_for(TOPOLOGY, Target(command=("x",)), {}).env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[node1 rank${rank}] "


def test_an_example_says_what_it_needs():
    cifar = Target.for_example("cifar10-ddp", env={})
    assert cifar.needs == ("numpy",) and cifar.shm_mib == 0  # no DataLoader workers: /dev/shm cannot matter
    assert Target.for_example("cifar10-ddp", ["--workers", "2"], env={}).shm_mib == 512
    assert Target.for_example("cifar10-ddp", env={"TRAINPOD_WORKERS": "1"}).shm_mib == 512
    imagenet = Target.for_example("imagenet-ddp", env={})
    assert imagenet.needs == ("numpy", "PIL") and imagenet.shm_mib == 8192
    assert Target.for_example("imagenet-ddp", ["--workers=0"], env={}).shm_mib == 0
    assert Target(command=("python", "x.py")).shm_mib is None  # a command: unknown
    assert Target.from_dict(imagenet.__dict__) == imagenet


def test_unknown_example():
    with pytest.raises(UsageError, match="--example='nope'"):
        Target.for_example("nope")


def test_an_elastic_etcd_v3_job():
    from trainpod.topology import Rendezvous

    topology = Topology(source="etcd", nnodes=4, node_rank=None, nproc_per_node=2, master_addr="10.0.0.9", master_port=2379,
                        backend="gloo", interface="eth0", local_addr="10.0.0.3",
                        rendezvous=Rendezvous(backend="etcd-v3", endpoint="10.0.0.9:2379,10.0.0.10:2379", id="job-1.g3",
                                              min_nodes=2, max_nodes=4))
    plan = plan_for(topology, Target(command=("x",)), {}, connect_timeout=90)
    joined = " ".join(plan.argv)
    for part in ("--nnodes 2:4", "--rdzv-backend etcd-v3", "--rdzv-endpoint 10.0.0.9:2379,10.0.0.10:2379", "--rdzv-id=job-1.g3",
                 "--rdzv-conf join_timeout=90 "):
        assert part in joined
    assert "is_host" not in joined  # no store to host: the state is in etcd
    # The node's rank comes from the rendezvous (and may change): its lines name the host instead.
    assert plan.env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == f"[node@{socket.gethostname().split('.')[0]} rank${{rank}}] "
    run = RunSpec.from_env(plan.env)
    assert (run.topology.nnodes, run.topology.rdzv.min_nodes, run.topology.rdzv.elastic) == (4, 2, True)
    assert "10.0.0.10" in plan.env["NO_PROXY"].split(",")


def test_torchs_etcd_backend_calls_its_join_timeout_timeout():
    from trainpod.topology import Rendezvous

    topology = Topology(source="etcd", nnodes=2, node_rank=None, nproc_per_node=1, master_addr="e", master_port=2379,
                        backend="gloo", interface="lo",
                        rendezvous=Rendezvous(backend="etcd", endpoint="e:2379", id="j", min_nodes=1, max_nodes=2))
    assert "--rdzv-conf timeout=60" in " ".join(plan_for(topology, Target(command=("x",)), {}, connect_timeout=60).argv)


def test_a_rendezvous_id_that_starts_with_a_dash_stays_the_value_of_rdzv_id():
    # A job named '-exp1' (--rdzv-id, TRAINPOD_RDZV_ID, PET_RDZV_ID): torchrun's parser took '--rdzv-id -exp1' for two flags.
    topology = resolve_topology(Options(rdzv_id="-exp1"), {}, resolve_names=False)
    plan = plan_for(topology, Target(command=("x",)), {})
    assert "--rdzv-id=-exp1" in plan.argv and "-exp1" not in plan.argv
