"""Environment + flags -> Topology. Pure apart from reading local interfaces (and DNS, if asked).

Precedence, field by field: an explicit flag, then the cluster environment's variables, then a
default. Every value keeps the name of where it came from, for `explain` and for errors.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from trainpod import environments, settings
from trainpod.environments import torchrun
from trainpod.environments.base import Discovery
from trainpod.environments.etcd import ETCD_BACKENDS, EtcdEnvironment
from trainpod.environments.single import SingleNodeEnvironment
from trainpod.errors import ConfigError, TrainpodError, UsageError, error_for
from trainpod.launcher import devices, network
from trainpod.rendezvous import conf as rdzv_conf
from trainpod.rendezvous import ids
from trainpod.rendezvous.etcd_http import PASSWORD_VAR, EtcdAccess, named, parse_endpoints, split_scheme
from trainpod.topology import C10D_ID, Rendezvous, Topology, join_host_port


class Options(dict):
    """The command line's flags by setting name: a flag's text or an already parsed value.

    Absent or None means "not given": the setting then comes from its variable, the cluster
    environment, or its default.
    """

    def __init__(self, **flags):
        super().__init__({name: value for name, value in flags.items() if value is not None})


def _nproc_per_node(given: settings.Values, found: Discovery, gpus: int, fixed: tuple[int, str] | None,
                    env: Mapping[str, str]) -> tuple[int, str]:
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
        return gpus, f"visible GPUs ({devices.visible_gpus_origin(env)})"
    return 1, "default (no GPU visible)"


def _backend(given: settings.Values, gpus: int, env: Mapping[str, str]) -> tuple[str, str]:
    value, origin = given.backend, given.origins["backend"]
    if value is None:
        return ("nccl", f"default (GPUs visible: {devices.visible_gpus_origin(env)})") if gpus else ("gloo", "default (no GPU visible)")
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


@dataclass(frozen=True)
class _Master:
    """A master address and port, each with the origin `explain` shows."""

    addr: str | None
    port: int | None
    addr_origin: str = ""
    port_origin: str = ""


def _rendezvous(given: settings.Values, found: Discovery, cls, master: _Master,
                env: Mapping[str, str]) -> tuple[Rendezvous, _Master, dict[str, str], list[str]]:
    """The rendezvous (backend, endpoint, id) from flags over the cluster's variables, the master it implies
    (c10d: the store's host; etcd: the route to etcd's first member, unless one was given; else `master` as
    it is), the origins of the rendezvous' values, and warnings. Reads its arguments, writes none of them."""
    warnings: list[str] = []
    origins: dict[str, str] = {}
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
        except ValueError as bad:  # (never showing a password the text may hold)
            raise error_for(e_origin)(f"{named(e_origin, endpoint)}: {bad}") from None
        if backend == "etcd" and "," in endpoint:
            # torch's etcd handler raises a ValueError (a traceback, then "the same failure twice") on a list.
            raise error_for(e_origin)(f"{e_origin}={endpoint!r}: torch's etcd rendezvous takes one endpoint; give one "
                                      "etcd member, or use --rdzv-backend etcd-v3, which takes them all")
        # Nodes that meet in etcd have no master; the route to etcd's first member picks the interface. A master
        # nobody gave (a source's single-node default, 127.0.0.1) would pin the node's address to loopback.
        if master.addr is None or master.addr_origin.startswith("default"):
            host, port = _first_etcd_member(endpoint, e_origin)
            route = f"{e_origin} (etcd: the route to it picks the interface)"
            port_given = master.port is not None and not master.port_origin.startswith("default")
            master = _Master(host, master.port if port_given else port, route, master.port_origin if port_given else route)
    elif endpoint:
        host, port = _host_port(endpoint, e_origin)
        for flag, was, now in (("--master-addr", master.addr, host), ("--master-port", master.port, port)):
            if given.origins.get(flag[2:].replace("-", "_")) == flag and e_origin.startswith("--") and str(was) != str(now):
                raise UsageError(f"{flag}={was} and {e_origin}={endpoint}: c10d's store is the master, at the endpoint: "
                                 f"give one of them")
        master = _Master(host, port, e_origin, e_origin)  # c10d: the store's host is the master
        endpoint = join_host_port(host, port)
    origins["rdzv_endpoint"] = e_origin if endpoint else "the master's address and port"

    rdzv_id, i_origin = given.rdzv_id, given.origins["rdzv_id"]
    if rdzv_id is None and found.rdzv_id:
        rdzv_id, i_origin = found.rdzv_id, found.origins.get("rdzv_id", cls.name)
    if rdzv_id is None and found.job_id:
        rdzv_id, i_origin = found.job_id, found.origins.get("job_id", cls.name)
    if rdzv_id is not None:
        # Kept exactly: escaped one-to-one for etcd's keys (team/a -> team@2Fa), so that two jobs meet only
        # when their identities are equal; a control character is refused (the flag's was, by its kind).
        try:
            escaped = ids.escape(rdzv_id)
        except ValueError as bad:
            raise error_for(i_origin)(f"{i_origin}={rdzv_id!r}: expected {bad}") from None
        if escaped != rdzv_id:
            i_origin = f"{i_origin} ({rdzv_id!r}, escaped for etcd's keys)"
        rdzv_id = escaped
    else:  # c10d's store is the job's own; etcd's id is made from the job in cli (ids.digest_id)
        rdzv_id, i_origin = (C10D_ID, "default (the store is the job's own)") if backend == "c10d" else ("", "default")
    origins["rdzv_id"] = i_origin
    # Every key and value the backend reads, checked now: torch would ignore a typo, and fail inside the agent
    # on a bad value (a traceback, a restart).
    conf = rdzv_conf.check(backend, dict(given.rdzv_conf or {}), given.origins["rdzv_conf"])
    origins["rdzv_conf"] = given.origins["rdzv_conf"]
    access = _etcd_access(given, env, backend, endpoint or "", e_origin, warnings)
    rendezvous = Rendezvous(backend=backend, endpoint=endpoint or "", id=rdzv_id, id_origin=i_origin, settings=conf,
                            access=access)
    return rendezvous, master, origins, warnings


