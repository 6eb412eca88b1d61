"""--peer-copies, the agent's side: this node's memory holds the job's newest checkpoint, sent by another node.

A node's disk may go with the node: a node-local --checkpoint-dir, a volume that dies with its host. With
--peer-copies the rank that writes a checkpoint (trainpod.train.checkpoint) also sends it, in the background and
before its commit, to its own node's agent and to the agent of the next node of the round (group rank + 1, a
ring), which keep the newest one in their memory. A rank that
finds no checkpoint on its disk as new as a peer's restores from that peer over the network instead
(trainpod.train.checkpoint.peers): the survivor whose disk did not have it, the spare or the new node that replaces a
lost one. The agent holds the copy, not a rank: the agent outlives its ranks' restarts, and a membership change
restarts them.

Each agent serves HTTP on the job's interface (a port the kernel picks), publishes that address in every round's
store (exchange()) and gives the ranks everyone's, by group rank, in PEER_COPIES_FILE (share()). It keeps one copy, the newest:
accepted only for this job's run id, only whole (the size its manifest gives) and only if its step is not older
than the one held. The copy is bytes, never unpickled or hashed here (an agent's CPU is its ranks'): the rank that
fetches it checks its sha256 against the manifest and loads it as it loads a file (weights only, unless the job
trusts its checkpoints).
"""

from __future__ import annotations

import json
import re
import socket
import threading
import urllib.parse
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from trainpod.atomic import write_bytes_atomic
from trainpod.contract import (
    PEER_COPIES_FILE,
    PEER_COPY_MANIFEST_HEADER,
    PEER_COPY_PATH,
    PEER_DATA_PATH,
    PEER_JOB_HEADER,
    PEER_MANIFEST_PATH,
)
from trainpod.topology import join_host_port

KEY_PREFIX = "trainpod/peer-copy/"  # in the round's store: each node's copy server, by group rank
_READ_BLOCK = 4 << 20


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, address: str, job: str):
        self.address_family = socket.AF_INET6 if ":" in address else socket.AF_INET
        super().__init__((address, 0), _Handler)
        self.job = job
        self.lock = threading.Lock()
        self.manifest: dict | None = None
        self.data = bytearray()

    def handle_error(self, request, client_address) -> None:
        """A request that broke off (a sender gone, a peer's garbage) is the requester's to report: no traceback in the
        job's log."""
        return


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args) -> None:  # noqa: A002 - a request is no line in the job's log
        return

    def _answer(self, code: int, body: bytes = b"", kind: str = "text/plain") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _same_job(self) -> bool:
        if self.headers.get(PEER_JOB_HEADER) == self.server.job:
            return True
        self._answer(409, f"this node holds copies for the job {self.server.job!r} only\n".encode())
        return False

    def do_PUT(self) -> None:  # noqa: N802 - http.server's name
        if urllib.parse.urlsplit(self.path).path != PEER_COPY_PATH:
            return self._answer(404)
        try:
            size = int(self.headers.get("Content-Length", ""))
            manifest = json.loads(self.headers.get(PEER_COPY_MANIFEST_HEADER, ""))
            step, expected, digest = int(manifest["step"]), int(manifest["size"]), str(manifest["sha256"])
        except (ValueError, KeyError, TypeError):
            self.close_connection = True
            return self._answer(400, b"expected Content-Length and a checkpoint manifest\n")
        if not self._same_job():
            self.close_connection = True
            return None
        if size != expected or size < 0:
            self.close_connection = True
            return self._answer(400, f"the manifest says {expected} bytes, the request {size}\n".encode())
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            self.close_connection = True
            return self._answer(400, b"expected a sha256 in the manifest\n")
        try:
            data = bytearray(size)
        except MemoryError:
            self.close_connection = True
            return self._answer(413, f"no memory for {size} bytes on this node\n".encode())
        view, got = memoryview(data), 0
        while got < size:
            n = self.rfile.readinto(view[got : got + _READ_BLOCK])
            if not n:
                return None  # the sender went away: nothing kept
            got += n
        with self.server.lock:
            held = self.server.manifest
            if held is not None and int(held["step"]) > step:
                return self._answer(409, f"this node holds the newer step {held['step']}\n".encode())
            self.server.manifest, self.server.data = manifest, data
        return self._answer(204)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urllib.parse.urlsplit(self.path)
        if url.path not in (PEER_MANIFEST_PATH, PEER_DATA_PATH):
            return self._answer(404)
        if not self._same_job():
            return None
        with self.server.lock:
            manifest, data = self.server.manifest, self.server.data
        if manifest is None:
            return self._answer(404, b"no copy held\n")
        if url.path == PEER_MANIFEST_PATH:
            return self._answer(200, json.dumps(manifest).encode(), "application/json")
        asked = urllib.parse.parse_qs(url.query).get("step", [""])[0]
        if asked != str(manifest["step"]):
            return self._answer(409, f"this node now holds step {manifest['step']}\n".encode())
        return self._answer(200, data, "application/octet-stream")


class CopyServer:
    """The job's newest checkpoint, in this agent's memory, served over HTTP on `address` (a port the kernel picks)."""

    def __init__(self, address: str, job: str):
        self._server = _Server(address, job)
        self.address = join_host_port(address, self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="trainpod-peer-copies", daemon=True)
        self._thread.start()

    def held(self) -> dict | None:
        """The manifest of the copy held, or None."""
        with self._server.lock:
            return self._server.manifest

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def exchange(store, group_rank: int, world: int, address: str) -> list[str]:
    """Every node's copy server in this round, by group rank: each node publishes its own and reads the others'
    (a blocking get: they publish right after the same rendezvous)."""
    store.set(f"{KEY_PREFIX}{group_rank}", address)
    return [store.get(f"{KEY_PREFIX}{rank}").decode() for rank in range(world)]


def share(progress_dir: str, addresses: Sequence[str], new: bool = False) -> None:
    """Tell this round's ranks every node's copy server (PEER_COPIES_FILE in the progress directory), before they start,
    and whether their node is new to the job (trainpod.train.checkpoint.peers: it restores from memory first)."""
    text = json.dumps({"addresses": list(addresses), "new_node": bool(new)})
    write_bytes_atomic(Path(progress_dir) / PEER_COPIES_FILE, text.encode())
