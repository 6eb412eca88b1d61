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

A node that waits in the rendezvous of a run that ends meanwhile (it came as the others finished: the
agent no longer lets a node into a finishing group, trainpod.agent.policy) finds it closed. The run it
came for is over, so it ends too, where a retry would start the job's next run and train a second
copy of the job alone: `ended_after` tells that case (N moved since this node read it, or moves within
a few seconds: the closing node moves it as its agent ends) from a rendezvous closed before this node
came, whose move was lost (etcd unreachable just then): the node starts it again, in N + 1.
"""

from __future__ import annotations

import time

from trainpod.rendezvous.etcd_http import EtcdClient

KEY_PREFIX = "/trainpod/generation/"


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


# How long a node that found its rendezvous closed waits for the closing node to move the generation on.
ADVANCE_WAIT_S = 5.0


def ended_after(client: EtcdClient, base: str, generation: int, wait_s: float = ADVANCE_WAIT_S) -> int | None:
    """The rendezvous of `generation` is closed: the generation that replaced it if the run ended after this
    node read `generation` (it moved on, now or within `wait_s`), else None (closed before, its move lost)."""
    deadline = time.monotonic() + wait_s
    while True:
        now = current(client, base)
        if now > generation:
            return now
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)
