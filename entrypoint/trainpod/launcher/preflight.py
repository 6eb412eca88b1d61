"""Checks that fail fast, with a message, where training would otherwise hang or crash later.

Each check is a small function; run_preflight() orders them. Only the waits touch the network,
and every wait is bounded by the connect timeout.
"""

from __future__ import annotations

import errno
import importlib
import importlib.machinery
import importlib.util
import os
import socket
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from trainpod.errors import EXIT_CANTCREAT, NO_SPACE, ConfigError, TrainpodError, UnreachableError, error_for
from trainpod.launcher import network
from trainpod.topology import Topology

if TYPE_CHECKING:
    from trainpod.launcher.launch import Target

PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
MIN_SHM_BYTES = 512 * 1024 * 1024
PIP_NAMES = {"PIL": "Pillow", "etcd": "python-etcd"}  # import name -> what to pip install
RETRY_INTERVAL_S = 1.0
# A wait's first seconds retry faster: a master (or etcd, or a DNS name) that starts beside this node
# comes up within seconds, and a second-long retry made every node of a job start up to 1 s after it.
FAST_RETRY_S, FAST_RETRIES_FOR_S = 0.1, 10.0
# A closed port answers a connect at once, from the peer's kernel: the master's port is tried more often (a
# worker node's agent starts that much sooner after the master's, and the first rendezvous round with it).
PORT_RETRY_S = 0.02

Log = Callable[[str], None]


def check_torch() -> None:
    """`trainpod explain` runs without torch; launching needs it in this same Python."""
    if importlib.util.find_spec("torch") is None:
        raise ConfigError(
            "torch is not installed in this Python: use a trainpod image, or pip install torch "
            "(CPU: --index-url https://download.pytorch.org/whl/cpu) next to trainpod"
        )


def check_cuda_build(topology: Topology, env: Mapping[str, str], *, cuda: str | None = None) -> None:
    """NCCL on a CPU build of torch fails in every rank, and their error names TRAINPOD_BACKEND, which the
    launcher set, not the user: where the visible GPUs made nccl the default (a GPU node's
    CUDA_VISIBLE_DEVICES, a CPU image), or nccl was asked for, say so first, in one line naming where it
    came from (78, or 64 for the flag). `cuda`: torch's CUDA version ('' for a CPU build), for tests."""
    from trainpod.launcher import devices

    if topology.backend != "nccl":
        return
    if cuda is None:  # a ROCm build has a HIP version instead, and its nccl backend is RCCL
        cuda = devices.torch_cuda_version() or devices.torch_cuda_version("hip")
    if cuda:
        return
    origin = topology.origins.get("backend", "--backend")
    if origin.startswith("default"):
        gpus = devices.visible_gpu_count(env)
        raise ConfigError(
            f"{devices.visible_gpus_origin(env)} makes {gpus} GPU(s) visible, so the backend defaults to nccl, but torch "
            f"here ({sys.executable}) is a CPU build: run a CUDA image (trainpod:cuda), or set CUDA_VISIBLE_DEVICES= "
            "(empty) to train on the CPU with gloo"
        )
    raise error_for(origin)(f"{origin}=nccl: torch here ({sys.executable}) is a CPU build, without NCCL: run a CUDA "
                            "image (trainpod:cuda), or use gloo on the CPU")


def check_cuda_driver(topology: Topology, env: Mapping[str, str], *, cuda: str | None = None, driver=None) -> None:
    """A CUDA build of torch on a host whose NVIDIA driver is too old (or missing) fails late and
    obscurely (NCCL, "no GPU"): with NCCL or GPUs asked for, say so first, in one line (78).
    `cuda`, `driver`: torch's CUDA version and (version, where read), for tests."""
    from trainpod.launcher import devices

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


def check_imports(needs: Sequence[str], what: str) -> None:
    """Import what the ranks will import (torch is only looked up: the agent imports it next, and it
    takes seconds); a missing or broken package is one line naming it, 78, before any rank starts."""
    for name in needs:
        package = PIP_NAMES.get(name, name)
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] != name.split(".")[0]:
                raise ConfigError(f"{name} does not import in {sys.executable}: it needs {exc.name}, which is not installed "
                                  f"({what} needs {name})") from None
            raise ConfigError(f"{name} is not installed in {sys.executable}: {what} needs it; pip install {package}") from None
        except Exception as exc:  # a broken install: an ImportError from inside, a failing native library
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ConfigError(f"{name} does not import in {sys.executable} ({type(exc).__name__}: {first}): {what} needs it; "
                              f"reinstall {package}") from None


