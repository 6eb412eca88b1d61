"""OpenPAI: a job protocol v2 YAML (one task role, one instance per node, gang-allocated).

Written from OpenPAI's protocol documentation (docs/pai-job-protocol.yaml in microsoft/pai and
the schema of microsoft/openpai-protocol; job_protocols/openpai-protocol-v2.schema.json is ours,
from those) and its job exit spec:
- every instance runs `trainpod run ...`, which finds its rank, the master (instance 0's
  PAI_HOST_IP_*) and the master port (the one label reserved here besides ssh/http) in the
  variables OpenPAI sets (environments/pai.py);
- PAI_HOST_IP_* are set only after the gang barrier: `extras.gangAllocation` stays true, and then
  OpenPAI ignores `taskRetryCount`;
- OpenPAI classifies exit codes itself (its cluster-wide job exit spec): 130, 131, 137 and 143 are
  transient and always retried, some signals (SIGSEGV, ...) permanent, everything else "unknown" and
  retried up to `jobRetryCount`. A protocol cannot name exit codes, so it cannot exempt 64 and 78
  from retries: `jobRetryCount` is 0, and trainpod's own restarts (--max-restarts) do the retrying.

An elastic example (imagenet-elastic) meets in etcd (--rdzv-endpoint; OpenPAI runs none): its
nodes need neither the master's address nor each other's, so there is no gang barrier to wait
for (`gangAllocation` false: training starts once MIN nodes are up). A lost instance leaves the
job rather than failing it: `minFailedInstances` is instances - MIN + 1, the first failure that
leaves fewer than MIN; with `minSucceededInstances` -1 the job completes when every instance has,
successfully unless that many failed (FrameworkController's completion policy).
"""

from __future__ import annotations

from typing import Any

from trainpod.environments.pai import PLATFORM_PORT_LABELS
from trainpod.errors import UsageError, error_for
from trainpod.jobs.base import JobRequest, Scheduler, comment, to_yaml
from trainpod.jobs.values import Pattern
from trainpod.settings import Setting
from trainpod.text import printable

# A task role name or port label: OpenPAI's `^[a-zA-Z_][a-zA-Z0-9_]*$` (a C identifier: it becomes part of
# variable names, PAI_HOST_IP_<role>_0); a virtual cluster: a queue's name, no blanks, no leading '-'.
_LABEL = Pattern(r"[A-Za-z_][A-Za-z0-9_]*", "a name of letters, digits and '_' that does not start with a digit")
_VIRTUAL_CLUSTER = Pattern(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,254}", "a virtual cluster's name: letters, digits, '_' and '-', "
                           "not starting with '-'")


IMAGE_REF = "trainpod_image"  # the prerequisite's name, which the task role references


def protocol(request: JobRequest, role: str, port_label: str, virtual_cluster: str) -> dict[str, Any]:
    """The protocol as data (what the YAML holds)."""
    # Every node is needed: one failed instance fails the job, and it succeeds only when all have
    # (rank 0 finishing first must not stop the others' last writes). Elastic: fewer than MIN fail it.
    min_failed = request.started - request.node_range[0] + 1 if request.elastic else 1
    return {
        "protocolVersion": 2,
        "name": request.name,
        "type": "job",
        "contributor": "trainpod",
        "description": f"{request.summary()}: {request.example.description}",
        "prerequisites": [{"name": IMAGE_REF, "type": "dockerimage", "uri": request.image}],
        "jobRetryCount": 0,
        "taskRoles": {
            role: {
                "instances": request.started,  # the spares too: each is an instance that waits
                "completion": {"minFailedInstances": min_failed, "minSucceededInstances": -1},
                "taskRetryCount": 0,
                "dockerImage": IMAGE_REF,
                "resourcePerInstance": {"cpu": request.cpus, "memoryMB": request.memory_mb, "gpu": request.gpus,
                                        "ports": {port_label: 1}},
                "extraContainerOptions": {"shmMB": request.shm_mb},
                "commands": [request.run_command()],
            }
        },
        "defaults": {"virtualCluster": virtual_cluster},
        "extras": {"gangAllocation": not request.elastic},
    }


TEMPLATE_TAG = "<%"  # OpenPAI's mustache tags in a command (rest-server's protocolRender): <% ... %>


