"""Nodes left out of an elastic job stay out: the exclusions, kept in the job's rendezvous store.

A node leaves an elastic job on its own decision (trainpod.agent.policy): its ranks failed the same
way twice, or on their own until --max-restarts was spent, or a check named it (--netcheck,
--devcheck). Its agent then exits, and supervisord starts nothing. But an orchestrator may: a
Kubernetes pod with restartPolicy OnFailure, a PyTorchJob's elastic policy, a compose service with
`restart: on-failure`, an operator's `docker start`. The node would join the next round, make every
other node restart its worker group to admit it (torch restarts the workers whenever a node waits),
and fail again: each return costs the whole job a restart and a rendezvous, without end.

So before it leaves, the agent writes an exclusion into the job's store (job_store(): the store
that outlives the rounds, under the run's id), and every agent looks there before its first
rendezvous: a node that finds itself excluded while the run has live nodes (run_is_live()) ends
with the code it left with and one line, and never joins. The others never see it. Where no node is
left (every node left: a script that fails alike everywhere), the run is over though nobody closed
it, and whoever starts the job again under the same id starts afresh in it.

A node is its host name (a restarted container or pod keeps it) and its kernel's boot id
(/proc/sys/kernel/random/boot_id, one per booted host, the same in every container on it): a pod
rescheduled on another host, or a host rebooted after a repair, is another node and joins. An
exclusion lasts as long as the run's store: c10d's lives in the agent that hosts it (the job's end
takes it); etcd-v3's keys expire with their lease (the rendezvous' `ttl`); torch's etcd backend's
with the run's directory (its TTL, two hours after the last node). A new --rdzv-id starts clean.

Records are JSON, read as data, whoever wrote them; a record that does not parse is reported and
skipped. Reading and writing are best effort: a store that does not answer costs a warning, never
the job (the node is then not kept out; its failures leave it again).
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

COUNT_KEY = "trainpod/excluded/count"  # how many records so far (Store.add: atomic on every backend)
RECORD_KEY = "trainpod/excluded/{}"  # + 1, 2, ...: one record each
MAX_RECORDS = 1000  # read at most: each is one request to the store, before the first rendezvous
ETCD_PATH = "/trainpod"  # torch's etcd backend: under the run's directory, whose TTL the agents renew
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class Node:
    """What makes a node the same node again: its host name and its kernel's boot (the module docstring)."""

    host: str
    boot: str

    @classmethod
    def this(cls) -> Node:
        try:
            boot = BOOT_ID.read_text().strip()
        except OSError:
            boot = ""
        return cls(socket.gethostname(), boot)


@dataclass(frozen=True)
class Exclusion:
    host: str
    boot: str
    code: int  # what the node exited with when it left
    line: str  # the line it left with
    at: float  # unix time

    @classmethod
    def of(cls, node: Node, code: int, line: str) -> Exclusion:
        return cls(node.host, node.boot, int(code), line, time.time())

    def names(self, node: Node) -> bool:
        return (self.host, self.boot) == (node.host, node.boot)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Exclusion:
        """Raises ValueError for anything but a record of the fields' types."""
        try:
            data = json.loads(text)
            record = cls(host=data["host"], boot=data["boot"], code=data["code"], line=data["line"], at=data["at"])
        except (TypeError, KeyError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"not an exclusion record ({type(error).__name__}: {error})") from None
        kinds = {"host": str, "boot": str, "code": int, "line": str, "at": (int, float)}
        wrong = [name for name, kind in kinds.items() if not isinstance(getattr(record, name), kind)]
        if wrong:
            raise ValueError(f"not an exclusion record (field {wrong[0]}: {getattr(record, wrong[0])!r})")
        # Its text goes into one log line (describe()): a record with a control character is not one of ours.
        broken = [name for name in ("host", "boot", "line") if not getattr(record, name).isprintable()]
        if broken:
            raise ValueError(f"not an exclusion record (field {broken[0]} holds a control character)")
        return record

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.at))
        return f"{self.host} (boot {self.boot[:8] or '?'}), since {when}, exit {self.code}: {self.line}"


def job_store(handler):
    """The store of the whole run, not of one round: torch's dynamic rendezvous' (c10d: the TCPStore; trainpod's
    etcd-v3: its EtcdV3Store), or one under the run's directory of torch's etcd backend. None for another handler."""
    store = getattr(handler, "_store", None)
    if store is not None:
        return store
    impl = getattr(handler, "_rdzv_impl", None)  # torch's EtcdRendezvousHandler (the v2 API)
    if impl is not None and hasattr(impl, "client") and hasattr(impl, "get_path"):
        from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

        return EtcdStore(impl.client, impl.get_path(ETCD_PATH))
    return None


def run_is_live(handler) -> bool:
    """Whether some node is in the run's rendezvous now (its heartbeat or keep-alive current). An exclusion holds only
    then: where every node left (a script that fails alike everywhere makes each leave), nobody closed the rendezvous,
    and the job started again under the same id meets in it: its nodes are a new start, not the old one's returns.
    True where the backend cannot tell (another handler): the exclusion then holds."""
    holder = getattr(handler, "_state_holder", None)
    if holder is not None:  # torch's dynamic rendezvous (c10d, etcd-v3): sync() drops the nodes whose heartbeat lapsed
        holder.sync()
        return bool(holder.state.last_heartbeats)
    impl = getattr(handler, "_rdzv_impl", None)
    if impl is None or not hasattr(impl, "get_rdzv_state"):
        return True
    import etcd  # python-etcd, torch's etcd backend's client

    try:
        _, state = impl.get_rdzv_state()
    except etcd.EtcdKeyNotFound:
        return False  # no round in the run, not even one forming
    if state.get("status") != "final":
        return True  # a round is forming: its nodes are there
    for key in state.get("keep_alives", []):  # each participant's key, under a TTL it renews while it lives
        try:
            impl.client.get(key)
            return True
        except etcd.EtcdKeyNotFound:
            continue
    return False


def record(store, exclusion: Exclusion) -> None:
    """Add `exclusion` to the run's records."""
    number = store.add(COUNT_KEY, 1)
    store.set(RECORD_KEY.format(number), exclusion.to_json())


def read(store, warn=lambda line: None) -> list[Exclusion]:
    """Every record of the run, oldest first; one that does not parse is said through `warn` and skipped, one
    counted but not yet written (its writer between add and set) is not there yet."""
    if not store.check([COUNT_KEY]):
        return []
    count = int(store.get(COUNT_KEY))
    if count > MAX_RECORDS:  # a run's nodes leave one at a time: this many is a key someone else wrote
        warn(f"the run's exclusion count {COUNT_KEY} says {count}: only the first {MAX_RECORDS} records were read")
    found = []
    for number in range(1, min(count, MAX_RECORDS) + 1):
        key = RECORD_KEY.format(number)
        if not store.check([key]):
            continue
        try:
            found.append(Exclusion.from_json(store.get(key)))
        except ValueError as error:
            warn(f"the run's exclusion record {key} was skipped: {error}")
    return found


def of(node: Node, records: list[Exclusion]) -> Exclusion | None:
    """The newest record that names `node`."""
    return next((each for each in reversed(records) if each.names(node)), None)
