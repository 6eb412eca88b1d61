"""`trainpod explain --left-out`: the nodes an elastic job's run keeps out, read from outside the job.

An agent that leaves an elastic job records it in the run's store, and a node started again on the same
host stays out (trainpod.rendezvous.exclusions). explain reads those records as a bystander: it writes
nothing, creates nothing, starts no store: c10d's store is the one the endpoint's agent hosts (a
client connects to it; no job running, no store), etcd's are the run's keys (under this run's
generation, trainpod.rendezvous.generation).
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import timedelta

from trainpod.rendezvous import exclusions
from trainpod.topology import Topology

FIXED_SIZE = "a fixed-size job ends instead of leaving a node out"


def read(topology: Topology, timeout: float) -> tuple[str, list[exclusions.Exclusion]]:
    """(the run's rendezvous id, its records). Raises what the backend raises when it cannot be read."""
    rdzv = topology.rdzv
    if rdzv.backend == "c10d":
        import torch.distributed as dist

        endpoint = rdzv.endpoint or f"{topology.master_addr}:{topology.master_port}"
        host, _, port = endpoint.rpartition(":")
        store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout))
        return rdzv.id, exclusions.read(store)
    from trainpod.rendezvous import generation
    from trainpod.rendezvous.etcd_http import EtcdClient

    client = EtcdClient(rdzv.endpoint, timeout, rdzv.access)
    run_id = generation.run_id(rdzv.id, generation.current(client, rdzv.id))
    if rdzv.backend == "etcd-v3":
        from trainpod.rendezvous import etcd_v3

        store = etcd_v3.EtcdV3Store(client, etcd_v3.store_prefix(run_id), etcd_v3.Lease(client, etcd_v3.DEFAULT_TTL),
                                    timedelta(seconds=timeout))
        return run_id, exclusions.read(store)
    # torch's etcd backend: its python-etcd client, as the agent's handler makes it (no key written)
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.etcd_rendezvous import _create_etcd_client
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    conf = {**rdzv.access.conf(), **({"protocol": "https"} if rdzv.endpoint.startswith("https://") else {})}
    params = RendezvousParameters("etcd", rdzv.endpoint.rpartition("://")[2].split(",")[0], run_id, 1, 1, **conf)
    prefix = rdzv.settings.get("etcd_prefix", "/torchelastic/p2p")
    prefix = prefix if prefix.endswith("/") else f"{prefix}/"
    store = EtcdStore(_create_etcd_client(params), f"{prefix}run_{run_id}{exclusions.ETCD_PATH}", timedelta(seconds=timeout))
    return run_id, exclusions.read(store)


def look(topology: Topology, timeout: float) -> tuple[str, list[exclusions.Exclusion], str]:
    """(run id, records, '') or ('', [], why they could not be read)."""
    try:
        run_id, found = read(topology, timeout)
    except Exception as error:  # noqa: BLE001 - the backends' errors have no common type
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        where = topology.rdzv.endpoint or f"{topology.master_addr}:{topology.master_port}"
        return "", [], f"not read from the {topology.rdzv.backend} rendezvous at {where}: {type(error).__name__}: {first[:200]}"
    return run_id, found, ""


def to_dict(topology: Topology, timeout: float) -> dict:
    """explain --json's "left_out"."""
    if not topology.rdzv.elastic:
        return {"nodes": [], "note": FIXED_SIZE}
    run_id, found, error = look(topology, timeout)
    if error:
        return {"error": error}
    this = exclusions.Node.this()
    return {"rendezvous": run_id, "nodes": [{**asdict(each), "this_node": each.names(this)} for each in found]}


def rows(topology: Topology, timeout: float) -> list[str]:
    """explain's lines: each node this run keeps out, or that none is, or why they could not be read."""
    if not topology.rdzv.elastic:
        return ["", f"left out: none ({FIXED_SIZE})"]
    run_id, found, error = look(topology, timeout)
    if error:
        return ["", f"left out: {error}"]
    if not found:
        return ["", f"left out of rendezvous {run_id}: none"]
    this = exclusions.Node.this()
    return ["", f"left out of rendezvous {run_id} (each stays out when started again on the same host, until a reboot):",
            *(f"  {each.describe()}" + ("  <- this node" if each.names(this) else "") for each in found)]
