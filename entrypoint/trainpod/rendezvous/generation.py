"""A job's rendezvous generation in etcd: each run of the same job meets in a rendezvous of its own.

torch closes a rendezvous when a run ends (any end but a signal: torch.distributed.launcher.api's
launch_agent calls the handler's shutdown()), and a closed one is closed for good: the same
command run again fails at once with RendezvousClosedError. So the nodes of a job meet in
`<id>.g<N>`, N read from one etcd key, `/trainpod/generation/<id>`, when a node starts (before
its agent), and an agent whose run closed the rendezvous advances it to N + 1 (a compare-and-set:
the first node to end moves it, the others find it moved). A node that starts while the job runs
(an elastic job's new or restarted node) reads the N of the running job and joins it; the next run
reads N + 1. Through etcd's v3 API (etcd_http), for torch's `etcd` backend too: an etcd that
serves v2 serves v3 as well.
"""

from __future__ import annotations

from trainpod.rendezvous.etcd_http import EtcdClient

KEY_PREFIX = "/trainpod/generation/"
BASE_VAR = "TRAINPOD_RDZV_BASE_ID"  # for the agent: the id without the generation ...
GENERATION_VAR = "TRAINPOD_RDZV_GENERATION"  # ... and the generation it runs in


def key(base: str) -> bytes:
    return f"{KEY_PREFIX}{base}".encode()


def run_id(base: str, generation: int) -> str:
    return f"{base}.g{generation}"


def current(client: EtcdClient, base: str) -> int:
    """The generation the job's nodes meet in now (0 before the first run ended)."""
    found = client.get(key(base))
    return int(found[0]) if found else 0


def advance(client: EtcdClient, base: str, generation: int) -> int:
    """The run in `generation` closed its rendezvous: the next run takes generation + 1. Returns the
    generation now current (already later, if another node advanced it first)."""
    while True:
        found = client.get(key(base))
        now = int(found[0]) if found else 0
        if now != generation:
            return now
        done, _ = client.cas(key(base), str(generation + 1).encode(), found[1] if found else 0)
        if done:
            return generation + 1
