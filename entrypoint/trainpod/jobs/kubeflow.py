"""Kubeflow: a PyTorchJob (kubeflow.org/v1, the training operator) with a Master and Workers, one pod per node.

What the operator does with it (pkg/controller.v1/pytorch/envvar.go in kubeflow/training-operator):
every pod's container named `pytorch` gets MASTER_ADDR (`<name>-master-0`, a Service), MASTER_PORT
(the Master container's port named `pytorchjob-port`), WORLD_SIZE (pods x nprocPerNode), RANK and
PET_NODE_RANK (the Master 0, Worker i i+1), PET_NPROC_PER_NODE and PET_NNODES; trainpod's torchrun
source reads them (environments/torchrun.py).

The pods keep the image's ENTRYPOINT (tini as PID 1): the job sets `args`, never `command`.
Exit codes: a PyTorchJob has no podFailurePolicy (a batch/v1 Job's field); the closest it allows is
`restartPolicy: ExitCode`, under which 1-127 (64, 69, 78, the training's own codes) fail the job
at once and 128-255 (137 killed, 143 stopped and checkpointed, 130) restart the pod, counted
against `runPolicy.backoffLimit`.

An elastic example (imagenet-elastic) is an elastic PyTorchJob: Worker pods only, and an
`elasticPolicy` (pkg/controller.v1/pytorch/elastic.go) from which the operator sets PET_NNODES
(MIN:MAX), PET_RDZV_BACKEND and PET_RDZV_ENDPOINT instead of MASTER_ADDR/RANK. Without
--rdzv-endpoint: c10d on `<name>-worker-0` (the operator's default host, the port named
pytorchjob-port), which works with nothing else installed but makes worker 0 the job's single
point of failure. With --rdzv-endpoint (etcd): the policy names etcd (the operator accepts only
c10d, etcd and etcd-v2, all of which speak etcd's v2 API) and trainpod's flags, which win over the
variables, pick etcd-v3, so any etcd from 3.4 on serves, with all the endpoints given.
"""

from __future__ import annotations

from typing import Any

from trainpod.errors import UsageError
from trainpod.jobs import kubeflow_trainer
from trainpod.jobs.base import MASTER_PORT_VAR, JobRequest, Scheduler, comment, to_yaml
from trainpod.jobs.values import DnsLabel
from trainpod.settings import Choice, Integer, Setting

CONTAINER = "pytorch"  # the operator's default container name: only it gets the variables
PORT_NAME = "pytorchjob-port"  # the operator's default port name: MASTER_PORT comes from it
APIS = ("pytorchjob-v1", "trainer-v2")
DEFAULT_PORT = 23456  # the operator's default


def _quantity_mib(mib: int) -> str:
    return f"{mib}Mi"


