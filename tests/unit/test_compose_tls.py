"""compose/elastic's TLS profile (tls.yaml over compose.yaml), without starting it: what `docker compose
config` makes of it, and its certificates (make-certs.sh) in use by a real etcd and trainpod's preflight."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from trainpod.launcher import preflight
from trainpod.rendezvous.etcd_http import EtcdAccess
from trainpod.topology import Rendezvous, Topology

ELASTIC = Path(__file__).resolve().parents[2] / "compose" / "elastic"


def compose_config() -> dict:
    docker = shutil.which("docker")
    found = docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    if not found:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true but no `docker compose`: the compose files must be checked in CI", pytrace=False)
        pytest.skip("no `docker compose` CLI")
    result = subprocess.run([docker, "compose", "-f", str(ELASTIC / "compose.yaml"), "-f", str(ELASTIC / "tls.yaml"),
                             "--profile", "scale-up", "config", "--format", "json"], capture_output=True, text=True,
                            env={**os.environ, "TRAINPOD_RDZV_ENDPOINT": ""})  # (its default: the profile's)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_every_member_and_trainer_speaks_tls_with_the_volumes_certificates():
    services = compose_config()["services"]
    for name in ("etcd0", "etcd1", "etcd2"):
        env = services[name]["environment"]
        assert env["ETCD_NAME"] == name  # compose.yaml's, kept
        assert env["ETCD_ADVERTISE_CLIENT_URLS"] == f"https://{name}:2379" and env["ETCD_CLIENT_CERT_AUTH"] == "true"
        assert env["ETCD_INITIAL_CLUSTER"].count("https://") == 3 and env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true"
        assert services[name]["depends_on"]["etcd-certs"]["condition"] == "service_completed_successfully"
        assert "--cacert=/pki/ca.pem" in services[name]["healthcheck"]["test"]
    for name in ("trainer0", "trainer1", "trainer2", "trainer3"):
        trainer = services[name]
        endpoint = trainer["command"][trainer["command"].index("--rdzv-endpoint") + 1]
        assert endpoint == "https://etcd0:2379,https://etcd1:2379,https://etcd2:2379"
        assert {k: v for k, v in trainer["environment"].items() if k.startswith("TRAINPOD_ETCD_")} == {
            "TRAINPOD_ETCD_CACERT": "/pki/ca.pem", "TRAINPOD_ETCD_CERT": "/pki/trainer.pem",
            "TRAINPOD_ETCD_KEY": "/pki/trainer-key.pem"}
        assert {v["target"]: v.get("read_only", False) for v in trainer["volumes"]}["/pki"] is True
        assert set(trainer["depends_on"]) == {"etcd0", "etcd1", "etcd2"}  # compose.yaml's, kept


@pytest.mark.slow
def test_its_certificates_serve_a_real_etcd_and_the_trainers_preflight(tmp_path):
    """make-certs.sh (openssl), then one etcd member with them as the profile configures it (client and peer
    TLS, client certificates required) and trainpod's check with the trainers' files."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command")
    from fixtures.etcd import etcd_binary
    from fixtures.ports import free_port

    pki = tmp_path / "pki"
    subprocess.run(["bash", str(ELASTIC / "make-certs.sh")], env={**os.environ, "PKI_DIR": str(pki)}, check=True,
                   capture_output=True)
    assert not (pki / "ca-key.pem").exists()  # the CA's key is gone: nothing more can be signed with it
    client, peer = free_port(), free_port()
    env = {**os.environ, "ETCD_NAME": "etcd0", "ETCD_DATA_DIR": str(tmp_path / "data"),
           "ETCD_LISTEN_CLIENT_URLS": f"https://127.0.0.1:{client}", "ETCD_ADVERTISE_CLIENT_URLS": f"https://localhost:{client}",
           "ETCD_LISTEN_PEER_URLS": f"https://127.0.0.1:{peer}", "ETCD_INITIAL_ADVERTISE_PEER_URLS": f"https://127.0.0.1:{peer}",
           "ETCD_INITIAL_CLUSTER": f"etcd0=https://127.0.0.1:{peer}", "ETCD_CLIENT_CERT_AUTH": "true",
           "ETCD_PEER_CLIENT_CERT_AUTH": "true"}
    for prefix in ("", "PEER_"):
        env |= {f"ETCD_{prefix}CERT_FILE": str(pki / "etcd.pem"), f"ETCD_{prefix}KEY_FILE": str(pki / "etcd-key.pem"),
                f"ETCD_{prefix}TRUSTED_CA_FILE": str(pki / "ca.pem")}
    with open(tmp_path / "etcd.log", "wb") as log:
        server = subprocess.Popen([etcd_binary()], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        access = EtcdAccess(cacert=str(pki / "ca.pem"), cert=str(pki / "trainer.pem"), key=str(pki / "trainer-key.pem"))
        rdzv = Rendezvous(backend="etcd-v3", endpoint=f"https://localhost:{client}", id="trainpod-elastic", min_nodes=2,
                          max_nodes=4, access=access)
        topology = Topology(source="etcd", nnodes=4, node_rank=None, nproc_per_node=1, master_addr="localhost",
                            master_port=client, backend="gloo", interface="lo", rendezvous=rdzv)
        info = preflight.check_etcd(topology, 20, lambda line: None)
        assert info.version.startswith("3.")
    finally:
        server.terminate()
        server.wait(10)
