"""`trainpod job kubeflow`: a PyTorchJob the Kubeflow SDK's and Kubernetes' typed models take field for
field, and on which `trainpod explain` places every pod with the variables the operator sets."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fixtures.cli import in_process
from fixtures.kubeflow_runtime import pod_environments


# The SDK's models take seconds of CPU to import: imported by the tests that use them, not when the module is collected
# (each of make test's workers collects every module).
@pytest.fixture(scope="module")
def kubeflow_models():
    return pytest.importorskip("kubeflow.training.models")


@pytest.fixture
def client(kubeflow_models):
    from kubeflow.training.api_client import ApiClient

    return ApiClient()


ENTRYPOINT = str(Path(__file__).resolve().parents[3] / "entrypoint")
CLEAN = {k: v for k, v in os.environ.items() if not k.startswith(("PAI_", "PET_", "TRAINPOD_", "MASTER_", "GLOO_", "NCCL_", "SLURM_"))
         and k not in ("NNODES", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES")}

# The static examples, as a user would ask for them: (trainpod job kubeflow arguments, nodes, processes per node, backend)
JOBS = [
    ("cifar10-ddp --nproc-per-node 2 -- --epochs 1", 2, 2, "gloo"),
    ("cifar10-ddp --nodes 3 --gpus 4", 3, 4, "nccl"),
    ("cifar10-dp --gpus 2", 1, 1, "nccl"),
    ("cifar10-ddp-amp --gpus 4 --backend gloo --term-grace 50", 2, 4, "gloo"),
    ("imagenet-ddp --nodes 4", 4, 8, "nccl"),
]


def trainpod(*args, env=None):
    return subprocess.run([sys.executable, "-m", "trainpod", *args], env={**CLEAN, "PYTHONPATH": ENTRYPOINT, **(env or {})},
                          capture_output=True, text=True, timeout=60)


def here(*args, env=None):
    """trainpod() in this process (fixtures.cli.in_process): nothing here starts a job."""
    return in_process(args, {**CLEAN, "PYTHONPATH": ENTRYPOINT, **(env or {})})


def render(args):
    result = here("job", "kubeflow", *shlex.split(args))
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


class _Response:
    def __init__(self, data):
        self.data = json.dumps(data)


def drop_empty(value):
    if isinstance(value, dict):
        return {k: drop_empty(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_empty(v) for v in value]
    return value


@pytest.mark.slow
@pytest.mark.parametrize("args", [j[0] for j in JOBS])
def test_the_sdk_and_kubernetes_models_take_every_field(args, kubeflow_models, client):
    job = render(args)
    typed = client.deserialize(_Response(job), "KubeflowOrgV1PyTorchJob")
    assert isinstance(typed, kubeflow_models.KubeflowOrgV1PyTorchJob)
    master = typed.spec.pytorch_replica_specs["Master"]
    assert isinstance(master.template, kubeflow_models.V1PodTemplateSpec)  # Kubernetes' own model
    (container,) = master.template.spec.containers
    assert container.name == "pytorch" and container.ports[0].name == "pytorchjob-port"
    assert master.template.spec.volumes[0].empty_dir.medium == "Memory"
    # Round trip: a field the models do not know (a typo, a wrong nesting) would be dropped here.
    assert drop_empty(client.sanitize_for_serialization(typed)) == job


@pytest.mark.parametrize("args,nodes,nproc,backend", JOBS)
def test_what_trainpod_needs_is_in_the_pod(args, nodes, nproc, backend):
    job = render(args)
    spec = job["spec"]
    assert spec["nprocPerNode"] == str(nproc)
    assert sum(r["replicas"] for r in spec["pytorchReplicaSpecs"].values()) == nodes
    assert ("Worker" in spec["pytorchReplicaSpecs"]) == (nodes > 1)
    grace = 80 if "--term-grace 50" in args else 60
    for replica in spec["pytorchReplicaSpecs"].values():
        assert replica["restartPolicy"] == "ExitCode"
        pod = replica["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == grace
        (container,) = pod["containers"]
        assert "command" not in container, "command would replace the image's ENTRYPOINT (tini)"
        assert container["args"][:2] == ["trainpod", "run"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        (volume,) = pod["volumes"]
        assert volume["name"] == "dshm" and volume["emptyDir"]["medium"] == "Memory"
        assert volume["emptyDir"]["sizeLimit"].endswith("Mi")


@pytest.mark.parametrize("args,nodes,nproc,backend", JOBS)
def test_explain_places_every_pod(args, nodes, nproc, backend):
    job = render(args)
    seen = set()
    for rtype, _index, env in pod_environments(job):
        (container,) = job["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"]["containers"]
        gpus = int(container["resources"]["limits"].get("nvidia.com/gpu", 0))
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(gpus)))  # the device plugin's GPUs
        argv = container["args"]
        result = here("explain", "--json", *argv[2:], env=env)
        assert result.returncode == 0, result.stderr
        topology = json.loads(result.stdout)
        assert topology["source"] == "torchrun"
        assert (topology["nnodes"], topology["nproc_per_node"], topology["backend"]) == (nodes, nproc, backend)
        assert topology["world_size"] == int(env["WORLD_SIZE"]) == nodes * nproc
        assert topology["master_addr"] == f"{job['metadata']['name']}-master-0"
        assert topology["master_port"] == 23456
        assert topology["origins"]["nnodes"] == "PET_NNODES" and topology["origins"]["node_rank"] == "PET_NODE_RANK"
        seen.add(topology["node_rank"])
    assert seen == set(range(nodes))


# The elastic example: Worker pods only, and an elasticPolicy (the operator's elastic.go).
ELASTIC = [
    ("imagenet-elastic --gpus 0 -- --checkpoint-dir /shared/ckpt", "c10d", None),
    ("imagenet-elastic --nodes 4 --rdzv-endpoint etcd-0:2379,etcd-1:2379,etcd-2:2379", "etcd-v3", "etcd-0:2379,etcd-1:2379,etcd-2:2379"),
]


@pytest.mark.parametrize("args,backend,endpoint", ELASTIC)
def test_an_elastic_pytorchjob_is_workers_and_an_elastic_policy_the_sdk_takes(args, backend, endpoint, kubeflow_models,
                                                                             client):
    job = render(args)
    typed = client.deserialize(_Response(job), "KubeflowOrgV1PyTorchJob")
    assert isinstance(typed.spec.elastic_policy, kubeflow_models.KubeflowOrgV1ElasticPolicy)
    assert drop_empty(client.sanitize_for_serialization(typed)) == job
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    policy = job["spec"]["elasticPolicy"]
    assert (policy["minReplicas"], policy["maxReplicas"]) == (2, 4)
    assert policy["rdzvBackend"] in ("c10d", "etcd")  # what the operator's enum allows


@pytest.mark.parametrize("args,backend,endpoint", ELASTIC)
def test_explain_finds_the_elastic_rendezvous_in_every_pod(args, backend, endpoint):
    job = render(args)
    name = job["metadata"]["name"]
    pods = list(pod_environments(job))
    assert len(pods) == job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]
    for _rtype, _index, env in pods:
        (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
        result = here("explain", "--json", *container["args"][2:], env=env)
        assert result.returncode == 0, result.stderr
        topology = json.loads(result.stdout)
        rendezvous = topology["rendezvous"]
        assert (rendezvous["min_nodes"], rendezvous["max_nodes"], topology["node_rank"]) == (2, 4, None), topology
        assert rendezvous["elastic"] and rendezvous["backend"] == backend
        assert rendezvous["endpoint"] == (endpoint or f"{name}-worker-0:23456")
        assert topology["origins"]["rdzv_endpoint"] == ("--rdzv-endpoint" if endpoint else "PET_RDZV_ENDPOINT")


# Spares: Worker pods beyond --nodes. The operator sets PET_NNODES from the policy (the spares counted, as it refuses
# replicas above maxReplicas); trainpod's --nnodes and --spares in the pods' args say the job's range and win.
SPARES = [
    ("imagenet-elastic --nodes 3 --spares 1 --gpus 0", 1, "c10d", None),
    ("imagenet-elastic --nodes 3 --spares 2 --rdzv-endpoint etcd-0:2379", 2, "etcd-v3", "etcd-0:2379"),
]


@pytest.mark.parametrize("args,spares,backend,endpoint", SPARES)
def test_spares_are_worker_pods_beyond_the_nodes_and_every_pod_resolves_the_jobs_range(args, spares, backend, endpoint,
                                                                                       client):
    job = render(args)
    typed = client.deserialize(_Response(job), "KubeflowOrgV1PyTorchJob")
    assert drop_empty(client.sanitize_for_serialization(typed)) == job
    worker, policy = job["spec"]["pytorchReplicaSpecs"]["Worker"], job["spec"]["elasticPolicy"]
    assert worker["replicas"] == 3 + spares and (policy["minReplicas"], policy["maxReplicas"]) == (2, 3 + spares)
    pods = list(pod_environments(job))
    assert len(pods) == 3 + spares
    (container,) = worker["template"]["spec"]["containers"]
    for _rtype, _index, env in pods:
        assert env["PET_NNODES"] == f"2:{3 + spares}"
        result = here("explain", "--json", *container["args"][2:], env=env)
        assert result.returncode == 0, result.stderr
        topology = json.loads(result.stdout)
        rendezvous = topology["rendezvous"]
        assert (rendezvous["min_nodes"], rendezvous["max_nodes"], rendezvous["spares"]) == (2, 3, spares), topology
        assert rendezvous["backend"] == backend and topology["origins"]["nnodes"] == "--nnodes"