def pytorchjob(request: JobRequest, *, namespace: str | None, master_port: int, backoff_limit: int) -> dict[str, Any]:
    resources: dict[str, dict[str, str]] = {
        "requests": {"cpu": str(request.cpus), "memory": _quantity_mib(request.memory_mb)},
        "limits": {"memory": _quantity_mib(request.memory_mb)},
    }
    if request.gpus:
        resources["limits"]["nvidia.com/gpu"] = str(request.gpus)
    container = {
        "name": CONTAINER,
        "image": request.image,
        "args": request.run_argv(),
        "ports": [{"name": PORT_NAME, "containerPort": master_port, "protocol": "TCP"}],
        "resources": resources,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    template = {
        "spec": {
            # SIGTERM: the ranks finish the step and checkpoint within --term-grace; torchrun and
            # supervisord need their margin on top (trainpod.supervisor.supervise.stop_wait_s).
            "terminationGracePeriodSeconds": request.stop_grace_s,
            "securityContext": {"runAsNonRoot": True},
            "containers": [container],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": _quantity_mib(request.shm_mb)}}],
        }
    }

    def replicas(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": "ExitCode", "template": template}

    if request.elastic:
        specs = {"Worker": replicas(request.started)}
    else:
        specs = {"Master": replicas(1)}
        if request.nodes > 1:
            specs["Worker"] = replicas(request.nodes - 1)
    metadata: dict[str, Any] = {"name": request.name}
    if namespace:
        metadata["namespace"] = namespace
    spec: dict[str, Any] = {"nprocPerNode": str(request.processes_per_node), "runPolicy": {"backoffLimit": backoff_limit}}
    if request.elastic:
        spec["elasticPolicy"] = elastic_policy(request)
    spec["pytorchReplicaSpecs"] = specs
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": metadata, "spec": spec}


def elastic_policy(request: JobRequest) -> dict[str, Any]:
    low, high = request.node_range
    # The operator refuses Worker replicas above maxReplicas: the spares count there (trainpod's --nnodes says the job's).
    policy: dict[str, Any] = {"rdzvBackend": "c10d", "minReplicas": low, "maxReplicas": high + request.spares}
    if request.rdzv_endpoint:
        # The first endpoint, without an https:// (the operator's fields are a host and a port).
        host, _, port = request.rdzv_endpoint.split(",")[0].split("://", 1)[-1].rpartition(":")
        policy.update(rdzvBackend="etcd", rdzvHost=host.strip("[]"), rdzvPort=int(port))
    return policy


class KubeflowJob(Scheduler):
    name = "kubeflow"
    description = ("a Kubeflow PyTorchJob (kubeflow.org/v1: a Master pod and Worker pods, one per node), or with --api "
                   "trainer-v2 a Kubeflow Trainer v2 TrainJob and its TrainingRuntime")
    settings = (
        Setting("api", "pytorchjob-v1: a PyTorchJob for the training operator (v1), elastic examples too; trainer-v2: a "
                "TrainJob for Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1) and the TrainingRuntime it runs on, "
                "fixed-size jobs only (Trainer v2 has no elastic policy)", Choice(APIS), var="TRAINPOD_JOB_KUBEFLOW_API",
                default=APIS[0]),
        # A namespace is a DNS-1123 label (Kubernetes refuses anything else, but only when the job is applied).
        Setting("namespace", "the PyTorchJob's namespace (default: none, kubectl's current one)", DnsLabel(63),
                var="TRAINPOD_JOB_NAMESPACE", metavar="NS"),
        Setting("master_port", "the Master's port, named pytorchjob-port (default 23456, the operator's)", Integer(1, 65535),
                var=MASTER_PORT_VAR, default=DEFAULT_PORT, metavar="PORT"),
        Setting("backoff_limit", "pod restarts (pytorchjob-v1: exit 128-255; trainer-v2: any failure but 64, 73, 78 and "
                "a disruption) before the job fails (default 3)", Integer(0, 1000),
                var="TRAINPOD_JOB_BACKOFF_LIMIT", default=3),
    )

    def check(self) -> None:
        if self.options.api == "trainer-v2" and self.request.elastic:
            raise UsageError(f"--api trainer-v2: {self.request.example.name} is elastic, and Kubeflow Trainer v2 has no elastic "
                             "TrainJob (its elastic policy was removed in v2.2; KEP-2903 is open): use --api pytorchjob-v1")
        if self.options.api == "trainer-v2" and self.options.master_port != DEFAULT_PORT:
            raise UsageError(f"--master-port {self.options.master_port}: Kubeflow Trainer v2 sets the master's port itself "
                             f"({kubeflow_trainer.MASTER_PORT}): leave it out with --api trainer-v2")

    def data(self) -> dict[str, Any]:
        return pytorchjob(self.request, namespace=self.options.namespace, master_port=self.options.master_port,
                          backoff_limit=self.options.backoff_limit)

    def trainer_v2(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the TrainingRuntime, the TrainJob) of --api trainer-v2."""
        runtime = kubeflow_trainer.training_runtime(self.request, namespace=self.options.namespace,
                                                    backoff_limit=self.options.backoff_limit)
        return runtime, kubeflow_trainer.train_job(self.request, namespace=self.options.namespace)

    def render(self) -> str:
        r = self.request
        if self.options.api == "trainer-v2":
            runtime, job = self.trainer_v2()
            return comment([
                f"Kubeflow Trainer v2 TrainJob for trainpod's example {r.summary()}, and the TrainingRuntime it runs on.",
                f"Generated by `{r.generated_by()}`.",
                "",
                "Apply both (kubectl apply -f): the runtime first. Trainer's torch plugin gives each pod's `node`",
                "container PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT",
                f"({r.name}-node-0-0.{r.name}:{kubeflow_trainer.MASTER_PORT}); `trainpod run` reads them.",
                "Exit codes: the Job's podFailurePolicy fails the job at once on 64, 73 and 78 (trainpod never retries",
                "them), replaces a disrupted pod (pre-emption) without counting it, and any other failed pod up to",
                "backoffLimit. terminationGracePeriodSeconds: --term-grace + 30 s (at least 60).",
            ]) + to_yaml(runtime) + "---\n" + to_yaml(job)
        if r.elastic:
            low, high = r.node_range
            where = (f"etcd at {r.rdzv_endpoint} (trainpod's etcd-v3: any etcd from 3.4 on)" if r.rdzv_endpoint else
                     f"c10d on {r.name}-worker-0: losing that pod ends the job; give --rdzv-endpoint (etcd) to avoid it")
            return comment([
                f"Kubeflow elastic PyTorchJob for trainpod's example {r.summary()}.",
                f"Generated by `{r.generated_by()}`.",
                "",
                f"Worker pods only; the operator sets PET_NNODES={low}:{high + r.spares}, PET_RDZV_BACKEND and PET_RDZV_ENDPOINT",
                f"(elasticPolicy) and `trainpod run` reads them. The pods meet in {where}.",
                *([f"{r.spares} Worker pod(s) beyond {high} wait as spares (trainpod's --nnodes {low}:{high} --spares {r.spares},",
                   "which win over PET_NNODES) and take the place of a lost pod at the same world size."] if r.spares else []),
                "Scale by changing Worker replicas within minReplicas..maxReplicas: the workers restart from the",
                "last checkpoint in --checkpoint-dir, which must be a volume every pod mounts (ReadWriteMany).",
                "Exit codes and the grace period: as for the static PyTorchJob (restartPolicy ExitCode).",
            ]) + to_yaml(self.data())
        header = comment([
            f"Kubeflow PyTorchJob for trainpod's example {r.summary()}.",
            f"Generated by `{r.generated_by()}`.",
            "",
            "The training operator gives every pod MASTER_ADDR/MASTER_PORT, WORLD_SIZE, RANK and PET_NNODES,",
            "PET_NODE_RANK, PET_NPROC_PER_NODE; `trainpod run` reads them. Exit codes: restartPolicy ExitCode",
            "fails the job at once on 1-127 (64 usage, 78 configuration, 69 master unreachable after trainpod's",
            "own restarts, the training's codes) and restarts the pod on 128-255 (137, 143) up to backoffLimit;",
            "a PyTorchJob has no podFailurePolicy. terminationGracePeriodSeconds: --term-grace + 30 s (at least 60).",
        ])
        return header + to_yaml(self.data())