def _first_etcd_member(endpoint: str, origin: str) -> tuple[str, int]:
    """(host, port) of the first of etcd's endpoints (checked already: parse_endpoints), its host a host name
    or an address (the route to it picks the interface)."""
    host, _, port = split_scheme(parse_endpoints(endpoint)[0])[1].rpartition(":")
    try:
        settings.MASTER_ADDR.parse(host.strip("[]"), origin)
    except TrainpodError:
        raise error_for(origin)(f"{origin}={endpoint!r}: the host {host!r}: expected a host name (ASCII letters, digits, "
                                "'-' and '.') or an IP address") from None
    return host.strip("[]"), int(port)


def _etcd_access(given: settings.Values, env: Mapping[str, str], backend: str, endpoint: str, e_origin: str,
                 warnings: list[str]) -> EtcdAccess:
    """etcd's TLS files and user (--etcd-*, TRAINPOD_ETCD_*), checked as far as can be without etcd: the
    files exist and load, a certificate comes with its key, TLS goes with https:// endpoints, a user with
    exactly one password source, which is read (never shown). The password itself stays where it is."""
    names = [s.name for s in settings.ETCD_ACCESS]
    set_here = [n for n in names if getattr(given, n)]
    password_var = PASSWORD_VAR if settings.ETCD_PASSWORD.from_env(env)[0] is not None else ""  # (a Secret: never parsed)
    if backend not in ETCD_BACKENDS:
        flags = [given.origins[n] for n in set_here if given.origins[n].startswith("--")]
        if flags:
            raise UsageError(f"{flags[0]}: only for an etcd rendezvous (--rdzv-backend etcd or etcd-v3), not {backend}")
        if set_here or password_var:
            warnings.append(f"{', '.join([given.origins[n] for n in set_here] + ([password_var] if password_var else []))} "
                            f"ignored: the {backend} rendezvous does not use etcd")
        return EtcdAccess()
    origin = {n: given.origins[n] for n in names}
    for name in ("etcd_cacert", "etcd_cert", "etcd_key", "etcd_password_file"):
        path = getattr(given, name)
        if path and not os.path.isfile(path):
            there = ("it is a directory" if os.path.isdir(path) else "it is no regular file" if os.path.exists(path)
                     else "there is none")
            raise error_for(origin[name])(f"{origin[name]}={path!r}: expected a file, and {there}")
        if path and not os.access(path, os.R_OK):
            raise error_for(origin[name])(f"{origin[name]}={path!r}: not readable by uid {os.getuid()}")
        if path and "," in path:  # the TLS files travel in torchrun's --rdzv-conf, a comma-separated list
            raise error_for(origin[name])(f"{origin[name]}={path!r}: expected a path without a comma")
    if bool(given.etcd_cert) != bool(given.etcd_key):
        have, lack = ("etcd_cert", "etcd_key") if given.etcd_cert else ("etcd_key", "etcd_cert")
        raise error_for(origin[have])(f"{origin[have]}: a client certificate needs its key and the key its certificate: "
                                      f"give --{lack.replace('_', '-')} too")
    tls = [n for n in ("etcd_cacert", "etcd_cert", "etcd_key") if getattr(given, n)]
    https = split_scheme(endpoint.split(",")[0])[0] == "https"
    if tls and not https:
        raise error_for(origin[tls[0]])(f"{origin[tls[0]]}: TLS needs https:// endpoints, and {named(e_origin, endpoint)} "
                                        f"is plain http: give --rdzv-endpoint https://{endpoint.split(',')[0]}")
    user, user_origin = given.etcd_user, origin["etcd_user"]
    if user and (":" in user or any(ord(c) < 32 or ord(c) == 127 for c in user)):
        raise error_for(user_origin)(f"{user_origin}={user!r}: expected an etcd user name, without ':' or control "
                                     "characters (the password goes in --etcd-password-file or TRAINPOD_ETCD_PASSWORD)")
    password_file = given.etcd_password_file or ""
    if password_file and password_var and not origin["etcd_password_file"].startswith("--"):
        raise ConfigError(f"both {origin['etcd_password_file']} and {PASSWORD_VAR} are set: keep one of them")
    if (password_file or password_var) and not user:
        source = origin["etcd_password_file"] if password_file else PASSWORD_VAR
        raise error_for(source)(f"{source}: an etcd password, and no user to go with it: give --etcd-user (TRAINPOD_ETCD_USER)")
    if user and not (password_file or password_var):
        raise error_for(user_origin)(f"{user_origin}={user!r}: its password is missing: give --etcd-password-file PATH, "
                                     f"or set TRAINPOD_ETCD_PASSWORD_FILE or {PASSWORD_VAR} (never a flag: it would show in ps)")
    access = EtcdAccess(cacert=given.etcd_cacert or "", cert=given.etcd_cert or "", key=given.etcd_key or "", user=user or "",
                        password_file=password_file, password_var="" if password_file else password_var)
    if user:
        access.password(env)  # empty, not UTF-8, control characters: 78 now (never showing it)
    if https:
        access.ssl_context()  # a file that is no PEM certificate, or a key that does not match: 78 now
    return access


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


