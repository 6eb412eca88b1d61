"""A raw TCP stream between two hosts: the ceiling a collective over that link can reach.

    python tcp_stream.py serve PORT            (prints the received throughput as JSON)
    python tcp_stream.py send HOST PORT MB
"""

import json
import socket
import sys
import time

CHUNK = 4 * 2**20


def serve(port: int) -> None:
    with socket.create_server(("", port)) as server:
        connection, _ = server.accept()
        with connection:
            buffer = bytearray(CHUNK)
            received, started = 0, None
            while True:
                n = connection.recv_into(buffer)
                if not n:
                    break
                if started is None:
                    started = time.perf_counter()
                received += n
            seconds = time.perf_counter() - started
    print("bench-tcp: " + json.dumps({"bytes": received, "seconds": seconds, "bytes_per_s": received / seconds}), flush=True)


def send(host: str, port: int, megabytes: int) -> None:
    payload = b"\0" * CHUNK
    deadline = time.monotonic() + 30
    while True:
        try:
            connection = socket.create_connection((host, port))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with connection:
        for _ in range(megabytes * 2**20 // CHUNK):
            connection.sendall(payload)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
