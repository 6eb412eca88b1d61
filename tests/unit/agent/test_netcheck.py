"""trainpod.agent.netcheck: the verdict every node reaches from the same reports (which node a slow or broken link
names), and the real check between "nodes" on this host: real sockets, a real TCPStore, the real child processes
and a gloo all-reduce over the loopback interface."""

import dataclasses
import threading

import pytest

from trainpod.agent import netcheck
from trainpod.agent.netcheck import Report

HOSTS = ("a", "b", "c", "d")


def reports(world: int, gbit: dict[tuple[int, int], float] | None = None, default: float = 10.0, **changes) -> dict[int, Report]:
    """Every node's report for a ring of `world` nodes, each link at `default` Gbit/s unless `gbit` says otherwise."""
    gbit = gbit or {}
    made = {rank: Report(rank=rank, host=HOSTS[rank], rtt_ms={}, gbit_s={}, allreduce_ms=5.0) for rank in range(world)}
    for src, dst in netcheck.links(world):
        made[src].rtt_ms[dst] = 0.1
        made[dst].gbit_s[src] = gbit.get((src, dst), default)
    for rank, report in changes.items():
        made[int(rank[1:])] = report
    return made


def test_the_rings_measure_each_direction_once_between_two_nodes_and_both_neighbours_from_three():
    assert netcheck.links(2) == [(0, 1), (1, 0)]
    assert sorted(netcheck.links(3)) == [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]
    assert len(netcheck.links(8)) == 16  # two rings, not every pair
    assert netcheck.links(1) == []


def test_a_healthy_job_gets_one_line_with_its_figures_and_names_no_node():
    found = netcheck.verdict(reports(2, {(1, 0): 8.0}), 2, min_gbit_s=1, interface="eth0")
    assert found.ok
    assert found.line == ("network: 2 nodes over eth0, links 8-10 Gbit/s (slowest: node 1 to node 0), round trip 0.1-0.1 ms, "
                          "all-reduce of 4 MiB 5 ms, every link above --min-bandwidth 1 Gbit/s")


def test_between_two_nodes_the_sender_of_the_slow_link_is_named():
    found = netcheck.verdict(reports(2, {(1, 0): 0.09}), 2, min_gbit_s=1)
    assert list(found.named) == [1]
    assert "the link from node 1 (b) to node 0 (a) carries 0.09 Gbit/s, below --min-bandwidth 1 Gbit/s (round trip 0.1 ms)" \
        in found.line and found.line.endswith("node 1 (b) is named")


@pytest.mark.parametrize("slow", [{(1, 2): 0.1, (1, 0): 0.2}, {(0, 1): 0.1, (2, 1): 0.2}], ids=["sending", "receiving"])
def test_from_three_nodes_the_node_at_the_end_of_every_slow_link_is_named_whichever_side_is_slow(slow):
    found = netcheck.verdict(reports(3, slow), 3, min_gbit_s=1)
    assert list(found.named) == [1], found.line


def test_a_node_whose_every_link_is_slow_is_named_alone_beside_one_healthy_link_that_measured_slow():
    # node 0 at 1 Mbit/s: its sends are slow, and so is what it receives (its ACKs are shaped too); under load the
    # healthy link from node 1 to node 2 measured below the bound as well. Every slow link's sender was named: all.
    slow = {(0, 1): 0.001, (0, 2): 0.001, (1, 0): 0.05, (2, 0): 0.04, (1, 2): 0.3}
    found = netcheck.verdict(reports(3, slow), 3, min_gbit_s=0.5)
    assert list(found.named) == [0], found.line
    assert "the link from node 0 (a) to node 1 (b) carries 0.001 Gbit/s" in found.line, found.line


def test_a_link_whose_other_end_measured_nothing_else_does_not_name_that_end():
    # node 0 at 1 Mbit/s among three, under load: the budget ran out before node 1's other links were measured. Its
    # only measured link was node 0's slow one, and as "a node whose every link is slow" it was named.
    measured = {(0, 1), (2, 0), (0, 2)}
    made = reports(3, {(0, 1): 0.001, (2, 0): 0.04})
    for src, dst in netcheck.links(3):
        if (src, dst) not in measured:
            del made[dst].gbit_s[src]
    found = netcheck.verdict(made, 3, min_gbit_s=0.5)
    assert list(found.named) == [0], found.line


