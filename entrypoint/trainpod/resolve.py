"""Environment + flags -> Topology. Pure apart from reading local interfaces (and DNS, if asked).

Precedence, field by field: an explicit flag, then the cluster environment's variables, then a
default. Every value keeps the name of where it came from, for `explain` and for errors.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from trainpod import devices, environments, network, settings
from trainpod.environments.base import Discovery
from trainpod.environments.etcd import ETCD_BACKENDS, EtcdEnvironment, split_endpoint
from trainpod.environments.single import SingleNodeEnvironment
from trainpod.errors import ConfigError, TrainpodError, UsageError, error_for
from trainpod.rendezvous import ids
from trainpod.rendezvous.etcd_http import parse_endpoints
from trainpod.topology import C10D_ID, Rendezvous, Topology, join_host_port


class Options(dict):
    """The command line's flags by setting name: a flag's text or an already parsed value.

    Absent or None means "not given": the setting then comes from its variable, the cluster
    environment, or its default.
    """

    def __init__(self, **flags):
        super().__init__({name: value for name, value in flags.items() if value is not None})


def _nproc_per_node(given: settings.Values, found: Discovery, gpus: int, fixed: tuple[int, str] | None) -> tuple[int, str]:
    nproc, origin = given.nproc_per_node, given.origins["nproc_per_node"]
    if fixed is not None:
        if origin.startswith("--") and nproc != fixed[0]:
            raise UsageError(f"{origin}={nproc}: {fixed[1]} runs {fixed[0]} process(es) per node; leave the flag out")
        return fixed
    if nproc is None and found.nproc_per_node is not None:
        nproc, origin = found.nproc_per_node, found.origins["nproc_per_node"]
    if isinstance(nproc, int):
        return nproc, origin
    if gpus:
        return gpus, "visible GPUs"
    return 1, "default (no GPU visible)"


def _backend(given: settings.Values, gpus: int) -> tuple[str, str]:
    value, origin = given.backend, given.origins["backend"]
    if value is None:
        return ("nccl", "default (GPUs visible)") if gpus else ("gloo", "default (no GPU visible)")
    if value == "nccl" and not gpus:
        raise error_for(origin)(f"{origin}=nccl: NCCL needs GPUs and none is visible; use gloo on CPU")
    return value, origin


IFNAME_VARS = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


def _interface(flag: str | None, env: Mapping[str, str], master_addr: str, resolve_names: bool,
               backend: str) -> tuple[str | None, str, str, list[str]]:
    """(interface, why, origin, warnings). The backend's own variable counts, checked in its syntax;
    the other backend's is neither used nor copied (NCCL's prefixes are no gloo interface names)."""
    if flag:
        network.check_ifname(flag, "--interface", "gloo")  # one exact name: valid for both
        return flag, "given", "--interface", []
    var = IFNAME_VARS[backend]
    other = next(v for v in IFNAME_VARS.values() if v != var)
    if env.get(var, "").strip():
        network.check_ifname(env[var], var, backend)
        return env[var].strip(), "set in the environment", var, []
    warnings = []
    if env.get(other, "").strip():
        warnings.append(f"{other}={env[other].strip()!r} is ignored: the backend is {backend}, which reads {var}; "
                        f"trainpod picks {var} itself and leaves {other} as it is")
    if network.is_ip_literal(master_addr):
        master_ip = master_addr
    else:
        master_ip = network.resolve_from_hosts_file(master_addr)
        if master_ip is None and resolve_names:
            try:
                master_ip = network.resolve(master_addr)
            except OSError:
                return None, f"the master name {master_addr!r} does not resolve yet", "auto", warnings
        if master_ip is None:
            return None, f"decided at run time (the master {master_addr!r} is a DNS name)", "auto", warnings
    name, why = network.interface_for(master_ip)
    return name, why, "auto", warnings


def _rendezvous(given: settings.Values, found: Discovery, cls, values: dict, origins: dict) -> tuple[Rendezvous, list[str]]:
    """The rendezvous (backend, endpoint, id, node range) from flags over the cluster's variables; fills
    the master (c10d: the store's host; etcd: the route to etcd) in `values` where it comes from the endpoint."""
    warnings: list[str] = []
    backend, b_origin = given.rdzv_backend, given.origins["rdzv_backend"]
    if backend is None and found.rdzv_backend:
        backend, b_origin = found.rdzv_backend, found.origins.get("rdzv_backend", cls.name)
    backend = backend or "c10d"
    origins["rdzv_backend"] = b_origin
    endpoint, e_origin = given.rdzv_endpoint, given.origins["rdzv_endpoint"]
    if endpoint is None and found.rdzv_endpoint:
        endpoint, e_origin = found.rdzv_endpoint, found.origins.get("rdzv_endpoint", cls.name)
    if backend in ETCD_BACKENDS:
        if not endpoint:
            raise error_for(b_origin)(f"{b_origin}={backend}: the {backend} rendezvous needs etcd's address: pass "
                                      "--rdzv-endpoint HOST:PORT[,HOST:PORT...] (or set TRAINPOD_RDZV_ENDPOINT)")
        try:
            endpoint = ",".join(parse_endpoints(endpoint))
        except ValueError as bad:
            raise error_for(e_origin)(f"{e_origin}={endpoint!r}: {bad}") from None
        if backend == "etcd" and "," in endpoint:
            # torch's etcd handler raises a ValueError (a traceback, then "the same failure twice") on a list.
            raise error_for(e_origin)(f"{e_origin}={endpoint!r}: torch's etcd rendezvous takes one endpoint; give one "
                                      "etcd member, or use --rdzv-backend etcd-v3, which takes them all")
        # A master nobody gave (a source's single-node default, 127.0.0.1) would pin the node's address
        # to loopback: with etcd, the route to etcd picks the interface instead.
        if values.get("master_addr") is None or origins.get("master_addr", "").startswith("default"):
            host, port = split_endpoint(endpoint, e_origin)
            route = f"{e_origin} (etcd: the route to it picks the interface)"
            port_given = values.get("master_port") and not origins.get("master_port", "default").startswith("default")
            values["master_addr"], values["master_port"] = host, values["master_port"] if port_given else port
            origins["master_addr"] = route
            if not port_given:
                origins["master_port"] = route
    elif endpoint:
        host, port = _host_port(endpoint, e_origin)
        values["master_addr"], values["master_port"] = host, port  # c10d: the store's host is the master
        origins["master_addr"] = origins["master_port"] = e_origin
        endpoint = join_host_port(host, port)
    origins["rdzv_endpoint"] = e_origin if endpoint else "the master's address and port"

    rdzv_id, i_origin = given.rdzv_id, given.origins["rdzv_id"]
    if rdzv_id is None and found.rdzv_id:
        rdzv_id, i_origin = found.rdzv_id, found.origins.get("rdzv_id", cls.name)
    if rdzv_id is None and found.job_id:
        rdzv_id, i_origin = found.job_id, found.origins.get("job_id", cls.name)
    if rdzv_id is not None:
        rdzv_id = ids.sanitize(rdzv_id)
    else:  # c10d's store is the job's own; etcd's id is made from the job in cli (ids.digest_id)
        rdzv_id, i_origin = (C10D_ID, "default (the store is the job's own)") if backend == "c10d" else ("", "default")
    origins["rdzv_id"] = i_origin
    conf = dict(given.rdzv_conf or {})
    origins["rdzv_conf"] = given.origins["rdzv_conf"]
    return Rendezvous(backend=backend, endpoint=endpoint or "", id=rdzv_id, id_origin=i_origin, settings=conf), warnings


# How fast an elastic job notices a lost node and goes on without it. torch's defaults (a heartbeat every
# 5 s, a node dead after 3 missed, then a 30 s "last call" for more nodes once MIN are there) put 40 s and
# more between a lost node and the next round; these take it to about 6 s, for one small etcd write per
# node a second (c10d: a store request). A node that starts more than 3 s after the others joins the
# next round instead, which restarts the workers once (a membership change, not a failure).
ELASTIC_CONF = {"keep_alive_interval": "1", "keep_alive_max_attempt": "3", "last_call_timeout": "3"}
# torch's etcd backend: its nodes' keep-alive keys have a fixed TTL (10 s, renewed every 5 s); keep_alive_ttl
# is trainpod's own key, which the agent applies (trainpod.agent): a lost node is seen after at most 4 s,
# for one etcd write per node every 2 s.
ETCD_V2_CONF = {"last_call_timeout": "3", "keep_alive_ttl": "4"}


def _rdzv_defaults(rendezvous: Rendezvous) -> dict[str, str]:
    if not rendezvous.elastic:
        return {}
    return dict(ETCD_V2_CONF if rendezvous.backend == "etcd" else ELASTIC_CONF)


def _host_port(endpoint: str, origin: str) -> tuple[str, int]:
    """c10d's endpoint: one HOST:PORT (torchrun's default port 29400 when left out)."""
    try:
        split = urllib.parse.urlsplit("//" + endpoint.strip())
        host, port = split.hostname, split.port or 29400
        if not host or split.path or "," in endpoint:
            raise ValueError(endpoint)
        return settings.MASTER_ADDR.parse(host, origin), port
    except (ValueError, TrainpodError):
        raise error_for(origin)(f"{origin}={endpoint!r}: expected the c10d store's HOST:PORT") from None


def resolve_topology(
    options: Mapping[str, Any], env: Mapping[str, str], *, resolve_names: bool = True, nproc_per_node: tuple[int, str] | None = None
) -> Topology:
    """The topology for this node. `resolve_names=False` keeps it free of DNS traffic; `nproc_per_node`
    is (count, who fixes it) where what runs needs that many processes per node (DataParallel: 1)."""
    given = settings.resolve((environments.SOURCE, *settings.TOPOLOGY), options, env)
    cls = environments.select(env, given.source)
    if not given.source and cls is SingleNodeEnvironment and given.rdzv_backend in ETCD_BACKENDS:
        cls = EtcdEnvironment  # --rdzv-backend etcd*: no cluster source detects from a flag, and no other applies
    found = cls(env, options).discover()
    warnings = list(found.warnings)
    ignored = environments.ignored_sources(env, cls)
    if ignored:
        chosen = f"--source {cls.name}" if given.source else f"{cls.name} (the first source that detects)"
        warnings.append(f"several cluster sources are set: using {chosen}; ignoring {'; '.join(ignored)}")

    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    # The node count: a flag's N or MIN:MAX, else what the cluster says (PET_NNODES=1:4: an elastic range).
    if given.nnodes is not None:
        (min_nodes, nnodes), origins["nnodes"] = given.nnodes, given.origins["nnodes"]
    elif "nnodes" in found.missing:
        raise ConfigError(found.missing["nnodes"])
    else:
        nnodes, origins["nnodes"] = found.nnodes, found.origins.get("nnodes", cls.name)
        min_nodes = found.min_nodes or nnodes
    for name in ("master_addr", "master_port"):
        if getattr(given, name) is not None:
            values[name], origins[name] = getattr(given, name), given.origins[name]
        elif name not in found.missing and getattr(found, name) is not None:
            values[name], origins[name] = getattr(found, name), found.origins.get(name, cls.name)
    rendezvous, rdzv_warnings = _rendezvous(given, found, cls, values, origins)
    warnings += rdzv_warnings
    rendezvous = replace(rendezvous, min_nodes=min_nodes, max_nodes=nnodes)
    rendezvous = replace(rendezvous, settings={**_rdzv_defaults(rendezvous), **rendezvous.settings})
    for name in ("master_addr", "master_port"):
        if values.get(name) is None:
            raise ConfigError(found.missing.get(name, f"no {name} found"))

    # The node rank: etcd's rendezvous assigns it; c10d needs it where node 0 hosts the store (a fixed-size
    # job without an endpoint of its own), else it only tells torch which node hosts the store.
    node_rank: int | None = None
    if rendezvous.uses_etcd:
        if given.node_rank is not None:
            warnings.append(f"{given.origins['node_rank']} is ignored: the {rendezvous.backend} rendezvous numbers the nodes")
        origins["node_rank"] = f"the {rendezvous.backend} rendezvous (assigned when the nodes meet)"
    elif given.node_rank is not None:
        node_rank, origins["node_rank"] = given.node_rank, given.origins["node_rank"]
    elif found.node_rank is not None and not (cls.name == "single" and (rendezvous.elastic or rendezvous.endpoint)):
        # (The single source's node 0 is a one-node job's. With nothing set, a multi-node c10d job's nodes
        # would all be node 0; its rendezvous numbers them instead.)
        node_rank, origins["node_rank"] = found.node_rank, found.origins.get("node_rank", cls.name)
    elif rendezvous.elastic or rendezvous.endpoint:
        origins["node_rank"] = "the c10d rendezvous (torch picks the store's host by its address)"
    else:
        raise ConfigError(found.missing.get("node_rank", f"{cls.name}: no node rank found"))
    if node_rank is not None and not 0 <= node_rank < nnodes:
        culprit = origins["node_rank"] if origins["node_rank"].startswith("--") else origins["nnodes"]
        raise error_for(culprit)(
            f"{origins['node_rank']}={node_rank}: expected a node rank from 0 to "
            f"{nnodes - 1} ({origins['nnodes']}={settings.format_range((min_nodes, nnodes))})"
        )
    # The environment's address is checked as strictly as the flag's: '10.0.0.1:29500' or two
    # words would otherwise look like an unreachable master, which is retried.
    master_addr = settings.MASTER_ADDR.parse(values["master_addr"], origins["master_addr"])

    gpus = devices.visible_gpu_count(env)
    nproc, origins["nproc_per_node"] = _nproc_per_node(given, found, gpus, nproc_per_node)
    backend, origins["backend"] = _backend(given, gpus)
    interface, reason, origins["interface"], interface_warnings = _interface(given.interface, env, master_addr, resolve_names,
                                                                             backend)
    warnings += interface_warnings
    if found.max_restarts is not None:
        origins["max_restarts"] = found.origins.get("max_restarts", cls.name)

    return Topology(
        source=cls.name,
        nnodes=nnodes,
        node_rank=node_rank,
        nproc_per_node=nproc,
        master_addr=master_addr,
        master_port=values["master_port"],
        backend=backend,
        interface=interface,
        interface_reason=reason,
        rendezvous=rendezvous,
        max_restarts=found.max_restarts,
        origins=origins,
        warnings=tuple(warnings),
    )