class OpenPAIJob(Scheduler):
    name = "openpai"
    description = "an OpenPAI job protocol v2 (YAML): one task role, one instance per node, gang allocation"
    settings = (
        Setting("pai_role", "the task role's name (default worker)", _LABEL, var="TRAINPOD_JOB_PAI_ROLE", default="worker",
                metavar="ROLE"),
        Setting("pai_port_label", "the label of the reserved master port (default SyncPort)", _LABEL,
                var="TRAINPOD_JOB_PAI_PORT_LABEL", default="SyncPort", metavar="LABEL"),
        Setting("virtual_cluster", "the virtual cluster (default default)", _VIRTUAL_CLUSTER, var="TRAINPOD_JOB_VIRTUAL_CLUSTER",
                default="default", metavar="VC"),
    )

    def check(self) -> None:
        if TEMPLATE_TAG in self.request.run_command():
            # OpenPAI's server renders each command as a mustache template with <% %> tags (its parameters and
            # secrets): no quoting keeps it out, and the value would be replaced, or the job refused.
            raise UsageError(f"trainpod job openpai: {TEMPLATE_TAG!r} in the command ({printable(self.request.run_command())}): "
                             "OpenPAI renders each command as a template (<% $parameters.x %>), which would change it; "
                             "pass that value in a variable or a file instead")
        if self.request.elastic and not self.request.rdzv_endpoint:
            raise UsageError(f"trainpod job openpai {self.request.example.name}: an elastic job's nodes meet in etcd, and "
                             "OpenPAI runs none: give --rdzv-endpoint HOST:PORT[,HOST:PORT...] (an etcd cluster the nodes reach)")
        label, origin = self.options.pai_port_label, self.options.origins["pai_port_label"]
        if label in PLATFORM_PORT_LABELS:
            raise error_for(origin)(f"{origin}={label!r}: OpenPAI reserves ssh and http on every task itself; "
                                    "name the master's port something else")

    def data(self) -> dict[str, Any]:
        return protocol(self.request, self.options.pai_role, self.options.pai_port_label, self.options.virtual_cluster)

    def render(self) -> str:
        r, role, label = self.request, self.options.pai_role, self.options.pai_port_label
        if r.elastic:
            low, high = r.node_range
            return comment([
                f"OpenPAI job protocol v2 for trainpod's example {r.summary()}.",
                f"Generated by `{r.generated_by()}`:",
                "regenerate it rather than edit it.",
                "",
                f"An elastic job: the instances meet in etcd at {r.rdzv_endpoint} (etcd's v3 API, any etcd from 3.4 on),",
                "which numbers them; no gang barrier (gangAllocation false), training starts once",
                f"{low} are up. An instance that fails or is lost leaves the job, which goes on from its last",
                f"checkpoint on the others: the job fails only when fewer than {low} could remain (minFailedInstances).",
                "--checkpoint-dir must be storage every instance mounts (a membership change resumes from it).",
                f"The rendezvous id is the job's name and attempt; {high} is the most nodes it would take.",
                *([f"{r.spares} instance(s) beyond {high} wait as spares (torch imported, training nothing) and take the",
                   "place of an instance that is lost, at the same world size; with none left the job goes on smaller."]
                  if r.spares else []),
                f"Replace the image URI ({r.image}) with where you pushed the image.",
            ]) + to_yaml(self.data())
        header = comment([
            f"OpenPAI job protocol v2 for trainpod's example {r.summary()}.",
            f"Generated by `{r.generated_by()}`:",
            "regenerate it rather than edit it.",
            "",
            "On every instance `trainpod run` reads OpenPAI's variables: the node rank from the instance index,",
            f"the master from PAI_HOST_IP_{role}_0, the master port from the {label} label reserved here.",
            "PAI_HOST_IP_* exist only after the gang barrier: keep gangAllocation on (OpenPAI then ignores",
            "taskRetryCount). Retries: trainpod restarts a failed job inside the containers (--max-restarts);",
            "OpenPAI retries exits it deems transient (137, 143, ...) itself, and any other exit up to",
            "jobRetryCount, which stays 0: a protocol cannot exempt 64 and 78 (usage, configuration) from it.",
            f"Replace the image URI ({r.image}) with where you pushed the image.",
        ])
        body = to_yaml(self.data())
        return header + body