@pytest.mark.parametrize("shaped", [0, 1])
def test_between_two_nodes_both_directions_slow_name_the_sender_of_the_far_slower_one(shaped):
    # A node at 1 Mbit/s sends its stream at 1 Mbit/s; the stream it receives starves of its ACKs, at some 40 Mbit/s:
    # both below the bound. Every slow link's sender was named, both nodes (CI: an elastic job lost a healthy node).
    other = 1 - shaped
    found = netcheck.verdict(reports(2, {(shaped, other): 0.001, (other, shaped): 0.044}), 2, min_gbit_s=0.5)
    assert list(found.named) == [shaped], found.line
    # The same between the two of three that were measured in the budget (the third's links not measured).
    made = reports(3, {(0, 1): 0.001, (1, 0): 0.044})
    for src, dst in netcheck.links(3):
        if 2 in (src, dst):
            del made[dst].gbit_s[src]
    assert list(netcheck.verdict(made, 3, min_gbit_s=0.5).named) == [0]


def test_two_directions_alike_slow_cannot_be_told_apart_and_name_both_nodes():
    found = netcheck.verdict(reports(2, {(0, 1): 0.01, (1, 0): 0.02}), 2, min_gbit_s=0.5)
    assert sorted(found.named) == [0, 1], found.line


def test_without_a_bound_a_slow_link_names_nobody():
    assert netcheck.verdict(reports(2, {(1, 0): 0.01}), 2).ok


def test_a_network_slower_than_the_bound_everywhere_is_said_as_such():
    found = netcheck.verdict(reports(3, default=0.5), 3, min_gbit_s=1)
    assert set(found.named) == {0, 1, 2} and "the network is slower than the bound, not one node" in found.line


def test_a_node_that_did_not_report_is_named():
    made = reports(3)
    del made[2]
    found = netcheck.verdict(made, 3)
    assert list(found.named) == [2] and "node 2 did not finish the network check" in found.line


def test_a_link_that_cannot_be_opened_names_its_destination_and_one_nobody_used_names_its_source():
    made = reports(2)
    made[0].errors["0>1"] = "cannot connect to 10.0.0.2:4000: [Errno 113] No route to host"
    assert list(netcheck.verdict(made, 2).named) == [1]
    made = reports(2)
    made[1].errors["0>1"] = "no connection from it within 20 s (timed out)"
    assert list(netcheck.verdict(made, 2).named) == [0]


def test_the_all_reduce_runs_only_where_the_rings_say_it_can_finish_in_the_time_left():
    def links(*gbit: float, errors=()):
        return {rank: {"gbit_s": {str((rank + 1) % len(gbit)): value}, "errors": list(errors) if rank == 0 else []}
                for rank, value in enumerate(gbit)}

    assert netcheck.why_no_allreduce(links(10.0, 8.0), 2, left_s=15) == ""
    assert netcheck.why_no_allreduce(links(0.5, 8.0), 2, left_s=15) == ""  # about 0.5 s of 15
    slow = netcheck.why_no_allreduce(links(10.0, 0.001), 2, left_s=15)  # a 1 Mbit/s link: minutes
    assert slow.startswith("over the slowest link (0.001 Gbit/s) it would take about 268 s, of the 15 s"), slow
    assert netcheck.why_no_allreduce(links(10.0, 0.02), 2, left_s=15).startswith("over the slowest link (0.02 Gbit/s)")
    assert netcheck.why_no_allreduce(links(10.0), 2, left_s=15) == "not every node's links were measured in time"
    assert netcheck.why_no_allreduce(links(10.0, 10.0, errors=["0>1"]), 2, left_s=15) == "a link failed"


def test_a_skipped_all_reduce_names_nobody_is_said_and_the_rings_name_the_slow_link():
    def skipped(made: dict[int, Report]) -> dict[int, Report]:
        return {rank: dataclasses.replace(report, allreduce_ms=None, allreduce_skipped="over the slowest link (...)")
                for rank, report in made.items()}

    found = netcheck.verdict(skipped(reports(2)), 2, interface="eth0")
    assert found.ok and "no all-reduce of 4 MiB: over the slowest link (...)" in found.line, found.line
    found = netcheck.verdict(skipped(reports(2, {(1, 0): 0.001})), 2, min_gbit_s=0.5)
    assert list(found.named) == [1] and "carries 0.001 Gbit/s, below --min-bandwidth 0.5" in found.line, found.line


