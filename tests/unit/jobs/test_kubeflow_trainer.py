"""`trainpod job kubeflow --api trainer-v2`: a TrainJob and its TrainingRuntime that Kubeflow Trainer's own typed
models (kubeflow-trainer-api, from the Kubeflow SDK) take field for field, and on which `trainpod explain` places
every pod with the variables Trainer's torch plugin sets (fixtures/kubeflow_trainer_runtime.py)."""

import json
import shlex

import pytest
import yaml
from test_kubeflow import CLEAN, ENTRYPOINT, drop_empty

from fixtures.cli import in_process
from fixtures.kubeflow_trainer_runtime import MASTER_PORT, pod_environments


@pytest.fixture(scope="module")
def models():
    # Trainer's models take seconds of CPU to import: imported by the test that uses them, not at collection.
    return pytest.importorskip("kubeflow_trainer_api.models")


JOBS = [
    ("cifar10-ddp --nproc-per-node 2 -- --epochs 1", 2, 2, "gloo"),
    ("cifar10-ddp --nodes 3 --gpus 4", 3, 4, "nccl"),
    ("imagenet-ddp --nodes 4 --namespace team-a", 4, 8, "nccl"),
]


def here(*args, env=None):
    return in_process(args, {**CLEAN, "PYTHONPATH": ENTRYPOINT, **(env or {})})


def render(args: str) -> tuple[dict, dict]:
    result = here("job", "kubeflow", "--api", "trainer-v2", *shlex.split(args))
    assert result.returncode == 0, result.stderr
    runtime, job = yaml.safe_load_all(result.stdout)
    return runtime, job


@pytest.mark.slow
@pytest.mark.parametrize("args", [j[0] for j in JOBS])
def test_trainers_models_take_every_field(args, models):
    runtime, job = render(args)
    typed_runtime = models.TrainerV1alpha1TrainingRuntime.from_dict(runtime)
    typed_job = models.TrainerV1alpha1TrainJob.from_dict(job)
    # Round trip: a field the models do not know (a typo, a wrong nesting) would be dropped here.
    assert drop_empty(typed_runtime.to_dict()) == runtime
    assert drop_empty(typed_job.to_dict()) == job
    (replicated,) = typed_runtime.spec.template.spec.replicated_jobs
    (container,) = replicated.template.spec.template.spec.containers
    assert (replicated.name, container.name) == ("node", "node")  # where the torch plugin sets PET_*
    assert replicated.template.metadata.labels == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    assert typed_job.spec.runtime_ref.name == runtime["metadata"]["name"]
    assert typed_job.spec.runtime_ref.kind == "TrainingRuntime"


@pytest.mark.parametrize("args,nodes,nproc,backend", JOBS)
def test_what_trainpod_needs_is_in_the_pod(args, nodes, nproc, backend):
    runtime, job = render(args)
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (nodes, nproc)
    assert "env" not in trainer or not {e["name"] for e in trainer["env"]} & {"PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR"}
    assert "command" not in trainer, "command would replace the image's ENTRYPOINT (tini)"
    assert trainer["args"][:2] == ["trainpod", "run"]
    job_spec = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job_spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] == 60
    (fail, ignore) = job_spec["podFailurePolicy"]["rules"]
    assert fail["action"] == "FailJob" and fail["onExitCodes"]["values"] == [64, 73, 78]
    assert ignore["action"] == "Ignore" and ignore["onPodConditions"][0]["type"] == "DisruptionTarget"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    assert ("namespace" in job["metadata"]) == ("--namespace" in args) == ("namespace" in runtime["metadata"])


@pytest.mark.parametrize("args,nodes,nproc,backend", JOBS)
def test_explain_places_every_pod(args, nodes, nproc, backend):
    _, job = render(args)
    name = job["metadata"]["name"]
    seen = set()
    for index, env in pod_environments(job):
        gpus = int(job["spec"]["trainer"]["resourcesPerNode"]["limits"].get("nvidia.com/gpu", 0))
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(gpus)))  # the device plugin's GPUs
        result = here("explain", "--json", *job["spec"]["trainer"]["args"][2:], env=env)
        assert result.returncode == 0, result.stderr
        topology = json.loads(result.stdout)
        assert topology["source"] == "torchrun"
        assert (topology["nnodes"], topology["nproc_per_node"], topology["backend"]) == (nodes, nproc, backend)
        assert (topology["master_addr"], topology["master_port"]) == (f"{name}-node-0-0.{name}", MASTER_PORT)
        assert topology["node_rank"] == index
        assert topology["origins"]["master_addr"] == "PET_MASTER_ADDR" and topology["origins"]["node_rank"] == "PET_NODE_RANK"
        seen.add(topology["node_rank"])
    assert seen == set(range(nodes))


def test_an_elastic_example_is_refused_with_one_line_naming_the_flag():
    result = here("job", "kubeflow", "--api", "trainer-v2", "imagenet-elastic")
    assert result.returncode == 64, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "--api trainer-v2: imagenet-elastic is elastic" in line and "use --api pytorchjob-v1" in line, line


def test_a_master_port_is_refused_where_trainer_sets_it():
    result = here("job", "kubeflow", "--api", "trainer-v2", "--master-port", "2222", "cifar10-ddp")
    assert result.returncode == 64 and "--master-port 2222: Kubeflow Trainer v2 sets the master's port itself" in result.stderr


def test_the_default_stays_the_pytorchjob():
    result = here("job", "kubeflow", "cifar10-ddp")
    assert result.returncode == 0 and yaml.safe_load(result.stdout)["kind"] == "PyTorchJob"
