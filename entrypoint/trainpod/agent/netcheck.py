"""A network check after the rendezvous that names the slow link (--netcheck, --min-bandwidth).

A node with a slow or lossy link drags every step of the whole job and says nothing: each
collective waits for it. With --netcheck on, after each rendezvous round and before any rank starts,
the nodes measure the network they are about to train over, on the chosen interface (the one
GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME name):

- each link of a ring over the nodes (node i sends to node i+1; with three nodes or more also to
  node i-1, after the first ring is done): round trips of one byte (the median of PINGS), then a
  stream of bytes for WARM_S + MEASURE_S, whose last MEASURE_S the receiver counts (TCP's slow start
  is not counted) in windows of WINDOW_S: the link's figure is its best window. A host busy with other
  work leaves either end off the CPU for part of the stream, and a figure over the whole stream was the
  CPU's share, not the link's (under the test suite's load an unshaped link measured below the bound,
  and a healthy node was named); a slow link is slow in every window. A ring costs the same at 2
  nodes and at 200, where every pair would not; it measures every node's sending and receiving side;
- an all-reduce of ALLREDUCE_BYTES with gloo over the interface, as the ranks will run it, where the
  rings say it can finish in what is left of the budget (why_no_allreduce(): over a 1 Mbit/s link it
  would take minutes, and what gloo had queued would starve the check itself); the line says why not.

The result is one line per job, said by node 0. With --min-bandwidth G (Gbit/s), a link below G
names a node (_blamed()): each node all of whose links are slow, else the one at the end of every
slow link where there is one (a node whose own side is slow, in both rings), else, where both
directions between two nodes are slow, the sender of the one at least ASYMMETRY times slower (a slow
sending side starves the reverse stream only of its ACKs), else the sender of each slow link (shaping
and most link faults hit a node's sending side; two equally slow directions cannot be told apart).
A link that cannot be
opened names its destination, a node that did not finish the check names itself. What a named node
costs is the agent's decision (trainpod.agent.policy): a fixed-size job ends (69), an elastic job
goes on without the node.

The measuring runs in a child process (`python -m trainpod.agent.netcheck`), never in the agent: a
gloo group torn down at interpreter exit can abort its process (docs/shutdown.md), and the agent
outlives every round. The agent of node 0 hosts a TCPStore for the children (the rendezvous store
differs from backend to backend: c10d, etcd, etcd-v3) and publishes its address in the round's
store. The children exchange their measurements through it; node 0's child says which reports
count (those in by the budget), so every agent judges the same set and reaches the same verdict
(verdict()).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta

MODES = ("off", "on")
KEY_PREFIX = "trainpod/netcheck/"  # in the round's store: the children's store address
PINGS = 10
WARM_S = 0.1
MEASURE_S = 0.4
WINDOW_S = 0.1  # the stream's figure is its best window of this length (module docstring)
ASYMMETRY = 4  # one direction of a pair this many times slower than the other names its sender alone (_blamed())
CHUNK = 256 << 10
ALLREDUCE_BYTES = 4 << 20
ALLREDUCE_TIMES = 3
BUDGET_S = 20.0  # a child's measuring, the waits for the other nodes included: a node that did not report by then is named
# Before the measuring: a child's start (Python and torch, seconds of CPU) and its wait for the other nodes' children.
# The budget starts only once every child is there (or START_S passed): on a host busy with other work a child took
# longer to start than the whole budget, and a healthy node was named for its import of torch, not for its network.
START_S = 60.0
WAIT_S = 20.0  # one node for another at each step of the check
FINAL_S = 3.0  # past the budget, for node 0's child to say which reports count
ALLREDUCE_RESERVE_S = 2.0  # of the budget, kept after the all-reduce for the reports (it gets the rest, not WAIT_S)
CHILD_TIMEOUT_S = START_S + BUDGET_S + FINAL_S + 10  # the whole child: its start, the measuring, the final say


@dataclass(frozen=True)
class Report:
    """One node's measurements: round trips on the links it sent on, bandwidth on those it received on."""

    rank: int
    host: str
    address: str = ""
    rtt_ms: dict[int, float] = field(default_factory=dict)  # destination -> median round trip
    gbit_s: dict[int, float] = field(default_factory=dict)  # source -> bandwidth received
    errors: dict[str, str] = field(default_factory=dict)  # "src>dst" -> what went wrong on that link
    allreduce_ms: float | None = None
    allreduce_skipped: str = ""  # why there is no all-reduce figure though the node checked: a slow link, the budget
    error: str = ""  # the node's check failed as a whole

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Report:
        data = json.loads(text)
        return Report(rank=int(data["rank"]), host=str(data["host"]), address=str(data.get("address", "")),
                      rtt_ms={int(k): float(v) for k, v in data.get("rtt_ms", {}).items()},
                      gbit_s={int(k): float(v) for k, v in data.get("gbit_s", {}).items()},
                      errors={str(k): str(v) for k, v in data.get("errors", {}).items()},
                      allreduce_ms=data.get("allreduce_ms"), allreduce_skipped=str(data.get("allreduce_skipped", "")),
                      error=str(data.get("error", "")))