@pytest.mark.slow
def test_gloo_s_own_timeout_is_told_from_a_peer_that_never_connected():
    """Real gloo over loopback: a peer that connected and then sent nothing (a link too slow for the time left) is
    a timeout the rings explain; a peer that never came is the node's failure (its store key never appeared)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def peer_that_stops_after_connecting():
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=10)
        options._devices = [dist.ProcessGroupGloo.create_device(interface="lo")]
        client = TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
        group = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", client), 1, 2, options)
        group.allreduce([torch.ones(netcheck.ALLREDUCE_BYTES // 4)]).wait()  # the pairs connect; then nothing
        finished.wait(30)

    finished = threading.Event()
    peer = threading.Thread(target=peer_that_stops_after_connecting, daemon=True)
    peer.start()
    with pytest.raises(RuntimeError) as slow:
        netcheck._allreduce_ms(store, 0, 2, "lo", timeout_s=1.0)
    finished.set()
    assert netcheck.timed_out(slow.value), slow.value
    with pytest.raises(Exception) as absent:  # noqa: PT011 - the store's error type differs across torch versions
        netcheck._allreduce_ms(TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False), 0, 2, "lo", timeout_s=1.0)
    assert not netcheck.timed_out(absent.value), absent.value


@pytest.mark.slow
def test_a_check_with_no_time_left_for_the_all_reduce_still_reports_in_its_budget():
    found = run_nodes(2, budget_s=2.5)  # the rings take about 1 s; the all-reduce's reserve is 2 s
    assert found[0] == found[1] and found[0].ok, found
    assert "no all-reduce of 4 MiB: over the slowest link (" in found[0].line and "of the 0 s the check had left" in \
        found[0].line, found[0].line


def test_a_report_survives_its_json():
    report = reports(3)[1]
    assert Report.from_json(report.to_json()) == report


def run_nodes(world: int, present: int | None = None, budget_s: float = 8.0, start_s: float = netcheck.START_S
              ) -> dict[int, netcheck.Verdict]:
    """netcheck.check() on `present` of `world` nodes of this host (threads, one round store), over loopback."""
    from torch.distributed import TCPStore

    round_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    found: dict[int, netcheck.Verdict] = {}

    def node(rank: int) -> None:
        store = round_store if rank == 0 else TCPStore("127.0.0.1", round_store.port, is_master=False, wait_for_workers=False)
        found[rank] = netcheck.check(store, rank, world, "lo", 0.001, budget_s=budget_s, start_s=start_s)

    threads = [threading.Thread(target=node, args=(rank,)) for rank in range(world if present is None else present)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return found


@pytest.mark.slow
def test_two_nodes_on_this_host_measure_their_links_and_all_reduce_over_loopback():
    found = run_nodes(2)
    assert found[0] == found[1] and found[0].ok, found
    assert found[0].line.startswith("network: 2 nodes over lo, links ") and "all-reduce of 4 MiB" in found[0].line


@pytest.mark.slow
def test_a_node_that_never_comes_is_named_by_the_others_within_the_budget():
    found = run_nodes(2, present=1, budget_s=3.0, start_s=3.0)  # the other node's child never starts
    assert list(found[0].named) == [1], found[0].line


def test_a_node_without_an_address_on_the_interface_names_itself():
    found = netcheck.check(None, 1, 2, "no-such-interface0")
    assert list(found.named) == [1] and "has no address on the interface no-such-interface0" in found.line


def fake_stream(arrivals: list[tuple[float, int]]):
    """A receive() and a clock for best_window_gbit_s: each receive returns at the next (time, bytes) of `arrivals`."""
    now = [0.0]
    queue = list(arrivals)

    def receive() -> int:
        at, size = queue.pop(0)
        now[0] = at
        return size

    return receive, lambda: now[0]


def test_a_link_s_figure_is_its_best_window_not_the_cpu_s_share():
    # Steady 1 MB every 10 ms (800 Mbit/s), but the receiver was off the CPU for 0.2 s of the 0.4 s: over the
    # whole stream that is 400 Mbit/s; the windows where it ran say what the link carries.
    arrivals = [(0.1 + 0.01 * i, 1_000_000) for i in range(1, 11)] + [(0.3 + 0.01 * i, 1_000_000) for i in range(1, 30)]
    receive, clock = fake_stream(arrivals)
    gbit = netcheck.best_window_gbit_s(receive, counting_from=0.1, measure_s=0.4, window_s=0.1, clock=clock)
    assert gbit == pytest.approx(0.8, rel=0.02)


def test_a_slow_link_is_slow_in_every_window_and_a_stream_without_a_whole_window_counts_whole():
    receive, clock = fake_stream([(0.1 + 0.05 * i, 125_000) for i in range(1, 12)])  # 20 Mbit/s
    assert netcheck.best_window_gbit_s(receive, 0.1, 0.4, 0.1, clock) == pytest.approx(0.02, rel=0.01)
    receive, clock = fake_stream([(0.35, 500_000), (0.45, 500_000), (0.55, 0)])  # no whole window of 0.5 s in 0.4 s
    assert netcheck.best_window_gbit_s(receive, 0.1, 0.4, 0.5, clock) == pytest.approx(1_000_000 * 8 / 0.45 / 1e9)
    receive, clock = fake_stream([(0.05, 1_000), (0.6, 0)])  # nothing after the warm-up
    assert netcheck.best_window_gbit_s(receive, 0.1, 0.4, 0.1, clock) == 0.0
