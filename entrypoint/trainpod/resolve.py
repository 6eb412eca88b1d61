"""Environment + flags -> Topology. Pure apart from reading local interfaces (and DNS, if asked).

Precedence, field by field: an explicit flag, then the cluster environment's variables, then a
default. Every value keeps the name of where it came from, for `explain` and for errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from trainpod import devices, environments, network
from trainpod.environments.base import parse_int
from trainpod.errors import ConfigError, UsageError
from trainpod.topology import Topology

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class Options:
    """The command-line flags that shape the topology; None means "not given"."""

    source: str | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    nproc_per_node: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    backend: str | None = None
    interface: str | None = None
    pai_roles: str | None = None
    pai_port_label: str | None = None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _error_for(*origins: str) -> type[UsageError] | type[ConfigError]:
    # A flag among the culprits makes it a usage error: the command line is what to fix.
    return UsageError if any(o.startswith("--") for o in origins) else ConfigError


def _nproc_per_node(options: Options, env: Mapping[str, str], gpus: int) -> tuple[int, str]:
    if options.nproc_per_node is not None:
        return options.nproc_per_node, "--nproc-per-node"
    for var in ("TRAINPOD_NPROC_PER_NODE", "PET_NPROC_PER_NODE"):
        text = env.get(var, "").strip()
        if text and text not in ("auto", "gpu"):
            return parse_int(text, var, minimum=1), var
        if text:
            break
    if gpus:
        return gpus, "visible GPUs"
    return 1, "default (no GPU visible)"


def _backend(options: Options, env: Mapping[str, str], gpus: int) -> tuple[str, str]:
    value, origin = options.backend, "--backend"
    if value is None and env.get("TRAINPOD_BACKEND", "").strip():
        value, origin = env["TRAINPOD_BACKEND"].strip(), "TRAINPOD_BACKEND"
    if value is None:
        return ("nccl", "default (GPUs visible)") if gpus else ("gloo", "default (no GPU visible)")
    if value not in BACKENDS:
        raise _error_for(origin)(f"{origin}={value!r}: expected one of {', '.join(BACKENDS)}")
    if value == "nccl" and not gpus:
        raise _error_for(origin)(f"{origin}=nccl: NCCL needs GPUs and none is visible; use gloo on CPU")
    return value, origin


def _interface(options: Options, env: Mapping[str, str], master_addr: str, resolve_names: bool) -> tuple[str | None, str, str]:
    """(interface, why, origin)."""
    if options.interface:
        if options.interface not in network.interfaces():
            have = ", ".join(sorted(network.interfaces()))
            raise UsageError(f"--interface={options.interface!r}: no such interface here (have: {have})")
        return options.interface, "given", "--interface"
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if env.get(var, "").strip():
            return env[var].strip(), "set in the environment", var
    if network.is_ip_literal(master_addr):
        master_ip = master_addr
    else:
        master_ip = network.resolve_from_hosts_file(master_addr)
        if master_ip is None and resolve_names:
            try:
                master_ip = network.resolve(master_addr)
            except OSError:
                return None, f"the master name {master_addr!r} does not resolve yet", "auto"
        if master_ip is None:
            return None, f"decided at run time (the master {master_addr!r} is a DNS name)", "auto"
    name, why = network.interface_for(master_ip)
    return name, why, "auto"


def resolve_topology(options: Options, env: Mapping[str, str], *, resolve_names: bool = True) -> Topology:
    """The topology for this node. `resolve_names=False` keeps it free of DNS traffic."""
    forced = options.source or env.get("TRAINPOD_SOURCE", "").strip() or None
    cls = environments.select(env, forced)
    found = cls(env, {"pai_roles": options.pai_roles, "pai_port_label": options.pai_port_label}).discover()

    values: dict[str, object] = {}
    origins: dict[str, str] = {}
    for name in ("nnodes", "node_rank", "master_addr", "master_port"):
        given = getattr(options, name)
        if given is not None:
            values[name], origins[name] = given, _flag(name)
        elif name in found.missing:
            raise ConfigError(found.missing[name])
        else:
            values[name], origins[name] = getattr(found, name), found.origins.get(name, cls.name)

    nnodes, node_rank = int(values["nnodes"]), int(values["node_rank"])
    if nnodes < 1:
        raise _error_for(origins["nnodes"])(f"{origins['nnodes']}={nnodes}: expected at least 1 node")
    if not 0 <= node_rank < nnodes:
        raise _error_for(origins["node_rank"], origins["nnodes"])(
            f"{origins['node_rank']}={node_rank}: expected a node rank from 0 to "
            f"{nnodes - 1} ({origins['nnodes']}={nnodes})"
        )
    master_port = int(values["master_port"])
    if not 1 <= master_port <= 65535:
        raise _error_for(origins["master_port"])(f"{origins['master_port']}={master_port}: expected a port from 1 to 65535")

    gpus = devices.visible_gpu_count(env)
    nproc, origins["nproc_per_node"] = _nproc_per_node(options, env, gpus)
    if nproc < 1:
        raise UsageError(f"--nproc-per-node={nproc}: expected at least 1")
    backend, origins["backend"] = _backend(options, env, gpus)
    master_addr = str(values["master_addr"])
    interface, reason, origins["interface"] = _interface(options, env, master_addr, resolve_names)

    return Topology(
        source=cls.name,
        nnodes=nnodes,
        node_rank=node_rank,
        nproc_per_node=nproc,
        master_addr=master_addr,
        master_port=master_port,
        backend=backend,
        interface=interface,
        interface_reason=reason,
        origins=origins,
        warnings=tuple(found.warnings),
    )
