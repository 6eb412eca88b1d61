"""fixtures.subnets: the /24 each compose project takes is free on the engine and on this host, and no two live
processes hold the same one."""

import ipaddress
import os
import subprocess
import sys

import pytest

from fixtures import subnets

ROUTES = """Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT
eth0\t00000000\t0100A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
eth0\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
br-1\t0028970A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
"""


@pytest.fixture
def reserved(tmp_path, monkeypatch):
    monkeypatch.setattr(subnets, "RESERVED", tmp_path / "subnets")
    return tmp_path / "subnets"


def test_host_routes_are_read_from_the_kernels_table_without_the_default_route(tmp_path):
    table = tmp_path / "route"
    table.write_text(ROUTES)
    assert subnets.host_routes(table) == [ipaddress.ip_network("192.168.0.0/24"), ipaddress.ip_network("10.151.40.0/24")]
    assert subnets.host_routes(tmp_path / "absent") == []


def test_a_subnet_taken_by_a_network_or_a_route_is_never_given(reserved, monkeypatch):
    every = list(subnets.POOL.subnets(new_prefix=24))
    free = every[7]
    monkeypatch.setattr(subnets, "engine_subnets", lambda: [net for net in every if net != free][:200])
    monkeypatch.setattr(subnets, "host_routes", lambda: [net for net in every if net != free][200:])
    assert subnets.allocate() == "10.151.7"
    assert (reserved / "10.151.7").read_text() == str(os.getpid())


def test_a_wider_network_takes_every_subnet_it_overlaps(reserved, monkeypatch):
    monkeypatch.setattr(subnets, "engine_subnets", lambda: [ipaddress.ip_network("10.151.0.0/17")])
    monkeypatch.setattr(subnets, "host_routes", list)
    given = {subnets.allocate() for _ in range(20)}
    assert all(int(prefix.rsplit(".", 1)[1]) >= 128 for prefix in given), given
    assert len(given) == 20  # each held until released


def test_a_live_processs_reservation_is_respected_and_a_dead_ones_is_taken(reserved, monkeypatch):
    every = list(subnets.POOL.subnets(new_prefix=24))
    monkeypatch.setattr(subnets, "engine_subnets", lambda: every[2:])
    monkeypatch.setattr(subnets, "host_routes", list)
    reserved.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    (reserved / "10.151.0").write_text(str(os.getppid()))  # a live process of this host (pytest's parent)
    (reserved / "10.151.1").write_text(dead.strip())
    assert subnets.allocate() == "10.151.1"
    with pytest.raises(AssertionError, match=r"no free /24 left in 10\.151\.0\.0/16"):
        subnets.allocate()


def test_release_frees_only_this_processs_own_reservation(reserved, monkeypatch):
    monkeypatch.setattr(subnets, "engine_subnets", lambda: list(subnets.POOL.subnets(new_prefix=24))[1:])
    monkeypatch.setattr(subnets, "host_routes", list)
    prefix = subnets.allocate()
    subnets.release(prefix)
    assert not (reserved / prefix).exists()
    (reserved / prefix).write_text(str(os.getppid()))
    subnets.release(prefix)  # another process's: kept
    assert (reserved / prefix).exists()


def test_avoid_skips_the_subnets_the_engine_refused(reserved, monkeypatch):
    monkeypatch.setattr(subnets, "engine_subnets", lambda: list(subnets.POOL.subnets(new_prefix=24))[2:])
    monkeypatch.setattr(subnets, "host_routes", list)
    assert subnets.allocate(avoid=frozenset({"10.151.0"})) == "10.151.1"