def _given_master(given: settings.Values, found: Discovery, cls) -> _Master:
    """The master as given: a flag or its variable, else the cluster's (None where neither says)."""

    def value(name: str) -> tuple[Any, str]:
        if getattr(given, name) is not None:
            return getattr(given, name), given.origins[name]
        if name not in found.missing and getattr(found, name) is not None:
            return getattr(found, name), found.origins.get(name, cls.name)
        return None, ""

    (addr, addr_origin), (port, port_origin) = value("master_addr"), value("master_port")
    return _Master(addr, port, addr_origin, port_origin)


def _spares(given: settings.Values, rendezvous: Rendezvous, min_nodes: int, nnodes: int) -> int:
    """--spares: nodes beyond --nnodes' maximum wait as spares in torch's dynamic rendezvous (its redundancy list); a
    fixed-size job has no room to fill, and torch's etcd backend restarts the job for every node beyond the maximum."""
    spares = given.spares or 0
    if not spares:
        return 0
    origin = given.origins["spares"]
    if min_nodes == nnodes:
        raise error_for(origin)(f"{origin}={spares}: spares are for an elastic job (--nnodes MIN:MAX), whose nodes may "
                                f"leave; this job has a fixed size of {nnodes} node(s)")
    if rendezvous.backend == "etcd":
        raise error_for(origin)(f"{origin}={spares}: torch's etcd rendezvous has no spares (every node beyond the "
                                "maximum restarts the job): use --rdzv-backend etcd-v3 or c10d")
    return spares


