"""Kubeflow Trainer v2: a TrainJob (trainer.kubeflow.org/v1alpha1) and the TrainingRuntime it runs on.

What Trainer v2 does with them (kubeflow/trainer, pkg/runtime/framework/plugins/torch): the runtime is
a JobSet template; the replicated job labelled `trainer.kubeflow.org/trainjob-ancestor-step: trainer`
runs one pod per node, and in its container named `node` the torch plugin sets PET_NNODES (the
TrainJob's numNodes), PET_NPROC_PER_NODE (its numProcPerNode), PET_NODE_RANK (the pod's Job completion
index), PET_MASTER_ADDR (`<name>-node-0-0.<name>`, the first pod through the JobSet's headless
Service) and PET_MASTER_PORT (29500). trainpod's torchrun source reads them (environments/torchrun.py).
The TrainJob may not set these variables itself (the plugin refuses them).

The TrainJob carries what a user changes from run to run (image, `trainpod run`'s arguments, nodes,
processes and resources per node); the runtime what a TrainJob cannot say: the shared-memory volume,
the grace period after SIGTERM, a non-root pod, and how a pod's exit code is treated. The container
keeps the image's ENTRYPOINT (tini): both set `args`, never `command`.

Exit codes: unlike a PyTorchJob, a Job has a podFailurePolicy. A pod that ends with a code trainpod
never retries (64 usage, 73 a checkpoint cannot be written, 78 configuration) fails the job at once;
a pod stopped by a disruption (pre-emption, a drained node: the DisruptionTarget condition) is
replaced without counting; any other failure is replaced up to the Job's backoffLimit.

No elastic TrainJob: Trainer v2 has no elastic policy (v2.2 removed the API; elastic PyTorch on
Trainer is KEP-2903, not implemented), so an elastic example is refused here and rendered as a
PyTorchJob (`--api pytorchjob-v1`).
"""

from __future__ import annotations

from typing import Any

from trainpod.contract import EXIT_CANTCREAT, EXIT_CONFIG, EXIT_USAGE
from trainpod.jobs.base import JobRequest

API_VERSION = "trainer.kubeflow.org/v1alpha1"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
NODE = "node"  # the replicated job's and the container's name: the torch plugin sets PET_* in this container only
MASTER_PORT = 29500  # the torch plugin's PET_MASTER_PORT
NEVER_RETRIED = (EXIT_USAGE, EXIT_CANTCREAT, EXIT_CONFIG)  # trainpod's own deterministic failures


def _mib(mib: int) -> str:
    return f"{mib}Mi"


def runtime_name(request: JobRequest) -> str:
    return f"{request.name}-runtime"


def training_runtime(request: JobRequest, *, namespace: str | None, backoff_limit: int) -> dict[str, Any]:
    pod = {
        # SIGTERM: the ranks finish the step and checkpoint within --term-grace; torchrun and supervisord need
        # their margin on top (trainpod.supervisor.supervise.stop_wait_s).
        "terminationGracePeriodSeconds": request.stop_grace_s,
        "restartPolicy": "Never",  # a podFailurePolicy needs it: the Job, not the kubelet, replaces a failed pod
        "securityContext": {"runAsNonRoot": True},
        "containers": [{
            "name": NODE,
            "image": request.image,
            "args": request.run_argv(),
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        }],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": _mib(request.shm_mb)}}],
    }
    job = {
        "backoffLimit": backoff_limit,
        "podFailurePolicy": {"rules": [
            {"action": "FailJob", "onExitCodes": {"containerName": NODE, "operator": "In", "values": list(NEVER_RETRIED)}},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]},
        "template": {"spec": pod},
    }
    metadata: dict[str, Any] = {"name": runtime_name(request)}
    if namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainingRuntime",
        "metadata": metadata,
        "spec": {
            "mlPolicy": {"numNodes": request.nodes, "torch": {}},
            "template": {"spec": {"replicatedJobs": [{
                "name": NODE,
                "template": {"metadata": {"labels": {ANCESTOR_LABEL: "trainer"}}, "spec": job},
            }]}},
        },
    }


def train_job(request: JobRequest, *, namespace: str | None) -> dict[str, Any]:
    resources: dict[str, dict[str, str]] = {
        "requests": {"cpu": str(request.cpus), "memory": _mib(request.memory_mb)},
        "limits": {"memory": _mib(request.memory_mb)},
    }
    if request.gpus:
        resources["limits"]["nvidia.com/gpu"] = str(request.gpus)
    metadata: dict[str, Any] = {"name": request.name}
    if namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": metadata,
        "spec": {
            "runtimeRef": {"apiGroup": API_VERSION.split("/")[0], "kind": "TrainingRuntime", "name": runtime_name(request)},
            "trainer": {
                "image": request.image,
                "args": request.run_argv(),
                "numNodes": request.nodes,
                # A number, never "auto": the plugin would count the pod's GPUs (or CPUs), and trainpod's flag and the
                # example's own count would no longer be the only source of it.
                "numProcPerNode": request.processes_per_node,
                "resourcesPerNode": resources,
            },
        },
    }
