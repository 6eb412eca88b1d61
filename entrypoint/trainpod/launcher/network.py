"""Which network interface gloo and NCCL should use: the one that carries traffic to the master.

Left alone, gloo takes the address the host name resolves to (often 127.0.1.1 in containers)
and NCCL picks the first non-loopback interface, which on a multi-homed host may not reach the
master at all. The kernel's routing table knows the answer; we ask it over netlink.
"""

from __future__ import annotations

import ipaddress
import socket

import psutil


def is_ip_literal(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


def resolve(host: str) -> str:
    """The IP address `host` resolves to (IPv4 preferred); raises OSError when it does not."""
    if is_ip_literal(host):
        return host
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return infos[0][4][0]


def resolve_from_hosts_file(host: str, path: str = "/etc/hosts") -> str | None:
    """`host` looked up in /etc/hosts only: a local file read, no DNS traffic."""
    try:
        with open(path, encoding="utf-8", errors="replace") as hosts:
            for line in hosts:
                fields = line.split("#", 1)[0].split()
                if len(fields) >= 2 and host in fields[1:]:
                    return fields[0]
    except OSError:
        return None
    return None


def interfaces() -> dict[str, list[str]]:
    """Interface name -> its IP addresses."""
    families = (socket.AF_INET, socket.AF_INET6)
    return {
        name: [a.address.split("%")[0] for a in addrs if a.family in families]
        for name, addrs in psutil.net_if_addrs().items()
    }


def unusable(name: str, addresses: dict[str, list[str]] | None = None, stats: dict | None = None) -> str:
    """Why the backends cannot use interface `name` ('' if they can): gloo binds to an address of the
    interface ("Unable to find address" in every rank when it has none), and an interface that is
    administratively down carries nothing. `addresses`, `stats`: interfaces() and psutil's
    net_if_stats(), read once by the caller."""
    addresses = interfaces() if addresses is None else addresses
    stats = psutil.net_if_stats() if stats is None else stats
    state = stats.get(name)
    if state is not None and "up" not in state.flags.split(","):
        return f"is down (ip link set {name} up, or choose another)"
    if not addresses.get(name):
        return "has no IP address (gloo and NCCL bind to one)"
    return ""


def check_ifname(value: str, origin: str, backend: str) -> None:
    """`value` names an interface here, in the syntax of the backend that reads it; else one line
    naming `origin` (64 for a flag, 78 for a variable). An interface that exists but is down or has no
    address is the host's configuration, not a typo: 78 whatever named it (unusable()).

    gloo (GLOO_SOCKET_IFNAME, --interface): exact names, comma-separated, each must exist.
    NCCL (NCCL_SOCKET_IFNAME): prefixes, comma-separated ("eth,ib" takes eth0 and ib1); "=" before
    the list makes the names exact, "^" excludes them instead ("^docker,lo", "^=docker0"); at
    least one interface here must be left for NCCL to use.
    """
    from trainpod.errors import ConfigError, error_for

    addresses, stats = interfaces(), psutil.net_if_stats()
    have = sorted(addresses)
    text = value.strip()
    if backend == "nccl":
        exclude = text.startswith("^")
        rest = text[1:] if exclude else text
        exact = rest.startswith("=")
        entries = [e.strip() for e in (rest[1:] if exact else rest).split(",") if e.strip()]

        def matches(name: str) -> bool:
            return any(name == e if exact else name.startswith(e) for e in entries)

        chosen = [name for name in have if matches(name) != exclude]
        syntax = "exact names" if exact else "name prefixes"
        if not (entries and chosen):
            how = "excludes every interface" if exclude else "matches no interface"
            raise error_for(origin)(f"{origin}={value!r}: NCCL reads it as {syntax}, and it {how} here (have: {', '.join(have)})")
        why = {name: unusable(name, addresses, stats) for name in chosen}
        if all(why.values()):  # NCCL uses the matching interfaces that work: one is enough
            raise ConfigError(f"{origin}={value!r}: NCCL reads it as {syntax}, and every interface it takes here is "
                              f"unusable: " + "; ".join(f"{name} {reason}" for name, reason in why.items()))
        return
    names = [name.strip() for name in text.split(",")]
    missing = [name for name in names if name not in have]
    if missing or not text:
        raise error_for(origin)(f"{origin}={value!r}: no such interface here (have: {', '.join(have)})")
    for name in names:  # gloo uses each one it is given
        reason = unusable(name, addresses, stats)
        if reason:
            usable = [n for n in have if not unusable(n, addresses, stats)]
            raise ConfigError(f"{origin}={value!r}: the interface {name} {reason}; usable here: {', '.join(usable)}")


def route_interface(destination: str) -> str | None:
    """The interface the kernel would send packets to `destination` through."""
    from pyroute2 import IPRoute  # netlink; imported late, it is only needed here

    family = socket.AF_INET6 if ipaddress.ip_address(destination).version == 6 else socket.AF_INET
    try:
        with IPRoute() as ipr:
            routes = ipr.route("get", dst=destination, family=family)
            if not routes:
                return None
            links = ipr.get_links(routes[0].get("oif"))
            return links[0].get("ifname") if links else None
    except Exception:  # no route (ENETUNREACH), or netlink unavailable: the caller explains
        return None


def interface_for(master_ip: str) -> tuple[str | None, str]:
    """(interface, why) for reaching `master_ip` from this host."""
    address = ipaddress.ip_address(master_ip)
    for name, addresses in interfaces().items():
        if master_ip in addresses:
            return name, f"holds the master address {master_ip}"
    if address.is_loopback:
        return "lo", "the master is on loopback"
    name = route_interface(master_ip)
    if name is None:
        return None, f"no route to the master {master_ip}"
    return name, f"carries the route to the master {master_ip}"


def source_address_for(destination: str) -> str | None:
    """The address this host sends from towards `destination`: what peers can reach it at.

    A connected UDP socket sends nothing; connect() only makes the kernel pick the route and
    the source address, the same choice it makes for the job's TCP connections.
    """
    family = socket.AF_INET6 if ipaddress.ip_address(destination).version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((destination, 9))
            return probe.getsockname()[0]
    except OSError:
        return None
