"""compose/elastic's TLS profile on the real engine (compose/elastic/tls.yaml over compose.yaml): three etcd
members that require client certificates (and TLS between themselves), certificates made by the one-shot
etcd-certs service; two trainers meet over https:// with their certificate (etcd-v3) and finish with 0.
A trainer that speaks plain http to the same members ends at once with 78 and one line (never 69: no
retry mends it). The host-side cases (wrong CA, no certificate, users and passwords, torch's etcd
backend) are tests/unit/rendezvous/test_etcd_access.py, against a real etcd started by the test."""

from __future__ import annotations

import re
import uuid

import pytest

from fixtures.docker_env import REPO, ComposeJob

pytestmark = [pytest.mark.docker, pytest.mark.slow]

COMPOSE = REPO / "compose" / "elastic" / "compose.yaml"
TLS = REPO / "compose" / "elastic" / "tls.yaml"
ETCD = ("etcd0", "etcd1", "etcd2")
ARGS = "--epochs 1 --synthetic-samples 256 --batch-size 16 --log-every 1 --checkpoint-every 4"


def test_trainers_meet_over_tls_with_client_certificates_and_plain_http_is_one_line_78(docker_ready):
    rdzv_id = f"tls-{uuid.uuid4().hex[:6]}"
    cluster = ComposeJob(COMPOSE, overrides=(TLS,), env={
        "TRAINPOD_RDZV_ID": rdzv_id, "TRAINPOD_NNODES": "2:3",
        "TRAINPOD_EXAMPLE": "cifar10-ddp", "TRAINPOD_EXAMPLE_ARGS": ARGS})
    try:
        cluster.compose("build", "etcd0", timeout=900)
        cluster.compose("up", "-d", "--no-build", "--wait", *ETCD, timeout=180)
        cluster.compose("up", "-d", "--no-build", "--no-deps", "trainer0", "trainer1")
        codes = cluster.wait("trainer0", "trainer1", timeout=600)
        logs = {name: cluster.logs(name) for name in ("trainer0", "trainer1")}
        both = logs["trainer0"][-3000:] + logs["trainer1"][-3000:]
        assert codes == {"trainer0": 0, "trainer1": 0}, both
        assert re.search(r"etcd-v3 rendezvous \S+ at https://etcd0:2379,https://etcd1:2379,https://etcd2:2379", both), both
        assert re.search(r"\[node\S* rank0\] \S+: world 2, backend ", both), both  # one world of both nodes

        # The trainers' command takes the endpoint from the compose file's interpolation (the host's variable);
        # the certificates are emptied in the container: a trainer configured for plain http, as by mistake.
        plain_http = ComposeJob(COMPOSE, overrides=(TLS,), project=cluster.project, env={
            **cluster.env, "TRAINPOD_RDZV_ID": f"{rdzv_id}-plain",
            "TRAINPOD_RDZV_ENDPOINT": "http://etcd0:2379,http://etcd1:2379,http://etcd2:2379"})
        plain = plain_http.compose("run", "--rm", "--no-deps", "-e", "TRAINPOD_ETCD_CACERT=", "-e", "TRAINPOD_ETCD_CERT=",
                                   "-e", "TRAINPOD_ETCD_KEY=", "trainer2", check=False, timeout=180)
        output = plain.stdout + plain.stderr
        assert plain.returncode == 78, output[-3000:]
        errors = [line for line in output.splitlines() if "error:" in line]
        assert len(errors) == 1 and "https://" in errors[0], output[-3000:]
        assert "Traceback" not in output
    finally:
        cluster.down()
