"""Rendezvous ids: the same on every node of a job, never shared by two jobs or two runs of one.

torch keys a rendezvous by its id, and a run that ends closes it: the same id again (the same
command run twice, a job resubmitted) fails at once with RendezvousClosedError, and two jobs with
one id on one etcd join each other. So the id is made of

- the job's identity, the same on every node and different for every job: --rdzv-id /
  TRAINPOD_RDZV_ID / PET_RDZV_ID when given, else what the cluster says (OpenPAI's job name and
  attempt, SLURM's job, step and restart count), else a digest of the job itself (node range,
  processes, what runs, the rendezvous endpoint): two different jobs differ there;
- for etcd, a generation (generation.py) that the nodes read from etcd when they start and that a
  run advances when it closes its rendezvous: the next run of the same job meets in a fresh one.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
MAX_LENGTH = 100


def sanitize(text: str) -> str:
    """An id that is safe in an etcd key path and a URL: 'alice~job 1' -> 'alice-job-1'."""
    cleaned = _UNSAFE.sub("-", text.strip()).strip("-")
    if len(cleaned) > MAX_LENGTH:  # keep it readable, and still unique
        cleaned = cleaned[: MAX_LENGTH - 13] + "-" + hashlib.sha256(text.encode()).hexdigest()[:12]
    return cleaned or "job"


def digest_id(parts: Iterable[str]) -> str:
    """'job-1a2b3c4d5e6f': the same for the same job on every node, different for a different one."""
    return "job-" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]