@dataclass(frozen=True)
class Verdict:
    line: str  # the one line for the job
    named: dict[int, str] = field(default_factory=dict)  # node rank in the round -> why it is named

    @property
    def ok(self) -> bool:
        return not self.named


def ring_shifts(world: int) -> tuple[int, ...]:
    """The rings measured in turn: to the next node, and with three nodes or more to the previous one too
    (between two nodes the first ring already measures both directions)."""
    return () if world < 2 else (1,) if world == 2 else (1, -1)


def links(world: int) -> list[tuple[int, int]]:
    return [(src, (src + shift) % world) for shift in ring_shifts(world) for src in range(world)]


def _who(rank: int, reports: Mapping[int, Report]) -> str:
    report = reports.get(rank)
    return f"node {rank} ({report.host})" if report is not None and report.host else f"node {rank}"


def verdict(reports: Mapping[int, Report], world: int, min_gbit_s: float = 0.0, interface: str = "") -> Verdict:
    """The job's verdict from every node's report (missing: the node did not finish). Every node computes
    the same one from the same reports."""
    named: dict[int, str] = {}
    missing = [rank for rank in range(world) if rank not in reports]
    for rank in missing:
        named[rank] = f"{_who(rank, reports)} did not finish the network check within {START_S + BUDGET_S:g} s"
    for rank, report in sorted(reports.items()):
        if report.error:
            named.setdefault(rank, f"{_who(rank, reports)}'s network check failed: {report.error}")
    if named:
        return Verdict(line="; ".join(named.values()), named=named)
    measured: dict[tuple[int, int], float] = {}
    for src, dst in links(world):
        # The sender could not connect: the destination is unreachable; the receiver saw nothing come: the source.
        for error, blamed in ((reports[src].errors.get(f"{src}>{dst}"), dst), (reports[dst].errors.get(f"{src}>{dst}"), src)):
            if error:
                named.setdefault(blamed, f"the link from {_who(src, reports)} to {_who(dst, reports)} failed: {error}")
        if f"{src}>{dst}" not in reports[src].errors and src in reports[dst].gbit_s:
            measured[(src, dst)] = reports[dst].gbit_s[src]
    if named:
        return Verdict(line="; ".join(named.values()), named=named)
    rtts = [ms for report in reports.values() for ms in report.rtt_ms.values()]
    slow = {link: gbit for link, gbit in measured.items() if min_gbit_s and gbit < min_gbit_s}
    if slow and len(slow) == len(measured) and len({node for link in slow for node in link}) > 2:  # not one pair
        line = (f"every link carries less than --min-bandwidth {min_gbit_s:g} Gbit/s ({min(slow.values()):.3g}-"
                f"{max(slow.values()):.3g}): the network is slower than the bound, not one node")
        return Verdict(line=line, named={rank: line for rank in range(world)})
    if slow:
        blamed = _blamed(slow, measured, world)
        for rank in sorted(blamed):
            worst = min((gbit, link) for link, gbit in slow.items() if rank in link)
            src, dst = worst[1]
            rtt = reports[src].rtt_ms.get(dst)
            named[rank] = (f"the link from {_who(src, reports)} to {_who(dst, reports)} carries {worst[0]:.3g} Gbit/s, below "
                           f"--min-bandwidth {min_gbit_s:g} Gbit/s" + (f" (round trip {rtt:.3g} ms)" if rtt is not None else "")
                           + f": {_who(rank, reports)} is named")
        return Verdict(line="; ".join(named.values()), named=named)
    allreduce = [r.allreduce_ms for r in reports.values() if r.allreduce_ms is not None]
    parts = [f"{world} nodes" + (f" over {interface}" if interface else "")]
    if measured:
        (src, dst), low = min(measured.items(), key=lambda item: item[1])
        parts.append(f"links {low:.3g}-{max(measured.values()):.3g} Gbit/s (slowest: node {src} to node {dst})")
    if rtts:
        parts.append(f"round trip {min(rtts):.3g}-{max(rtts):.3g} ms")
    skipped = sorted({r.allreduce_skipped for r in reports.values() if r.allreduce_skipped})
    if skipped:
        parts.append(f"no all-reduce of {ALLREDUCE_BYTES >> 20} MiB: {skipped[0]}")
    elif allreduce:
        parts.append(f"all-reduce of {ALLREDUCE_BYTES >> 20} MiB {max(allreduce):.3g} ms")
    if min_gbit_s:
        parts.append(f"every link above --min-bandwidth {min_gbit_s:g} Gbit/s")
    return Verdict(line="network: " + ", ".join(parts))


