"""etcd_http: endpoint parsing, the v3 calls, and probe() against real etcd processes (no torch)."""

import http.server
import threading
import time

import pytest

from fixtures.etcd import SilentEndpoint, dead_endpoint
from trainpod.errors import EXIT_CONFIG, EXIT_UNAVAILABLE
from trainpod.rendezvous.etcd_http import (
    EtcdClient,
    EtcdInfo,
    EtcdResponseError,
    EtcdUnreachableError,
    parse_endpoints,
    probe,
)


@pytest.mark.parametrize("given,expected", [
    ("etcd:2379", ["etcd:2379"]),
    ("etcd", ["etcd:2379"]),
    ("http://10.0.0.1:4001", ["10.0.0.1:4001"]),
    ("a:1, b:2 ,c", ["a:1", "b:2", "c:2379"]),
    ("[::1]:2379", ["[::1]:2379"]),
    (["a:1", "b"], ["a:1", "b:2379"]),
    ("https://etcd1:2379,https://etcd2", ["https://etcd1:2379", "https://etcd2:2379"]),
    ("https://[::1]:2379", ["https://[::1]:2379"]),
])  # fmt: skip
def test_parse_endpoints(given, expected):
    assert parse_endpoints(given) == expected


@pytest.mark.parametrize("bad,match", [("", "expected host:port"), ("ftp://etcd:2379", "http:// or https://"),
                                       ("etcd:port", "host:port"), ("etcd:2379/v3", "host:port"), (" , ", "expected host:port"),
                                       ("etcd:0", "port from 1 to 65535"), ("etcd:70000", "port from 1 to 65535"),
                                       ("etcd:", "port from 1 to 65535"),
                                       ("a:1,https://b:2", "one scheme for all")])
def test_parse_endpoints_refuses_in_one_line(bad, match):
    with pytest.raises(ValueError, match=match) as refused:
        parse_endpoints(bad)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("secret", ["http://root:s3cret@etcd1:0", "root:s3cret@etcd1:2379", "https://u:p@a:1,https://b:2",
                                    "a:1,http://root:pa,ss@b:2"])
def test_a_password_in_the_url_is_refused_and_never_shown(secret):
    with pytest.raises(ValueError) as refused:
        parse_endpoints(secret)
    message = str(refused.value)
    assert "s3cret" not in message and ":p@" not in message and "pa,ss" not in message
    assert "--etcd-user" in message and "TRAINPOD_ETCD_PASSWORD_FILE" in message


def test_probe_without_v2(etcd):
    info = probe(etcd.endpoint, timeout=5)
    assert isinstance(info, EtcdInfo)
    assert info.endpoint == etcd.endpoint
    assert info.version.startswith("3.") and info.cluster_version.startswith("3.")
    assert info.v2_enabled is False


def test_probe_with_v2(etcd_v2):
    assert probe(etcd_v2.endpoint, timeout=5).v2_enabled is True


def test_probe_tries_the_next_endpoint(etcd):
    dead = dead_endpoint()
    info = probe(f"{dead},{etcd.endpoint}", timeout=5)
    assert info.endpoint == etcd.endpoint


def test_probe_of_unreachable_endpoints_names_each_within_the_timeout():
    dead = dead_endpoint()
    with SilentEndpoint() as silent:
        started = time.monotonic()
        with pytest.raises(EtcdUnreachableError) as raised:
            probe([dead, silent.endpoint], timeout=1)
        elapsed = time.monotonic() - started
    message = str(raised.value)
    assert f"{dead}: connection refused" in message and f"{silent.endpoint}: timed out after 1 s" in message
    assert "\n" not in message
    assert raised.value.exit_code == EXIT_UNAVAILABLE
    assert elapsed < 30  # each endpoint's 1 s, not a wait without end (the silent one never answers)


class _NotEtcd(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"<html>hello</html>"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_probe_of_something_that_is_not_etcd():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotEtcd)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(EtcdResponseError, match="is it etcd") as raised:
            probe(f"127.0.0.1:{server.server_address[1]}", timeout=2)
        assert raised.value.exit_code == EXIT_CONFIG
    finally:
        server.shutdown()
        server.server_close()


def test_client_get_put_cas(etcd):
    client = EtcdClient(etcd.endpoint, 5)
    key = f"/test/{time.monotonic_ns()}".encode()
    assert client.get(key) is None
    done, (value, rev) = client.cas(key, b"a", 0)
    assert done and value == b"a" and client.get(key) == (b"a", rev)
    assert client.cas(key, b"b", 0) == (False, (b"a", rev))  # 0: only if absent
    assert client.cas(key, b"b", rev)[0] is True
    newer = client.put(key, b"c")
    assert client.get(key) == (b"c", newer)


def test_client_errors_are_one_line_with_the_endpoint(etcd):
    client = EtcdClient(etcd.endpoint, 5)
    with pytest.raises(EtcdResponseError, match=f"etcd at {etcd.endpoint}: POST /v3/kv/nothing: HTTP 404"):
        client.call("/v3/kv/nothing", {})
    with pytest.raises(ValueError, match="timeout"):
        EtcdClient(etcd.endpoint, 0)