def _pause(waited_s: float, fast: float = FAST_RETRY_S) -> float:
    """How long a bounded wait sleeps before its next try, `waited_s` into it."""
    return fast if waited_s < FAST_RETRIES_FOR_S else RETRY_INTERVAL_S


def resolve_master(topology: Topology, timeout: float) -> str:
    """The master's IP. Waits for DNS: on Kubernetes a peer's name appears only once it starts."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        try:
            return network.resolve(topology.master_addr)
        except OSError as error:
            if time.monotonic() >= deadline:
                raise UnreachableError(
                    f"master address {topology.master_addr!r} ({topology.origins.get('master_addr', '?')}) "
                    f"did not resolve within {timeout:g}s: {error.strerror or error}"
                ) from None
            time.sleep(_pause(time.monotonic() - start))


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


def check_shm(log: Log, path: str = "/dev/shm", minimum: int = MIN_SHM_BYTES,
              why: str = "DataLoader workers pass batches through it") -> None:
    try:
        stats = os.statvfs(path)
    except OSError:
        return
    size = stats.f_frsize * stats.f_blocks
    if size < minimum:
        gib = max(1, -(-minimum // 2**30))
        log(
            f"warning: {path} is {size // 2**20} MiB; this job needs about {minimum // 2**20} MiB ({why}): run the "
            f"container with --shm-size={gib}g (docker), shm_size: {gib}gb (compose) or --ipc=host"
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
    start = time.monotonic()
    deadline = start + timeout
    log(f"waiting up to {timeout:g}s for the master at {master_ip}:{topology.master_port}")
    last_error = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((master_ip, topology.master_port), timeout=max(0.5, min(5.0, remaining))):
                return
        except OSError as error:
            last_error = error.strerror or str(error) or type(error).__name__
        pause = _pause(time.monotonic() - start, PORT_RETRY_S)
        if time.monotonic() + pause > deadline:
            raise UnreachableError(
                f"master {topology.master_addr}:{topology.master_port} (address from "
                f"{topology.origins.get('master_addr', '?')}, port from {topology.origins.get('master_port', '?')}) "
                f"not reachable within {timeout:g}s via interface {topology.interface or '?'} "
                f"({topology.interface_reason}); last error: {last_error}; {proxy_summary(env)}; "
                "check that node 0 is running and the port is open between the nodes"
            )
        time.sleep(pause)


def check_etcd(topology: Topology, timeout: float, log: Log, probe_timeout: float = 5.0):
    """etcd answers within `timeout` (bounded wait, then 69 naming every endpoint tried) and serves what the
    backend needs: torch's `etcd` rendezvous speaks only the v2 API (78 with both fixes where it is off).
    TLS configured wrong on either side (plain http to a TLS etcd included), a wrong user or password, and
    a user without permission on the job's keys are 78 at once, naming the endpoint (never retried)."""
    from trainpod.rendezvous import generation
    from trainpod.rendezvous.etcd_http import EtcdAccessError, EtcdClient, EtcdUnreachableError, probe

    rdzv = topology.rdzv
    origin = topology.origins.get("rdzv_endpoint", "--rdzv-endpoint")
    start = time.monotonic()
    deadline = start + timeout
    said = False
    while True:
        try:
            info = probe(rdzv.endpoint, timeout=max(0.5, min(probe_timeout, deadline - time.monotonic())), access=rdzv.access)
            client = EtcdClient(info.endpoint, probe_timeout, rdzv.access)
            # What the job writes: its generation (both backends, v3), the rendezvous (etcd-v3: v3, under
            # etcd_v3.KEY_PREFIX, not imported here: torch; etcd: torch's keys in the v2 key space).
            client.check_writable(generation.key(rdzv.id))
            if rdzv.backend == "etcd-v3":
                client.check_writable(f"/trainpod/rdzv/{rdzv.id}.g0/state".encode())
            elif info.v2_enabled:
                client.check_v2_readable(rdzv.settings.get("etcd_prefix", "/torchelastic/p2p").rstrip("/") or "/")
            break
        except EtcdAccessError as error:
            raise ConfigError(f"{error} ({origin})") from None
        except EtcdUnreachableError as error:
            pause = _pause(time.monotonic() - start)
            if time.monotonic() + pause > deadline:
                raise UnreachableError(f"etcd at {rdzv.endpoint} ({origin}) did not answer within {timeout:g}s "
                                       f"(--connect-timeout): {error}; tried {rdzv.endpoint}") from None
            if not said:
                log(f"waiting up to {timeout:g}s for etcd at {rdzv.endpoint} ({error})")
                said = True
            time.sleep(pause)
    if rdzv.backend == "etcd" and not info.v2_enabled:
        raise ConfigError(
            f"etcd at {info.endpoint} ({origin}, etcd {info.version}) does not serve the v2 API that torch's etcd rendezvous "
            f"(--rdzv-backend etcd, {topology.origins.get('rdzv_backend', '?')}) needs: start etcd with --enable-v2 "
            "(3.4 and 3.5; 3.6 removed v2), or use --rdzv-backend etcd-v3 (etcd's v3 API, no flag needed)")
    return info