def _rdzv_defaults(rendezvous: Rendezvous) -> dict[str, str]:
    if not rendezvous.elastic:
        return {}
    return dict(ETCD_V2_CONF if rendezvous.backend == "etcd" else ELASTIC_CONF)


def _host_port(endpoint: str, origin: str) -> tuple[str, int]:
    """c10d's endpoint: one HOST:PORT (torchrun's default port 29400 when left out)."""
    if "@" in endpoint or "://" in endpoint:  # (never showing a password the text may hold)
        raise error_for(origin)(f"{named(origin, endpoint)}: expected the c10d store's HOST:PORT, without a scheme, user "
                                "name or password (the store has neither TLS nor authentication: use etcd-v3 for that)")
    try:
        split = urllib.parse.urlsplit("//" + endpoint.strip())
        host, port = split.hostname, split.port or 29400
        if not host or split.path or "," in endpoint:
            raise ValueError(endpoint)
        return settings.MASTER_ADDR.parse(host, origin), port
    except (ValueError, TrainpodError):
        raise error_for(origin)(f"{named(origin, endpoint)}: expected the c10d store's HOST:PORT") from None


def _check_nodes_can_meet(rendezvous: Rendezvous, nnodes: int, origins: Mapping[str, str]) -> None:
    """Nodes of a fixed-size job meet at the master's address, each by its rank, which no variable gave here:
    a node left with the single-node defaults (127.0.0.1, node 0) would wait out the rendezvous alone, and
    be restarted to wait again. An etcd rendezvous, or c10d's own endpoint, needs neither."""
    if rendezvous.uses_etcd or rendezvous.endpoint:
        return
    needed = [flag for flag, key in (("--master-addr", "master_addr"), ("--node-rank", "node_rank"))
              if "default" in origins.get(key, "")]  # a source's single-node default, not a variable or a flag
    if needed:
        origin = origins["nnodes"]
        raise error_for(origin)(f"{origin}={settings.format_range((rendezvous.min_nodes, nnodes))}: a job of several nodes "
                                f"needs {' and '.join(needed)} on every node (node 0 is the master), or a cluster's "
                                "variables (--source), or a rendezvous that numbers the nodes (--rdzv-endpoint)")


def _check_is_host(rendezvous: Rendezvous, node_rank: int | None, origins: Mapping[str, str]) -> None:
    """A c10d job's node 0 hosts the store, and trainpod tells torch so (launch._rdzv_conf): an is_host in
    --rdzv-conf that says otherwise would leave the job without a store (every agent waiting on it until
    torch's own socket timeout, a C++ trace) or with two. Only an elastic job's (no node rank) is torch's to read."""
    given = rendezvous.settings.get("is_host")
    if rendezvous.backend != "c10d" or node_rank is None or given is None:
        return
    if (given.strip().lower() in rdzv_conf.TorchBoolean.TRUE) != (node_rank == 0):
        origin = origins.get("rdzv_conf", "--rdzv-conf")
        raise error_for(origin)(f"{origin} is_host={given}: node {node_rank} {'hosts' if node_rank == 0 else 'does not host'} "
                                "the c10d store (node 0 does, and trainpod says so to torch): leave is_host out")