def _blamed(slow: Mapping[tuple[int, int], float], measured: Mapping[tuple[int, int], float], world: int) -> set[int]:
    """Who the slow links name: each node all of whose measured links are slow (its own side, both ways: a shaped
    node starves even what it receives of ACKs); else the one end every slow link shares; else each slow link's
    sender. The first rule comes first because a healthy link between two loaded hosts can measure below the bound
    on its own (its ends off the CPU for the stream's whole best window): beside a node whose every link is slow,
    that one link named every node of the job (seen with a 1 Mbit/s node under the test suite's load)."""
    # Measured links to at least two other nodes: a node whose only measured peer is the slow one (two nodes, or the
    # others not measured in the budget on a host under load) shares those links with that peer, and cannot be told
    # from it by this rule (CI named both ends).
    own = set()
    for rank in range(world):
        links = [link for link in measured if rank in link]
        if len({peer for link in links for peer in link} - {rank}) >= 2 and all(link in slow for link in links):
            own.add(rank)
    if own:
        return own
    ends = set.intersection(*({src, dst} for src, dst in slow))
    if len(ends) == 1:
        return ends
    if len(slow) == 2 and len(ends) == 2:  # both directions between the same two nodes: which side is slow?
        (slower, low), (_, high) = sorted(slow.items(), key=lambda item: item[1])
        if low * ASYMMETRY <= high:
            # A node whose sending side is slow carries its own stream at that rate; the reverse stream starves only
            # of its ACKs, which ask for a few percent of it (1 Mbit/s of ACKs carry some 40 Mbit/s): the far slower
            # direction's sender is named, not both (two nodes, or a round under load that measured no other link).
            return {slower[0]}
    return {src for src, _ in slow}


# --- the child: measuring ---

def _receive(listener: socket.socket, src: int, report: Report, deadline: float) -> None:
    """Serve one link's sender: echo its pings, then count its stream's last MEASURE_S."""
    try:
        listener.settimeout(max(0.1, deadline - time.monotonic()))
        conn, _ = listener.accept()
    except OSError as error:
        report.errors[f"{src}>{report.rank}"] = f"no connection from it within {WAIT_S:g} s ({error})"
        return
    with conn:
        try:
            conn.settimeout(WAIT_S)
            for _ in range(PINGS):
                conn.sendall(_recv_exactly(conn, 1))
            buffer = bytearray(CHUNK)
            _recv_into(conn, buffer)
            counting_from = time.monotonic() + WARM_S
            gbit_s = best_window_gbit_s(lambda: _recv_into(conn, buffer), counting_from)
            if gbit_s:
                report.gbit_s[src] = gbit_s
        except OSError as error:
            report.errors[f"{src}>{report.rank}"] = f"receiving: {error}"


