"""Environment + flags -> Topology. Pure apart from reading local interfaces (and DNS, if asked).

Precedence, field by field: an explicit flag, then the cluster environment's variables, then a
default. Every value keeps the name of where it came from, for `explain` and for errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainpod import devices, environments, network, settings
from trainpod.environments.base import Discovery
from trainpod.errors import ConfigError, UsageError, error_for
from trainpod.topology import Topology


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


def resolve_topology(
    options: Mapping[str, Any], env: Mapping[str, str], *, resolve_names: bool = True, nproc_per_node: tuple[int, str] | None = None
) -> Topology:
    """The topology for this node. `resolve_names=False` keeps it free of DNS traffic; `nproc_per_node`
    is (count, who fixes it) where what runs needs that many processes per node (DataParallel: 1)."""
    given = settings.resolve((environments.SOURCE, *settings.TOPOLOGY), options, env)
    cls = environments.select(env, given.source)
    found = cls(env, options).discover()
    warnings = list(found.warnings)
    ignored = environments.ignored_sources(env, cls)
    if ignored:
        chosen = f"--source {cls.name}" if given.source else f"{cls.name} (the first source that detects)"
        warnings.append(f"several cluster sources are set: using {chosen}; ignoring {'; '.join(ignored)}")

    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for name in ("nnodes", "node_rank", "master_addr", "master_port"):
        if getattr(given, name) is not None:
            values[name], origins[name] = getattr(given, name), given.origins[name]
        elif name in found.missing:
            raise ConfigError(found.missing[name])
        else:
            values[name], origins[name] = getattr(found, name), found.origins.get(name, cls.name)

    nnodes, node_rank = values["nnodes"], values["node_rank"]
    if not 0 <= node_rank < nnodes:
        culprit = origins["node_rank"] if origins["node_rank"].startswith("--") else origins["nnodes"]
        raise error_for(culprit)(
            f"{origins['node_rank']}={node_rank}: expected a node rank from 0 to "
            f"{nnodes - 1} ({origins['nnodes']}={nnodes})"
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
        origins=origins,
        warnings=tuple(warnings),
    )
