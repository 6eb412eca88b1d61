import pytest

from trainpod.errors import ConfigError
from trainpod.launcher import network


def test_loopback_master():
    assert network.interface_for("127.0.0.1")[0] == "lo"
    assert network.interface_for("127.0.0.9")[0] == "lo"


def test_an_address_of_this_host_is_held_by_its_interface():
    for name, addresses in network.interfaces().items():
        for address in addresses:
            if not address.startswith(("127.", "fe80", "::1")):
                assert network.interface_for(address) == (name, f"holds the master address {address}")
                return


def test_route_lookup_names_a_real_interface():
    name, why = network.interface_for("192.0.2.200")  # TEST-NET-1: routed by the default route, never contacted
    assert name is None or name in network.interfaces()


def test_hosts_file_lookup(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.0.0.7 node0 node0.cluster  # comment\n# 10.0.0.8 node1\n")
    assert network.resolve_from_hosts_file("node0", str(hosts)) == "10.0.0.7"
    assert network.resolve_from_hosts_file("node0.cluster", str(hosts)) == "10.0.0.7"
    assert network.resolve_from_hosts_file("node1", str(hosts)) is None


def test_ip_literals():
    assert network.is_ip_literal("10.0.0.1") and network.is_ip_literal("fd00::2")
    assert not network.is_ip_literal("node0")
    assert network.resolve("10.0.0.1") == "10.0.0.1"


def test_source_address_is_what_the_kernel_sends_from():
    assert network.source_address_for("127.0.0.1") == "127.0.0.1"
    some_local = next(a for addrs in network.interfaces().values() for a in addrs if "." in a)
    assert network.source_address_for(some_local) == some_local  # the master's own address, on the master


def _stats(flags: str):
    import psutil

    kind = type(next(iter(psutil.net_if_stats().values())))  # psutil's own record, as net_if_stats() gives it
    return kind(isup="up" in flags, duplex=0, speed=0, mtu=1500, flags=flags)


def test_an_interface_that_is_down_or_has_no_address_is_unusable():
    addresses = {"lo": ["127.0.0.1"], "ifb0": [], "eth0": ["10.0.0.2"], "eth1": ["10.0.1.2"]}
    stats = {"lo": _stats("up,loopback,running"), "ifb0": _stats("broadcast,noarp"), "eth0": _stats("up,broadcast,running"),
             "eth1": _stats("broadcast,multicast")}
    assert network.unusable("ifb0", addresses, stats).startswith("is down")
    assert network.unusable("eth1", addresses, stats).startswith("is down")
    assert network.unusable("eth0", {**addresses, "eth0": []}, stats).startswith("has no IP address")
    assert network.unusable("eth0", addresses, stats) == network.unusable("lo", addresses, stats) == ""
    # up without carrier (docker0 with no container): gloo binds to its address; not refused
    assert network.unusable("eth0", addresses, {**stats, "eth0": _stats("up,broadcast,multicast")}) == ""


def _down_here():
    return next((name for name in sorted(network.interfaces()) if network.unusable(name)), None)


@pytest.mark.parametrize(("origin", "backend"), [("--interface", "gloo"), ("GLOO_SOCKET_IFNAME", "gloo"),
                                                  ("NCCL_SOCKET_IFNAME", "nccl")])
def test_this_hosts_down_interface_is_78_before_anything_starts(origin, backend):
    """The issue's `--interface ifb0` (it exists, is down, has no address): every rank died in gloo's
    "Unable to find address" and the job was restarted; now one line, 78, naming it."""
    name = _down_here()
    if name is None:
        pytest.skip("no interface on this host is down or without an address")
    with pytest.raises(ConfigError, match=rf"^{origin}='{name}': .*{name} (is down|has no IP address)") as error:
        network.check_ifname(name, origin, backend)
    assert error.value.exit_code == 78
