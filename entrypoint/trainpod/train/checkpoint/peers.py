"""Peer copies, the rank's side (--peer-copies; the agent's side is trainpod.agent.peercopy).

The Checkpointer of a rank started under `trainpod run --peer-copies` finds every node's copy server in
PEER_COPIES_FILE, which its agent writes in the progress directory each round (by group rank: torch's
GROUP_RANK is this node's). Before each commit it sends the checkpoint to its own node's agent and to the
next node's (send()), in its writer thread: losing either node leaves a copy, and no node's memory is behind
a disk, so every rank that takes the newer of its disk and the peers' copies takes the same step. Before it
loads from its disk it asks every node which copy it holds (newest()) and fetches one newer than its disk's
newest, or as new where its node is new to the job (a joiner, a spare: its first step without reading the
shared disk) (fetch()), its size and sha256 checked against the manifest that came with it. A peer that does
not answer, or a copy that does not verify, is one line and the disk decides, as without peer copies: a copy
is a faster or a surviving way to the same checkpoint, never another one.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from trainpod.contract import (
    PEER_COPIES_FILE,
    PEER_COPY_MANIFEST_HEADER,
    PEER_COPY_PATH,
    PEER_DATA_PATH,
    PEER_JOB_HEADER,
    PEER_MANIFEST_PATH,
    PROGRESS_DIR_VAR,
)

CONNECT_TIMEOUT_S = 5.0  # a node gone (its host off, a partition) does not answer at all: the commit waits no longer
ASK_TIMEOUT_S = 5.0  # a peer's answer to "what do you hold"
TRANSFER_TIMEOUT_S = 60.0  # a socket silent this long in a transfer: the peer is gone
_BLOCK = 4 << 20


class PeerError(Exception):
    """A peer that does not answer as it should; the message is one line."""


@dataclass(frozen=True)
class Held:
    """A copy a peer holds: the node (its group rank), its server, the checkpoint's manifest."""

    node: int
    address: str
    manifest: dict

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class Peers:
    """Every node's copy server in this round (by group rank), this node's place among them, the job's run id."""

    def __init__(self, addresses: list[str], me: int, job: str, new_node: bool = False):
        self.addresses = list(addresses)
        self.me = me
        self.job = job
        self.new_node = new_node  # this node is new to the job: a copy in memory is taken over its disk's same step

    @staticmethod
    def from_env(environ=os.environ) -> Peers | None:
        """The peers this rank's agent wrote for its round; None without --peer-copies (or outside `trainpod run`)."""
        directory = environ.get(PROGRESS_DIR_VAR, "")
        if not directory:
            return None
        try:
            with open(os.path.join(directory, PEER_COPIES_FILE), "rb") as f:
                shared = json.loads(f.read())
            addresses, new_node = [str(a) for a in shared["addresses"]], shared.get("new_node") is True
            me = int(environ.get("GROUP_RANK", "0"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError):
            return None  # not the agent's: no peer copies rather than a rank that cannot start
        return Peers(addresses, me, environ.get("TORCHELASTIC_RUN_ID", ""), new_node)

    def successor(self) -> str | None:
        """The next node of the ring; None alone."""
        if len(self.addresses) < 2 or not 0 <= self.me < len(self.addresses):
            return None
        return self.addresses[(self.me + 1) % len(self.addresses)]

    def targets(self) -> list[str]:
        """Where this node's checkpoints go: its own agent and the next node's, so that losing either node leaves
        one copy (a writer's node lost: the next node has it; the next node lost: the writer's own agent)."""
        own = [self.addresses[self.me]] if 0 <= self.me < len(self.addresses) else []
        return own + [a for a in [self.successor()] if a is not None and a not in own]

    @contextlib.contextmanager
    def _talk(self, address: str, timeout: float) -> Iterator[http.client.HTTPConnection]:
        """A connection to `address`, made within CONNECT_TIMEOUT_S, then `timeout` for each read and write; closed after
        (OSError where it fails)."""
        host, port = _split(address)
        connection = http.client.HTTPConnection(host, port, timeout=CONNECT_TIMEOUT_S, blocksize=_BLOCK)  # not 8 KiB a write
        try:
            connection.connect()
            connection.sock.settimeout(timeout)
            yield connection
        finally:
            connection.close()

    def send(self, manifest: dict, path: Path) -> list[str]:
        """PUT the checkpoint at `path` (described by `manifest`) to every target (targets()); their addresses.
        PeerError naming each one that did not take it."""
        targets = self.targets()

        def put(address: str) -> str | None:
            try:
                self._put(address, manifest, path)
            except PeerError as error:
                return str(error)
            return None

        with ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:  # both at once: the file is read from the cache
            failed = [error for error in pool.map(put, targets) if error is not None]
        if failed:
            raise PeerError("; ".join(failed))
        return targets

    def _put(self, address: str, manifest: dict, path: Path) -> None:
        try:
            with self._talk(address, TRANSFER_TIMEOUT_S) as connection, open(path, "rb") as f:
                connection.request("PUT", PEER_COPY_PATH, body=f, headers={
                    "Content-Length": str(os.fstat(f.fileno()).st_size), PEER_JOB_HEADER: self.job,
                    PEER_COPY_MANIFEST_HEADER: json.dumps(manifest, separators=(",", ":"))})
                response = connection.getresponse()
                said = response.read().decode(errors="replace").strip()
        except OSError as error:
            raise PeerError(f"{address}: {error.strerror or error}") from None
        if response.status != 204:
            raise PeerError(f"{address} answered {response.status}: {said[:200]}")

    def _ask(self, node: int) -> Held | None:
        address = self.addresses[node]
        try:
            with self._talk(address, ASK_TIMEOUT_S) as connection:
                connection.request("GET", PEER_MANIFEST_PATH, headers={PEER_JOB_HEADER: self.job})
                response = connection.getresponse()
                body = response.read()
        except OSError:
            return None  # a node gone: the others may hold it
        if response.status != 200:
            return None
        try:
            manifest = json.loads(body)
            held = Held(node, address, manifest)
            held.step  # noqa: B018 - a manifest without a step is no copy
        except (ValueError, KeyError, TypeError):
            return None
        return held

    def newest(self) -> Held | None:
        """The newest copy any node holds (asked all at once), this node's own where it holds that one too; or None."""
        with ThreadPoolExecutor(max_workers=min(16, max(1, len(self.addresses)))) as pool:
            found = [held for held in pool.map(self._ask, range(len(self.addresses))) if held is not None]
        return max(found, key=lambda held: (held.step, held.node == self.me), default=None)

    def fetch(self, held: Held) -> bytearray:
        """The bytes of `held`, checked against its manifest (size and sha256); PeerError otherwise."""
        size = int(held.manifest["size"])
        try:
            with self._talk(held.address, TRANSFER_TIMEOUT_S) as connection:
                connection.request("GET", f"{PEER_DATA_PATH}?step={held.step}", headers={PEER_JOB_HEADER: self.job})
                response = connection.getresponse()
                if response.status != 200:
                    raise PeerError(f"{held.address} answered {response.status}: "
                                    f"{response.read().decode(errors='replace').strip()[:200]}")
                data = bytearray(size)
                view, got = memoryview(data), 0
                while got < size and (n := response.readinto(view[got : got + _BLOCK])):
                    got += n
                extra = response.read(1)
        except OSError as error:
            raise PeerError(f"{held.address}: {error.strerror or error}") from None
        if got != size or extra:
            sent = f"{got} bytes" if got != size else f"more than {size} bytes"
            raise PeerError(f"{held.address} sent {sent} of step {held.step}, its manifest says {size}")
        if hashlib.sha256(data).hexdigest() != held.manifest["sha256"]:
            raise PeerError(f"{held.address} sent step {held.step} with another sha256 than its manifest's")
        return data
