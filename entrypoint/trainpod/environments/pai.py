"""OpenPAI: the runtime's PAI_* variables (job protocol v2 and the older runtime's spellings).

The variables are described in OpenPAI's job documentation ("PAI Environment Variables") and
produced by openpai-runtime. Facts that shape this module:
- several task roles may train together; `--pai-roles` orders them, the first one's instance 0
  is the master;
- every task gets the port labels `ssh` and `http`, so the master port is the one *other* label
  reserved on the master instance; port values are comma lists ("29877,22353");
- role names may contain underscores, so variables are matched with a known role as prefix;
- PAI_HOST_IP_* are set only after the gang barrier.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from trainpod.environments.base import (
    DEFAULT_MASTER_PORT,
    MAX_NODES,
    ClusterEnvironment,
    Discovery,
    parse_int,
)
from trainpod.errors import ConfigError, error_for
from trainpod.settings import Integer, Invalid, Setting
from trainpod.text import has_control, printable

PLATFORM_PORT_LABELS = ("ssh", "http")
INDEX_VARS = ("PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX", "PAI_TASK_INDEX")


class PAIEnvironment(ClusterEnvironment):
    name = "pai"
    description = "OpenPAI runtime variables (PAI_CURRENT_TASK_ROLE_NAME, PAI_HOST_IP_*, PAI_PORT_LIST_*)"
    settings = (
        Setting("pai_roles", "ordered, comma-separated trainer task roles; the first one's instance 0 is the master "
                "(default: the current role)", var="TRAINPOD_PAI_ROLES", metavar="ROLE,..."),
        Setting("pai_port_label", "port label of the master port (default: the one label besides ssh/http)",
                var="TRAINPOD_PAI_PORT_LABEL", metavar="LABEL"),
    )

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return bool(env.get("PAI_CURRENT_TASK_ROLE_NAME", "").strip())

    @staticmethod
    def present(env: Mapping[str, str]) -> list[str]:
        return ["PAI_CURRENT_TASK_ROLE_NAME"] if PAIEnvironment.detect(env) else []

    def discover(self) -> Discovery:
        role = self.env.get("PAI_CURRENT_TASK_ROLE_NAME", "").strip()
        if not role:  # chosen with --source pai / TRAINPOD_SOURCE=pai, outside an OpenPAI task
            raise ConfigError(
                "PAI_CURRENT_TASK_ROLE_NAME is not set: the source 'pai' reads the variables OpenPAI sets in a "
                "task's container; run it in an OpenPAI task, or choose another --source"
            )
        _check_role(role, "PAI_CURRENT_TASK_ROLE_NAME", role)
        index, index_var = self._current_index()
        roles, roles_origin = self._trainer_roles(role)
        counts = {r: self._task_count(r) for r in roles}
        if index >= counts[role]:
            raise ConfigError(
                f"{index_var}={index}: expected an index below "
                f"PAI_TASK_ROLE_TASK_COUNT_{role}={counts[role]}"
            )
        node_rank = sum(counts[r] for r in roles[: roles.index(role)]) + index

        master_role = roles[0]
        ip_var = f"PAI_HOST_IP_{master_role}_0"
        master_addr = self.env.get(ip_var, "").strip() or None
        missing: dict[str, str] = {}
        if master_addr is None:
            missing["master_addr"] = (
                f"{ip_var} is not set: OpenPAI sets the host IPs only after the gang barrier; "
                "keep gang allocation on for this job (or pass --master-addr)"
            )

        # A bad or ambiguous port only matters when no --master-port replaces it.
        master_port, port_origin, warnings = None, "", ()
        try:
            master_port, port_origin, warnings = self._master_port(master_role)
        except ConfigError as error:
            missing["master_port"] = str(error)
        count_origin = "+".join(f"PAI_TASK_ROLE_TASK_COUNT_{r}" for r in roles)
        job_id, job_origin = _job_identity(self.env)
        return Discovery(
            job_id=job_id,
            nnodes=sum(counts.values()),
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            origins={
                "nnodes": count_origin,
                "node_rank": f"{index_var} (+ earlier roles in {roles_origin})" if node_rank != index else index_var,
                "master_addr": ip_var,
                "master_port": port_origin,
                **({"job_id": job_origin} if job_id else {}),
            },
            warnings=warnings,
            missing=missing,
        )

    def _current_index(self) -> tuple[int, str]:
        for var in INDEX_VARS:
            if self.env.get(var, "").strip():
                return parse_int(self.env[var], var), var
        raise ConfigError(f"neither {' nor '.join(INDEX_VARS)} is set: expected this task's index in its role")

    def _trainer_roles(self, current: str) -> tuple[list[str], str]:
        text, origin = self.setting("pai_roles")
        if text is None:
            return [current], "PAI_CURRENT_TASK_ROLE_NAME"
        roles = [r.strip() for r in text.split(",") if r.strip()]
        error = error_for(origin)
        if not roles:
            raise error(f"{origin}={text!r}: expected the trainer task roles, comma-separated (ROLE,...)")
        for listed in roles:
            _check_role(listed, origin, text)
        duplicates = sorted({r for r in roles if roles.count(r) > 1})
        if duplicates:
            raise error(f"{origin}={text!r}: role {duplicates[0]!r} is listed twice")
        if current not in roles:
            raise error(
                f"{origin}={text!r}: the current role PAI_CURRENT_TASK_ROLE_NAME={current!r} "
                "is not a trainer role; list it, or do not run trainpod in this role"
            )
        return roles, origin

    def _known_roles(self) -> set[str]:
        roles = {k[len("PAI_TASK_ROLE_TASK_COUNT_"):] for k in self.env if k.startswith("PAI_TASK_ROLE_TASK_COUNT_")}
        for var in ("PAI_TASK_ROLE_LIST", "PAI_JOB_TASK_ROLE_LIST"):
            roles.update(r.strip() for r in self.env.get(var, "").split(",") if r.strip())
        return roles

    def _task_count(self, role: str) -> int:
        var = f"PAI_TASK_ROLE_TASK_COUNT_{role}"
        if var not in self.env:
            known = printable(", ".join(sorted(self._known_roles()))) or "none found"
            raise ConfigError(f"{var} is not set: is {role!r} a task role of this job? (roles: {known})")
        return parse_int(self.env[var], var, minimum=1, maximum=MAX_NODES)

    def _port_variables(self, role: str) -> dict[str, str]:
        """Port label -> variable for instance 0 of `role`, both spellings, PAI_PORT_LIST_ first."""
        # A longer role such as "worker_0" must not lend its variables to the role "worker".
        longer = [r for r in self._known_roles() if r != role and r.startswith(role + "_")]
        patterns = [
            (re.compile(rf"PAI_PORT_LIST_{re.escape(role)}_0_(?P<label>.+)"), "PAI_PORT_LIST_{}_"),
            (re.compile(rf"PAI_{re.escape(role)}_0_(?P<label>.+)_PORT"), "PAI_{}_"),
        ]
        found: dict[str, str] = {}
        for pattern, prefix in patterns:
            for var in sorted(self.env):
                match = pattern.fullmatch(var)
                if not match or any(re.match(re.escape(prefix.format(r)) + r"\d+_", var) for r in longer):
                    continue
                found.setdefault(match["label"], var)
        return found

    def _master_port(self, role: str) -> tuple[int, str, tuple[str, ...]]:
        variables = self._port_variables(role)
        chosen, origin = self.setting("pai_port_label")
        listing = printable(", ".join(variables)) or "none"
        if chosen:
            if chosen not in variables:
                raise error_for(origin)(f"{origin}={chosen!r}: no such port label on {role} instance 0 (labels found: {listing})")
            label = chosen
        else:
            candidates = [label for label in variables if label not in PLATFORM_PORT_LABELS]
            if len(candidates) > 1:
                raise ConfigError(
                    f"several port labels are reserved on {role} instance 0 ({printable(', '.join(candidates))}): "
                    "choose the master's with --pai-port-label or TRAINPOD_PAI_PORT_LABEL"
                )
            if not candidates:
                warning = (
                    f"no port label is reserved on {role} instance 0 besides ssh/http: using "
                    f"{DEFAULT_MASTER_PORT}, which may collide with another job on the host; reserve one "
                    "in the job protocol (taskRoles.<role>.resourcePerInstance.ports)"
                )
                return DEFAULT_MASTER_PORT, "default", (warning,)
            label = candidates[0]
        var = variables[label]
        text = self.env[var]
        try:  # the first of the ports reserved under the label (a comma list: "29877,22353")
            return Integer(1, 65535)(text.split(",")[0]), var, ()
        except Invalid:
            raise ConfigError(f"{var}={text!r}: expected the ports OpenPAI reserved, comma-separated, the first the "
                              "master's (29877,22353)") from None


def _check_role(role: str, origin: str, value: str) -> None:
    """A task role's name is part of variable names (PAI_HOST_IP_<role>_0) and of messages: no blank or
    control character (OpenPAI's own names are letters, digits and '_')."""
    if has_control(role) or any(char.isspace() for char in role):
        raise error_for(origin)(f"{origin}={value!r}: expected task role names without blanks or control characters")


def _job_identity(env: Mapping[str, str]) -> tuple[str | None, str]:
    """The job and its attempt: the same on every task of one attempt, different on a retry (the
    rendezvous id is made from it: trainpod.rendezvous.ids). FrameworkController, which runs OpenPAI's
    jobs, numbers the attempts (FC_FRAMEWORK_ATTEMPT_ID)."""
    name = env.get("PAI_JOB_NAME", "").strip()
    if not name:
        return None, ""
    attempt = env.get("FC_FRAMEWORK_ATTEMPT_ID", "").strip()
    if attempt:
        return f"{name}-a{attempt}", "PAI_JOB_NAME + FC_FRAMEWORK_ATTEMPT_ID"
    return name, "PAI_JOB_NAME"