def best_window_gbit_s(receive, counting_from: float, measure_s: float = MEASURE_S, window_s: float = WINDOW_S,
                      clock=time.monotonic) -> float:
    """Gbit/s of the best window of `window_s` in [counting_from, counting_from + measure_s), calling `receive()` (the
    bytes it received) until then; 0.0 when nothing was counted. Where no window of the stream was whole (a receive
    that took longer), the whole stream's figure."""
    best, window_bytes, window_start = 0.0, 0, counting_from
    while (now := clock()) < counting_from + measure_s:
        got = receive()
        now = clock()
        if now < counting_from:
            continue
        window_bytes += got
        if now - window_start >= window_s:
            best = max(best, window_bytes * 8 / (now - window_start) / 1e9)
            window_bytes, window_start = 0, now
    if not best and window_bytes and now > window_start:
        best = window_bytes * 8 / (now - window_start) / 1e9
    return best


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the sender closed the connection")
        data += chunk
    return data


def _recv_into(conn: socket.socket, buffer: bytearray) -> int:
    got = conn.recv_into(buffer)
    if not got:
        raise ConnectionError("the sender closed the connection early")
    return got


def _send(address: tuple[str, int], dst: int, report: Report) -> None:
    """Send one link's pings and stream, until the receiver has counted enough and closes."""
    try:
        with socket.create_connection(address, timeout=WAIT_S) as conn:
            times = []
            for _ in range(PINGS):
                began = time.perf_counter()
                conn.sendall(b"p")
                _recv_exactly(conn, 1)
                times.append((time.perf_counter() - began) * 1000)
            report.rtt_ms[dst] = statistics.median(times)
            payload = memoryview(bytes(CHUNK))
            deadline = time.monotonic() + WARM_S + MEASURE_S + WAIT_S
            try:
                while time.monotonic() < deadline:
                    conn.sendall(payload)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the receiver counted its window and closed: the end of a good stream
    except OSError as error:
        report.errors[f"{report.rank}>{dst}"] = f"cannot connect to {address[0]}:{address[1]}: {error}"


