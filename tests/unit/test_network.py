from trainpod import network


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
