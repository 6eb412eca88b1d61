"""Checks that fail fast, with a message, where training would otherwise hang or crash later.

Each check is a small function; run_preflight() orders them. Only the waits touch the network,
and every wait is bounded by the connect timeout.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Callable

from trainpod import network
from trainpod.errors import ConfigError, UnreachableError
from trainpod.topology import Topology

PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
MIN_SHM_BYTES = 512 * 1024 * 1024
RETRY_INTERVAL_S = 1.0

Log = Callable[[str], None]


def check_torch() -> None:
    """`trainpod explain` runs without torch; launching needs it in this same Python."""
    if importlib.util.find_spec("torch") is None:
        raise ConfigError(
            "torch is not installed in this Python: use a trainpod image, or pip install torch "
            "(CPU: --index-url https://download.pytorch.org/whl/cpu) next to trainpod"
        )


def check_cuda_driver(topology: Topology, env: Mapping[str, str], *, cuda: str | None = None, driver=None) -> None:
    """A CUDA build of torch on a host whose NVIDIA driver is too old (or missing) fails late and
    obscurely (NCCL, "no GPU"): with NCCL or GPUs asked for, say so first, in one line (78).
    `cuda`, `driver`: torch's CUDA version and (version, where read), for tests."""
    from trainpod import devices

    if topology.backend != "nccl" and not devices.visible_gpu_count(env):
        return
    cuda = devices.torch_cuda_version() if cuda is None else cuda
    needed = devices.MIN_DRIVER_FOR_CUDA.get(int(cuda.split(".")[0])) if cuda else None
    if needed is None:
        return  # a CPU build (the backend check speaks for it) or a CUDA this table does not know
    version, where = devices.nvidia_driver_version() if driver is None else driver
    if version is None or version < needed:
        found = f"this host's is {'.'.join(map(str, version))} ({where})" if version else f"none was found ({where})"
        raise ConfigError(
            f"torch here is built for CUDA {cuda}, which needs an NVIDIA driver >= {'.'.join(map(str, needed))}, and "
            f"{found}: upgrade the host's driver, or run an image whose torch is built for an older CUDA; in a "
            "container the driver comes from the host (docker run --gpus all, NVIDIA container toolkit)"
        )


def resolve_master(topology: Topology, timeout: float) -> str:
    """The master's IP. Waits for DNS: on Kubernetes a peer's name appears only once it starts."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return network.resolve(topology.master_addr)
        except OSError as error:
            if time.monotonic() >= deadline:
                raise UnreachableError(
                    f"master address {topology.master_addr!r} ({topology.origins.get('master_addr', '?')}) "
                    f"did not resolve within {timeout:g}s: {error.strerror or error}"
                ) from None
            time.sleep(RETRY_INTERVAL_S)


def check_hostname(log: Log) -> None:
    """The classic 127.0.1.1 trap: peers that look this host up by name get a loopback address."""
    hostname = socket.gethostname()
    try:
        address = socket.gethostbyname(hostname)
    except OSError:
        return
    if address.startswith("127."):
        log(
            f"warning: this host's name {hostname!r} resolves to {address}; collectives are pinned to "
            "the chosen interface, but anything that looks peers up by name will get loopback: "
            "map the name to the host's real address in /etc/hosts"
        )


def check_shm(log: Log, path: str = "/dev/shm", minimum: int = MIN_SHM_BYTES) -> None:
    try:
        stats = os.statvfs(path)
    except OSError:
        return
    size = stats.f_frsize * stats.f_blocks
    if size < minimum:
        log(
            f"warning: {path} is {size // 2**20} MiB; DataLoader workers need more: run the container "
            "with --shm-size=2g (docker), shm_size: 2gb (compose) or --ipc=host"
        )


def check_port_free(topology: Topology) -> None:
    """On the master: the port torchrun's store will listen on must be free."""
    family = socket.AF_INET6 if ":" in topology.master_addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # The store sets SO_REUSEADDR too, so a port in TIME_WAIT after a restart is fine.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", topology.master_port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            raise UnreachableError(
                f"master port {topology.master_port} ({topology.origins.get('master_port', '?')}) is already "
                "in use on this host: another job holds it; reserve a port for the master"
            ) from None


def proxy_summary(env: Mapping[str, str]) -> str:
    proxies = [f"{var}={env[var]}" for var in PROXY_VARS if env.get(var)]
    if not proxies:
        return "no proxy variables set"
    return "proxy variables: " + ", ".join(proxies) + f"; NO_PROXY={env.get('NO_PROXY', env.get('no_proxy', ''))}"


def wait_for_master(topology: Topology, master_ip: str, timeout: float, env: Mapping[str, str], log: Log) -> None:
    """On a worker node: wait, bounded, until the master's port accepts connections."""
    deadline = time.monotonic() + timeout
    log(f"waiting up to {timeout:g}s for the master at {master_ip}:{topology.master_port}")
    last_error = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((master_ip, topology.master_port), timeout=max(0.5, min(5.0, remaining))):
                return
        except OSError as error:
            last_error = error.strerror or str(error) or type(error).__name__
        if time.monotonic() + RETRY_INTERVAL_S > deadline:
            raise UnreachableError(
                f"master {topology.master_addr}:{topology.master_port} (address from "
                f"{topology.origins.get('master_addr', '?')}, port from {topology.origins.get('master_port', '?')}) "
                f"not reachable within {timeout:g}s via interface {topology.interface or '?'} "
                f"({topology.interface_reason}); last error: {last_error}; {proxy_summary(env)}; "
                "check that node 0 is running and the port is open between the nodes"
            )
        time.sleep(RETRY_INTERVAL_S)


def check_interface(topology: Topology) -> None:
    # NCCL_SOCKET_IFNAME takes prefixes and ^exclusions, so only exact names are checked.
    origin = topology.origins.get("interface", "auto")
    if origin == "NCCL_SOCKET_IFNAME":
        return
    have = network.interfaces()
    for name in (topology.interface or "").split(","):
        if name.strip() not in have:
            raise ConfigError(f"{origin}={topology.interface!r}: no such interface here (have: {', '.join(sorted(have))})")


def run_preflight(topology: Topology, env: Mapping[str, str], *, connect_timeout: float, log: Log) -> Topology:
    """Run the checks; returns the topology with the interface settled once the master resolved."""
    check_torch()
    check_cuda_driver(topology, env)
    master_ip = resolve_master(topology, connect_timeout)
    if topology.interface is None:
        name, why = network.interface_for(master_ip)
        if name is None:
            raise UnreachableError(f"{why}: this host has no route to the master {topology.master_addr}")
        topology = replace(topology, interface=name, interface_reason=why)
    check_interface(topology)
    if topology.local_addr is None:
        # torchrun's rendezvous publishes this address to the other nodes; left alone it would
        # publish the host name, which peers often cannot resolve (or resolve to loopback).
        topology = replace(topology, local_addr=network.source_address_for(master_ip))
    if topology.nnodes > 1:
        check_hostname(log)
    check_shm(log)
    if topology.is_master:
        check_port_free(topology)
    elif topology.nnodes > 1:
        wait_for_master(topology, master_ip, connect_timeout, env, log)
    return topology