def _allreduce_ms(store, rank: int, world: int, interface: str, timeout_s: float = WAIT_S) -> float:
    import torch
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    device = dist.ProcessGroupGloo.create_device(interface=interface) if interface else \
        dist.ProcessGroupGloo.create_default_device()
    options._devices = [device]
    group = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world, options)
    tensor = torch.ones(ALLREDUCE_BYTES // 4)
    group.allreduce([tensor]).wait()  # the pairs connect on the first one
    began = time.perf_counter()
    for _ in range(ALLREDUCE_TIMES):
        group.allreduce([tensor]).wait()
    return (time.perf_counter() - began) * 1000 / ALLREDUCE_TIMES


def allreduce_s(gbit_s: float) -> float:
    """About how long the all-reduces take where the slowest link carries `gbit_s`: each sends the tensor and receives
    it (a ring's reduce-scatter and all-gather), once to connect and ALLREDUCE_TIMES measured."""
    return 2 * ALLREDUCE_BYTES * 8 * (1 + ALLREDUCE_TIMES) / (gbit_s * 1e9)


def why_no_allreduce(links: Mapping[int, Mapping], world: int, left_s: float) -> str:
    """'' to run the all-reduce, from what every node's rings measured (the same answer on every node that saw the
    same `links`: rank -> {"gbit_s": {src: Gbit/s}, "errors": [...]}); else why not. Over a link too slow for the time
    left it would outlast the check's budget, and the data gloo had queued would go on filling that link after its
    timeout (the kernel sends what a socket holds), starving the check's own store: every node's check ran late, and
    every node was named instead of the slow one (a 1 Mbit/s link)."""
    if len(links) < world:
        return "not every node's links were measured in time"
    if any(each.get("errors") for each in links.values()):
        return "a link failed"
    rates = [float(gbit) for each in links.values() for gbit in each.get("gbit_s", {}).values()]
    if not rates:
        return "no link was measured"
    slowest = min(rates)
    if allreduce_s(slowest) > left_s / 2:
        return (f"over the slowest link ({slowest:.3g} Gbit/s) it would take about {allreduce_s(slowest):.3g} s, "
                f"of the {max(left_s, 0):.3g} s the check had left")
    return ""


def timed_out(error: BaseException) -> bool:
    """gloo's own timeout of a send or a receive (its pairs had connected): the all-reduce was too slow for the time
    it had, which the rings explain (a slow link), not a failure of the node's check."""
    return "Timed out waiting" in str(error)


def _gather(store, keys: Sequence[str], deadline: float) -> dict[str, bytes]:
    """The keys that exist by `deadline` (a node that never sets its key is left out, not waited for forever)."""
    found: dict[str, bytes] = {}
    while True:
        for key in keys:
            if key not in found and store.check([key]):
                found[key] = store.get(key)
        if len(found) == len(keys) or time.monotonic() >= deadline:
            return found
        time.sleep(0.01)


def measure(store, rank: int, world: int, address: str, interface: str = "", budget_s: float = BUDGET_S,
            started: float | None = None, start_s: float = START_S) -> dict[int, Report]:
    """This node's part of the check, through `store` (the children's): the reports of every node that finished
    within `budget_s` (the others are missing: the verdict names them). `started`: time.monotonic() when this child
    started; the budget counts from the moment every child is ready, or `start_s` after that."""
    report = Report(rank=rank, host=socket.gethostname(), address=address)
    listener = socket.create_server((address, 0), family=socket.AF_INET6 if ":" in address else socket.AF_INET)
    with listener:
        store.set(f"address/{rank}", json.dumps([address, listener.getsockname()[1]]))
        found = _gather(store, [f"address/{other}" for other in range(world)], (started or time.monotonic()) + start_s)
        deadline = time.monotonic() + budget_s
        peers = {other: tuple(json.loads(found[f"address/{other}"])) for other in range(world) if f"address/{other}" in found}
        for shift in ring_shifts(world):
            dst, src = (rank + shift) % world, (rank - shift) % world
            receiver = None
            if src in peers:
                receiver = threading.Thread(target=_receive, args=(listener, src, report, min(deadline, time.monotonic() + WAIT_S)),
                                            daemon=True)
                receiver.start()
            if dst in peers:
                _send(peers[dst], dst, report)
            if receiver is not None:
                receiver.join()
            store.set(f"ring{shift}/{rank}", "1")  # the next ring starts when every node is done with this one
            _gather(store, [f"ring{shift}/{other}" for other in peers], deadline)
        store.set(f"links/{rank}", json.dumps({"gbit_s": report.gbit_s, "errors": sorted(report.errors)}))
        seen = _gather(store, [f"links/{other}" for other in peers], deadline)
    if len(peers) == world:
        # The all-reduce runs only where the rings say it can finish, and gets what is left of the budget, never more.
        left = deadline - time.monotonic() - ALLREDUCE_RESERVE_S
        skipped = why_no_allreduce({int(key.split("/")[1]): json.loads(raw) for key, raw in seen.items()}, world, left)
        try:
            if skipped:
                report = Report(**{**asdict(report), "allreduce_skipped": skipped})
            else:
                report = Report(**{**asdict(report), "allreduce_ms": _allreduce_ms(store, rank, world, interface, left)})
        except Exception as error:  # noqa: BLE001 - said in the verdict: gloo could not connect over the interface
            if timed_out(error):
                report = Report(**{**asdict(report), "allreduce_skipped": f"cut at the {left:.3g} s the check had left"})
            else:
                report = Report(**{**asdict(report), "error": f"gloo all-reduce over {interface or 'the default interface'}: "
                                                               f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"})
    store.set(f"report/{rank}", report.to_json())
    # Node 0's child says which reports count, and every node judges those: had each gathered its own until the
    # deadline, a report that came late to one node and in time to another would split their verdicts.
    if rank == 0:
        found = _gather(store, [f"report/{other}" for other in range(world)], deadline)
        store.set("reports", json.dumps({key: value.decode() for key, value in found.items()}))
    final = _gather(store, ["reports"], deadline + FINAL_S).get("reports")
    found = {key: value.encode() for key, value in json.loads(final).items()} if final else \
        _gather(store, [f"report/{other}" for other in range(world)], time.monotonic())  # node 0's child is gone
    store.set(f"done/{rank}", "1")
    if rank == 0:  # node 0's agent hosts the store: it stays until every child has read
        _gather(store, [f"done/{other}" for other in range(world)], deadline + FINAL_S + 2)
    return {other: Report.from_json(found[f"report/{other}"].decode()) for other in range(world) if f"report/{other}" in found}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainpod.agent.netcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="HOST:PORT of the TCPStore node 0's agent hosts")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--address", required=True, help="this node's address on the interface")
    parser.add_argument("--interface", default="")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the measuring, waits included")
    parser.add_argument("--start", type=float, default=START_S, help="seconds for every node's child to start")
    started = time.monotonic()  # before torch's import: START_S bounds this child's start too
    args = parser.parse_args(argv)
    from torch.distributed import TCPStore

    host, _, port = args.store.rpartition(":")
    store = TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timedelta(seconds=WAIT_S), wait_for_workers=False)
    reports = measure(store, args.rank, args.world, args.address, args.interface, args.budget, started, args.start)
    sys.stdout.write(json.dumps([json.loads(report.to_json()) for report in reports.values()]) + "\n")
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown with a gloo group alive (docs/shutdown.md)


# --- the agent's side ---

def address_of(interface: str) -> str | None:
    """This node's address on `interface` (the first of a comma-separated list): IPv4 first."""
    from trainpod.launcher import network

    addresses = network.interfaces().get(interface.split(",")[0].strip(), [])
    return next((a for a in addresses if ":" not in a), addresses[0] if addresses else None)


def check(round_store, rank: int, world: int, interface: str, min_gbit_s: float = 0.0,
          budget_s: float = BUDGET_S, start_s: float = START_S) -> Verdict:
    """This node's agent's part: node 0 hosts the children's store, every node runs its child and reads the
    reports. Bounded by about WAIT_S + CHILD_TIMEOUT_S (`budget_s`: the children's measuring, `start_s`: their start)."""
    interface = interface.split(",")[0].strip()
    address = address_of(interface) if interface else None
    host = socket.gethostname()
    if address is None:
        why = f"has no address on the interface {interface}" if interface else "has no chosen interface"
        return Verdict(line=f"node {rank} ({host}) {why}: no network check", named={rank: why})
    server = None
    try:
        if rank == 0:
            from torch.distributed import TCPStore

            from trainpod.topology import join_host_port

            server = TCPStore(address, 0, is_master=True, timeout=timedelta(seconds=CHILD_TIMEOUT_S), wait_for_workers=False)
            round_store.set(f"{KEY_PREFIX}store", join_host_port(address, server.port))
        try:
            round_store.wait([f"{KEY_PREFIX}store"], timedelta(seconds=WAIT_S))
            where = round_store.get(f"{KEY_PREFIX}store").decode()
        except Exception as error:  # noqa: BLE001 - torch's store errors have no common type across backends
            why = f"did not start the network check within {WAIT_S:g} s ({type(error).__name__})"
            return Verdict(line=f"node 0 {why}", named={0: why})
        command = [sys.executable, "-m", "trainpod.agent.netcheck", "--store", where, "--rank", str(rank),
                   "--world", str(world), "--address", address, "--interface", interface, "--budget", f"{budget_s:g}",
                   "--start", f"{start_s:g}"]
        limit = CHILD_TIMEOUT_S - BUDGET_S - START_S + budget_s + start_s
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=limit, check=False)
        except subprocess.TimeoutExpired:
            why = f"did not finish the network check within {limit:g} s"
            return Verdict(line=f"node {rank} ({host}) {why}", named={rank: why})
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            why = f"'s network check exited {done.returncode}: {(done.stderr.strip().splitlines() or ['no output'])[-1][:200]}"
            return Verdict(line=f"node {rank} ({host}){why}", named={rank: why})
        reports = {report.rank: report for report in (Report.from_json(json.dumps(item)) for item in json.loads(lines[-1]))}
        return verdict(reports, world, min_gbit_s, interface)
    finally:
        del server


if __name__ == "__main__":
    sys.exit(main())
