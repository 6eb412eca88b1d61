"""Every node's value in a rendezvous round's store, read by every node: the exchange behind the checks whose verdict
each node reaches on its own from the same data (trainpod.agent.consistency, trainpod.agent.devcheck).

all_gather() returns only once every node has read. The store lives in one node's agent (torch's c10d rendezvous
hosts it there), and a verdict can end the job: had that node exited on what it read while another was still reading,
the other failed on a store gone (69, a fault a caller retries) instead of reaching the same verdict (78: seen in the
tests, one node 78, the other 69). A node that publishes without reading (publish(): a check it does not judge) marks
itself read at once.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta


def _read_mark(prefix: str, rank: int) -> str:
    return f"{prefix}read/{rank}"


def publish(store, prefix: str, rank: int, value: str) -> None:
    """This node's value for the nodes that read (this one does not)."""
    store.set(f"{prefix}{rank}", value)
    store.set(_read_mark(prefix, rank), "1")


def all_gather(store, prefix: str, rank: int, world: int, value: str, wait_s: float) -> dict[int, bytes]:
    """Publish `value` under prefix+rank, read every node's (waiting up to wait_s for them), then wait until every node
    has read. The last wait is the store host's reason to stay; a node gone after publishing (or an older trainpod that
    marks nothing) costs it wait_s at most, and what was read still stands."""
    store.set(f"{prefix}{rank}", value)
    keys = [f"{prefix}{other}" for other in range(world)]
    store.wait(keys, timedelta(seconds=wait_s))
    found = {other: store.get(key) for other, key in enumerate(keys)}
    store.set(_read_mark(prefix, rank), "1")
    # A timeout, or the store gone, has no common exception type across torch's stores; either way all was read.
    with contextlib.suppress(Exception):
        store.wait([_read_mark(prefix, other) for other in range(world)], timedelta(seconds=wait_s))
    return found