def check_interface(topology: Topology) -> None:
    """The interface the backend will use exists here, in that backend's syntax (network.check_ifname)."""
    origin = topology.origins.get("interface", "auto")
    if topology.interface:
        network.check_ifname(topology.interface, origin, "nccl" if origin == "NCCL_SOCKET_IFNAME" else "gloo")


def check_writable(path: str, what: str) -> None:
    """A directory the job's ranks will write (`what`: its name and its flag and variable): created if
    missing, and a file created in it and removed again, as the job's user, without importing torch.
    Unwritable: 78 (a read-only root filesystem, a volume owned by root, a file on the path), with the
    mounts that fix it; no space: 73. Retrying helps in neither case."""
    absolute = os.path.abspath(path)
    try:
        os.makedirs(absolute, exist_ok=True)
        with tempfile.TemporaryFile(dir=absolute, prefix=".trainpod-probe."):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno in (errno.EEXIST, errno.ENOTDIR):
            dangling = os.path.islink(absolute) and not os.path.exists(absolute)
            reason = (f"it is a link to {os.readlink(absolute)}, which does not exist" if dangling
                      else "it, or a folder on its path, is a file")
        why = f"the {what.format(path=absolute)} is not writable by uid {os.getuid()}: {reason}"
        if exc.errno in NO_SPACE:
            raise TrainpodError(why, exit_code=EXIT_CANTCREAT) from None
        raise ConfigError(f"{why}; mount a writable directory there (docker run -v HOSTDIR:{absolute}, or --tmpfs "
                          f"{absolute}:uid={os.getuid()},gid={os.getgid()}) or choose another one") from None


def shm_needed(topology: Topology, target: Target | None) -> int:
    """The /dev/shm (bytes) this job needs: DataLoader workers pass batches through it, NCCL's transport
    between the ranks of a node too. 0 where it cannot matter (a bundled example without workers)."""
    needed = 0
    if target is None or target.shm_mib is None:
        needed = MIN_SHM_BYTES  # a command: it may start DataLoader workers, trainpod cannot know
    elif target.shm_mib:
        needed = target.shm_mib * 2**20
    if topology.backend == "nccl" and topology.nproc_per_node > 1:
        needed = max(needed, MIN_SHM_BYTES)
    return needed


def run_preflight(topology: Topology, env: Mapping[str, str], *, connect_timeout: float, log: Log,
                  target: Target | None = None) -> Topology:
    """Run the checks; returns the topology with the interface settled once the master resolved."""
    check_torch()
    check_cuda_build(topology, env)
    check_cuda_driver(topology, env)
    if target is not None and target.needs:
        check_imports(target.needs, f"the example {target.module}" if target.module else "the job")
    if topology.rdzv.backend == "etcd":
        check_imports(("etcd",), "torch's etcd rendezvous (--rdzv-backend etcd; --rdzv-backend etcd-v3 needs no package)")
    if target is not None and target.output_dir:
        check_writable(target.output_dir, target.directories()[0][1])
    if target is not None and target.checkpoint_dir and topology.node_rank == 0:  # where rank 0 saves them
        check_writable(target.checkpoint_dir, target.directories()[1][1])
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
        check_hostname(log)  # only peers on other hosts look this one up by name
    shm = shm_needed(topology, target)
    if shm:
        nccl = topology.backend == "nccl" and topology.nproc_per_node > 1
        workers = target is None or target.shm_mib != 0
        why = " and ".join(w for w, used in (("DataLoader workers pass batches through it", workers),
                                             ("NCCL's transport between this node's ranks", nccl)) if used)
        check_shm(log, minimum=shm, why=why)
    if topology.rdzv.uses_etcd:
        check_etcd(topology, connect_timeout, log)
    elif topology.is_master:
        check_port_free(topology)
    elif topology.nnodes > 1 and topology.node_rank is not None:
        # (An elastic c10d node without a rank may be the store's host itself: torch finds out.)
        wait_for_master(topology, master_ip, connect_timeout, env, log)
    return topology