def resolve_topology(
    options: Mapping[str, Any], env: Mapping[str, str], *, resolve_names: bool = True, nproc_per_node: tuple[int, str] | None = None
) -> Topology:
    """The topology for this node. `resolve_names=False` keeps it free of DNS traffic; `nproc_per_node`
    is (count, who fixes it) where what runs needs that many processes per node (DataParallel: 1)."""
    torchrun.refuse_in_a_worker(env)
    given = settings.resolve((environments.SOURCE, *settings.TOPOLOGY), options, env)
    cls = environments.select(env, given.source)
    if not given.source and cls is SingleNodeEnvironment and given.rdzv_backend in ETCD_BACKENDS:
        cls = EtcdEnvironment  # --rdzv-backend etcd*: no cluster source detects from a flag, and no other applies
    found = cls(env, options).discover()
    warnings = list(found.warnings)
    other_flags, other_vars = environments.unused_settings(cls, options, env)
    if other_flags:
        raise UsageError(f"{other_flags[0]}: only for that source, and this job's is {cls.name}: leave it out, or "
                         "choose the source (--source)")
    if other_vars:
        warnings.append(f"{', '.join(other_vars)} ignored: the {cls.name} source does not read them")
    ignored = environments.ignored_sources(env, cls)
    if ignored:
        chosen = f"--source {cls.name}" if given.source else f"{cls.name} (the first source that detects)"
        warnings.append(f"several cluster sources are set: using {chosen}; ignoring {'; '.join(ignored)}")

    origins: dict[str, str] = {}
    # The node count: a flag's N or MIN:MAX, else what the cluster says (PET_NNODES=1:4: an elastic range).
    if given.nnodes is not None:
        (min_nodes, nnodes), origins["nnodes"] = given.nnodes, given.origins["nnodes"]
    elif "nnodes" in found.missing:
        raise ConfigError(found.missing["nnodes"])
    else:
        nnodes, origins["nnodes"] = found.nnodes, found.origins.get("nnodes", cls.name)
        min_nodes = found.min_nodes or nnodes
    rendezvous, master, rdzv_origins, rdzv_warnings = _rendezvous(given, found, cls, _given_master(given, found, cls), env)
    origins.update(rdzv_origins)
    warnings += rdzv_warnings
    rendezvous = replace(rendezvous, min_nodes=min_nodes, max_nodes=nnodes, spares=_spares(given, rendezvous, min_nodes, nnodes))
    if rendezvous.spares:
        origins["spares"] = given.origins["spares"]
    rendezvous = replace(rendezvous, settings={**_rdzv_defaults(rendezvous), **rendezvous.settings})
    if master.addr is None:
        raise ConfigError(found.missing.get("master_addr", "no master_addr found"))
    if master.port is None:
        raise ConfigError(found.missing.get("master_port", "no master_port found"))
    origins["master_addr"], origins["master_port"] = master.addr_origin, master.port_origin

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
        count = settings.format_range((min_nodes, nnodes))
        told = origins["nnodes"] if "default" in origins["nnodes"] else f"{origins['nnodes']}={count}"
        raise error_for(culprit)(
            f"{origins['node_rank']}={node_rank}: expected a node rank from 0 to {nnodes - 1}: the job has {count} node(s) ({told})"
        )
    _check_is_host(rendezvous, node_rank, origins)
    if nnodes > 1:
        _check_nodes_can_meet(rendezvous, nnodes, origins)
    # The environment's address is checked as strictly as the flag's: '10.0.0.1:29500' or two
    # words would otherwise look like an unreachable master, which is retried.
    master_addr = settings.MASTER_ADDR.parse(master.addr, origins["master_addr"])

    gpus = devices.visible_gpu_count(env)
    nproc, origins["nproc_per_node"] = _nproc_per_node(given, found, gpus, nproc_per_node, env)
    backend, origins["backend"] = _backend(given, gpus, env)
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
        master_port=master.port,
        backend=backend,
        interface=interface,
        interface_reason=reason,
        rendezvous=rendezvous,
        max_restarts=found.max_restarts,
        origins=origins,
        warnings=tuple(warnings),
    )
