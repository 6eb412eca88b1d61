"""etcd as production runs it, for real: client-certificate TLS, RBAC users (v3), the v2 API's own users.

Each etcd is Debian's etcd-server started here (fixtures.etcd), its certificates made here (fixtures.tls).
The right credentials: trainpod's preflight passes and a rendezvous forms, through the code a job runs
(torch's handler registry -> trainpod's etcd-v3 backend; torch's etcd backend, python-etcd, with the
agent's wrapper for its user). The wrong or missing ones: one line, 78, naming the endpoint, at once.
"""

from __future__ import annotations

import time
import types
import uuid

import pytest

from fixtures.etcd import EtcdProcess, enable_v2_auth, enable_v3_auth, meet
from fixtures.tls import make_pki
from trainpod.errors import ConfigError, TrainpodError
from trainpod.launcher import preflight
from trainpod.rendezvous.etcd_http import EtcdAccess, EtcdClient, probe
from trainpod.topology import Rendezvous, Topology


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def etcd_tls(tmp_path_factory, pki):
    """TLS on the client port, a client certificate required (--client-cert-auth), the v2 API on."""
    with EtcdProcess(tmp_path_factory.mktemp("etcd-tls"), enable_v2=True, tls=pki) as server:
        yield server


@pytest.fixture(scope="module")
def etcd_rbac(tmp_path_factory):
    """v3 authentication on: alice may read and write /trainpod/, bob nothing."""
    with EtcdProcess(tmp_path_factory.mktemp("etcd-rbac")) as server:
        enable_v3_auth(server, {"alice": ("alice-pw", "/trainpod/"), "bob": ("bob-pw", None)})
        yield server


@pytest.fixture(scope="module")
def etcd_v2_auth(tmp_path_factory):
    """The v2 API on with its own authentication: alice may read and write /torchelastic/; v3's is off."""
    with EtcdProcess(tmp_path_factory.mktemp("etcd-v2-auth"), enable_v2=True) as server:
        enable_v2_auth(server, {"alice": ("alice-pw", "/torchelastic/")})
        yield server


@pytest.fixture
def passwords(tmp_path):
    files = {}
    for name, text in (("alice", "alice-pw\n"), ("wrong", "not-it"), ("bob", "bob-pw")):
        files[name] = tmp_path / name
        files[name].write_text(text)
    return {k: str(v) for k, v in files.items()}


def topology(backend: str, endpoint: str, access: EtcdAccess | None = None) -> Topology:
    rdzv = Rendezvous(backend=backend, endpoint=endpoint, id=f"team@2Fa-{uuid.uuid4().hex[:6]}", min_nodes=1, max_nodes=2,
                      access=access or EtcdAccess())
    return Topology(source="etcd", nnodes=2, node_rank=None, nproc_per_node=1, master_addr="127.0.0.1", master_port=2379,
                    backend="gloo", interface="lo", rendezvous=rdzv, origins={"rdzv_endpoint": "--rdzv-endpoint"})


def refused(top: Topology) -> str:
    started = time.monotonic()
    with pytest.raises(TrainpodError) as caught:
        preflight.check_etcd(top, 30, lambda line: None)
    line = str(caught.value)
    assert caught.value.exit_code == 78 and isinstance(caught.value, ConfigError)  # never 69, never retried:
    assert time.monotonic() - started < 10  # at once, not after --connect-timeout
    assert "\n" not in line and top.rdzv.endpoint.rpartition("://")[2] in line
    return line


def tls(pki, **changes) -> EtcdAccess:
    files = {"cacert": pki.ca, "cert": pki.client_cert, "key": pki.client_key, **changes}
    return EtcdAccess(**{k: v for k, v in files.items() if v})


# --- what travels to the agent: files and the user, never the password -------------------------------


@pytest.mark.parametrize("backend", ["etcd-v3", "etcd"])
def test_the_launch_plan_and_the_job_spec_carry_the_files_and_the_user_never_the_password(backend, pki, tmp_path):
    from trainpod.launcher.launch import build_plan
    from trainpod.runspec import RunSpec, Target

    secret = tmp_path / "secret"
    secret.write_text("s3cret-in-a-file")
    access = EtcdAccess(cacert=pki.ca, cert=pki.client_cert, key=pki.client_key, user="alice", password_file=str(secret))
    top = topology(backend, "https://etcd0:2379", access)
    plan = build_plan(RunSpec(topology=top, target=Target(command=("true",))), {"TRAINPOD_ETCD_PASSWORD": "s3cret-in-a-variable"})
    argv = plan.argv
    conf = dict(item.split("=", 1) for item in argv[argv.index("--rdzv-conf") + 1].split(","))
    assert {k: conf[k] for k in ("cacert", "cert", "key")} == {"cacert": pki.ca, "cert": pki.client_cert, "key": pki.client_key}
    endpoint = argv[argv.index("--rdzv-endpoint") + 1]
    if backend == "etcd":  # torch's etcd backend takes host:port, and the scheme as protocol=https
        assert endpoint == "etcd0:2379" and conf["protocol"] == "https"
    else:
        assert endpoint == "https://etcd0:2379" and "protocol" not in conf
    assert plan.env["TRAINPOD_ETCD_USER"] == "alice" and plan.env["TRAINPOD_ETCD_PASSWORD_FILE"] == str(secret)
    assert "etcd0" in plan.env["NO_PROXY"].split(",")
    spec = RunSpec(topology=top, target=Target(command=("true",)), connect_timeout=5, term_grace=25, max_restarts=0)
    shown = " ".join(argv) + repr(plan.env) + spec.to_json() + repr(top)
    assert "s3cret" not in shown
    assert RunSpec.from_json(spec.to_json()).topology.rdzv.access == access  # what the job hands the agent


def test_the_agent_rebuilds_the_same_access():
    from trainpod import settings
    from trainpod.rendezvous.etcd_http import PASSWORD_VAR

    assert settings.ETCD_PASSWORD.var == PASSWORD_VAR  # one variable, read by the outer run and by the agent
    conf = {"cacert": "/p/ca.pem", "cert": "/p/c.pem", "key": "/p/k.pem", "join_timeout": "30"}
    assert EtcdAccess.from_env(conf, {"TRAINPOD_ETCD_USER": "alice", "TRAINPOD_ETCD_PASSWORD_FILE": "/s"}) == EtcdAccess(
        cacert="/p/ca.pem", cert="/p/c.pem", key="/p/k.pem", user="alice", password_file="/s")
    assert EtcdAccess.from_env({}, {"TRAINPOD_ETCD_USER": "alice", "TRAINPOD_ETCD_PASSWORD": "x"}).password_var == \
        "TRAINPOD_ETCD_PASSWORD"
    assert EtcdAccess.from_env({}, {}) == EtcdAccess()


@pytest.mark.parametrize("flags,env,code,says", [
    ({"etcd_cacert": "CA"}, {}, 64, "--etcd-cacert: TLS needs https:// endpoints"),
    ({"rdzv_endpoint": "https://e:2379", "etcd_cert": "CERT"}, {}, 64, "give --etcd-key too"),
    ({"rdzv_endpoint": "https://e:2379"}, {"TRAINPOD_ETCD_KEY": "KEY"}, 78, "TRAINPOD_ETCD_KEY: a client certificate needs"),
    ({"rdzv_endpoint": "https://e:2379", "etcd_cacert": "/nonexistent"}, {}, 64, "--etcd-cacert='/nonexistent': expected a file"),
    ({"rdzv_endpoint": "https://e:2379", "etcd_cacert": "NOT_PEM"}, {}, 78, "expected a PEM certificate"),
    ({"rdzv_endpoint": "https://e:2379", "etcd_cert": "CERT", "etcd_key": "OTHER_KEY"}, {}, 78, "KEY_VALUES_MISMATCH"),
    ({"etcd_user": "alice"}, {}, 64, "--etcd-user='alice': its password is missing"),
    ({"etcd_user": "alice:pw"}, {"TRAINPOD_ETCD_PASSWORD": "x"}, 64, "without ':'"),
    ({}, {"TRAINPOD_ETCD_PASSWORD": "s3cret"}, 78, "TRAINPOD_ETCD_PASSWORD: an etcd password, and no user"),
    ({"etcd_user": "alice"}, {"TRAINPOD_ETCD_PASSWORD": "s3\ncret"}, 78, "without control characters"),
    ({"etcd_user": "alice"}, {"TRAINPOD_ETCD_PASSWORD_FILE": "EMPTY"}, 78, "found it empty"),
    ({"etcd_user": "alice"}, {"TRAINPOD_ETCD_PASSWORD_FILE": "SECRET", "TRAINPOD_ETCD_PASSWORD": "s3cret"}, 78,
     "keep one of them"),
    ({"rdzv_endpoint": "http://root:s3cret@e:0"}, {}, 64, "a user name or password in the endpoint URL is refused"),
    ({"rdzv_backend": "c10d", "rdzv_endpoint": "root:s3cret@h:29400"}, {}, 64, "without a scheme, user name or password"),
    ({"rdzv_backend": "c10d", "etcd_user": "alice"}, {}, 64, "--etcd-user: only for an etcd rendezvous"),
])  # fmt: skip
def test_access_mistakes_are_one_line_by_origin_and_never_show_the_password(pki, tmp_path, flags, env, code, says):
    from trainpod.launcher.resolve import Options, resolve_topology

    files = {"CA": pki.ca, "CERT": pki.client_cert, "KEY": pki.client_key, "OTHER_KEY": pki.other_client_key,
             "NOT_PEM": __file__, "EMPTY": str(tmp_path / "empty"), "SECRET": str(tmp_path / "secret")}
    (tmp_path / "empty").write_text("")
    (tmp_path / "secret").write_text("s3cret")
    flags = {"nnodes": "1:2", "rdzv_backend": "etcd-v3", "rdzv_endpoint": "e:2379",
             **{k: files.get(v, v) for k, v in flags.items()}}
    env = {k: files.get(v, v) for k, v in env.items()}
    with pytest.raises(TrainpodError) as caught:
        resolve_topology(Options(**flags), env, resolve_names=False)
    line = str(caught.value)
    assert caught.value.exit_code == code and says in line and "\n" not in line
    assert "s3cret" not in line and "s3\\ncret" not in line


def test_https_and_the_files_resolve_for_explain(pki):
    from trainpod.launcher.resolve import Options, resolve_topology

    top = resolve_topology(Options(nnodes="1:2", rdzv_backend="etcd-v3", rdzv_endpoint="https://e1:2379,https://e2",
                                   etcd_cacert=pki.ca), {}, resolve_names=False)
    assert top.rdzv.endpoint == "https://e1:2379,https://e2:2379" and top.rdzv.access.cacert == pki.ca
    assert (top.master_addr, top.master_port) == ("e1", 2379)


# --- TLS ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["etcd-v3", "etcd"])
def test_the_right_certificates_pass_the_preflight(etcd_tls, pki, backend):
    info = preflight.check_etcd(topology(backend, etcd_tls.url, tls(pki)), 10, lambda line: None)
    assert info.version.startswith("3.") and info.v2_enabled


def test_plain_http_against_tls_is_78_saying_use_https(etcd_tls):
    line = refused(topology("etcd-v3", etcd_tls.endpoint))
    assert f"use https://{etcd_tls.endpoint}" in line and "--rdzv-endpoint" in line


@pytest.mark.parametrize("changes,says", [
    ({"cert": None, "key": None}, "asks for a client certificate"),
    ({"cacert": "other_ca"}, "does not verify against the CA in"),
    ({"cert": "other_client_cert", "key": "other_client_key"}, "refused the client certificate"),
])  # fmt: skip
def test_a_certificate_missing_or_untrusted_is_78(etcd_tls, pki, changes, says):
    changes = {k: getattr(pki, v) if v else None for k, v in changes.items()}
    assert says in refused(topology("etcd-v3", etcd_tls.url, tls(pki, **changes)))


def test_https_against_plain_http_is_78_saying_use_http(etcd_rbac, pki):
    line = refused(topology("etcd-v3", f"https://{etcd_rbac.endpoint}", EtcdAccess(cacert=pki.ca)))
    assert f"use http://{etcd_rbac.endpoint}" in line


# --- users (v3) ----------------------------------------------------------------------------------


def test_the_right_user_passes_and_the_password_is_read_not_kept(etcd_rbac, passwords):
    access = EtcdAccess(user="alice", password_file=passwords["alice"])  # (its trailing newline is not the password's)
    preflight.check_etcd(topology("etcd-v3", etcd_rbac.endpoint, access), 10, lambda line: None)
    assert "alice-pw" not in repr(access) and "alice-pw" not in access.describe()


@pytest.mark.parametrize("access,says", [
    (lambda p: EtcdAccess(), "has authentication on, and no user was given"),
    (lambda p: EtcdAccess(user="alice", password_file=p["wrong"]), "refused user 'alice'"),
    (lambda p: EtcdAccess(user="nobody", password_file=p["wrong"]), "wrong user name or password"),
    (lambda p: EtcdAccess(user="bob", password_file=p["bob"]), "user 'bob' may not read and write /trainpod/"),
])  # fmt: skip
def test_a_wrong_or_missing_user_or_no_permission_is_78(etcd_rbac, passwords, access, says):
    line = refused(topology("etcd-v3", etcd_rbac.endpoint, access(passwords)))
    assert says in line and "not-it" not in line and "bob-pw" not in line


def test_a_token_etcd_no_longer_knows_is_replaced(etcd_rbac, passwords):
    client = EtcdClient(etcd_rbac.endpoint, 5, EtcdAccess(user="alice", password_file=passwords["alice"]))
    client.put(b"/trainpod/token-test", b"1")
    client._token = "stale.1"  # as after etcd's --auth-token-ttl or a restart of etcd
    assert client.get(b"/trainpod/token-test")[0] == b"1"


# --- the v2 API's users (torch's etcd backend) ------------------------------------------------------


@pytest.mark.slow
def test_torchs_etcd_backend_with_the_v2_user_passes(etcd_v2_auth, passwords):
    access = EtcdAccess(user="alice", password_file=passwords["alice"])
    assert probe(etcd_v2_auth.endpoint, 5, access).v2_enabled  # (401 to anyone else: v2 is served)
    preflight.check_etcd(topology("etcd", etcd_v2_auth.endpoint, access), 10, lambda line: None)


@pytest.mark.parametrize("access,says", [
    (lambda p: EtcdAccess(), "refused a client without a user"),
    (lambda p: EtcdAccess(user="alice", password_file=p["wrong"]), "refused user 'alice'"),
])  # fmt: skip
def test_torchs_etcd_backend_without_the_v2_user_is_78(etcd_v2_auth, passwords, access, says):
    line = refused(topology("etcd", etcd_v2_auth.endpoint, access(passwords)))
    assert says in line and "v2 API" in line


# --- rendezvous through the code a job runs ----------------------------------------------------------

torch_needed = pytest.mark.skipif(__import__("importlib").util.find_spec("torch") is None, reason="needs torch")


@pytest.mark.slow
@torch_needed
@pytest.mark.parametrize("server", ["etcd_tls", "etcd_rbac"])
def test_etcd_v3_forms_a_world_of_two_with_tls_or_a_user(server, request, pki, passwords, monkeypatch):
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    from trainpod.rendezvous import etcd_v3

    etcd = request.getfixturevalue(server)
    conf = {"read_timeout": 5, "join_timeout": 30, "last_call_timeout": 1}
    if server == "etcd_tls":
        conf.update(cacert=pki.ca, cert=pki.client_cert, key=pki.client_key)  # as the launch plan passes them
    else:
        monkeypatch.setenv("TRAINPOD_ETCD_USER", "alice")
        monkeypatch.setenv("TRAINPOD_ETCD_PASSWORD", "alice-pw")
        monkeypatch.delenv("TRAINPOD_ETCD_PASSWORD_FILE", raising=False)
    etcd_v3.register()
    run_id = f"team@2Fa.g{uuid.uuid4().int % 1000}"
    handlers = [rendezvous_handler_registry.create_handler(
        RendezvousParameters("etcd-v3", etcd.url, run_id, 2, 2, local_addr="127.0.0.1", **conf)) for _ in range(2)]
    infos = meet(handlers)
    assert sorted(info.rank for info in infos) == [0, 1] and {info.world_size for info in infos} == {2}
    for handler in handlers:
        handler.shutdown()


@pytest.mark.slow
@torch_needed
@pytest.mark.parametrize("server", ["etcd_tls", "etcd_v2_auth"])
def test_torchs_etcd_backend_forms_a_world_of_two_with_tls_or_a_v2_user(server, request, pki, passwords, monkeypatch):
    """python-etcd takes TLS from torch (protocol, cacert, cert, key) and the user from trainpod.agent.agent's wrapper."""
    pytest.importorskip("etcd")
    from torch.distributed.elastic.rendezvous import RendezvousParameters, etcd_rendezvous

    from trainpod.agent import agent

    etcd = request.getfixturevalue(server)
    conf = {"timeout": 30, "last_call_timeout": 1}
    if server == "etcd_tls":
        conf.update(protocol="https", cacert=pki.ca, cert=pki.client_cert, key=pki.client_key)
    else:
        monkeypatch.setenv("TRAINPOD_ETCD_USER", "alice")
        monkeypatch.setenv("TRAINPOD_ETCD_PASSWORD_FILE", passwords["alice"])
    monkeypatch.setattr(etcd_rendezvous, "_create_etcd_client", etcd_rendezvous._create_etcd_client)  # restored after
    args = types.SimpleNamespace(rdzv_backend="etcd", rdzv_conf=",".join(f"{k}={v}" for k, v in conf.items()))
    assert agent._give_etcd_credentials(args) is None
    run_id = f"team@2Fa.g{uuid.uuid4().int % 1000}"
    handlers = [etcd_rendezvous.create_rdzv_handler(RendezvousParameters("etcd", etcd.endpoint, run_id, 2, 2, **conf))
                for _ in range(2)]  # fmt: skip
    infos = meet(handlers)
    assert sorted(info.rank for info in infos) == [0, 1] and {info.world_size for info in infos} == {2}


@torch_needed
def test_torchs_etcd_backend_without_the_v2_user_fails(etcd_v2_auth):
    """What the preflight spares the agent: python-etcd refused (the agent would only see torch's traceback)."""
    pytest.importorskip("etcd")
    import etcd as python_etcd
    from torch.distributed.elastic.rendezvous import RendezvousParameters, etcd_rendezvous

    with pytest.raises(python_etcd.EtcdException):
        handler = etcd_rendezvous.create_rdzv_handler(RendezvousParameters("etcd", etcd_v2_auth.endpoint, "anon", 1, 1,
                                                                           timeout=5, last_call_timeout=1))
        handler.next_rendezvous()


# --- trainpod run and explain, end to end: the secret is never shown ----------------------------------

ENTRYPOINT = str(__import__("pathlib").Path(__file__).resolve().parents[3] / "entrypoint")
SECRET = "s3cret-Xq7"


def trainpod(*args, env=None, timeout=180):
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PAI_", "PET_", "TRAINPOD_", "MASTER_", "SLURM_"))}
    return subprocess.run([sys.executable, "-m", "trainpod", *args], capture_output=True, text=True, timeout=timeout,
                          env={**clean, "PYTHONPATH": ENTRYPOINT, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.slow
def test_explain_shows_files_and_the_user_never_the_password(pki, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    common = ["--nnodes", "1:2", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "https://127.0.0.1:2379", "--etcd-cacert",
              pki.ca, "--etcd-cert", pki.client_cert, "--etcd-key", pki.client_key, "--etcd-user", "alice"]
    for extra, env in ((["--etcd-password-file", str(secret_file)], {}), ([], {"TRAINPOD_ETCD_PASSWORD": SECRET})):
        for view in ([], ["--json"]):
            result = trainpod("explain", *common, *extra, *view, "--example", "cifar10-ddp", env=env)
            assert result.returncode == 0, result.stderr
            assert SECRET not in result.stdout + result.stderr
            assert "alice" in result.stdout and pki.client_cert in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("case", ["etcd-v3 with a user", "etcd-v3 over TLS", "etcd over TLS"])
def test_trainpod_run_meets_in_etcd_with_tls_or_a_user_and_advances_the_generation(case, request, pki, monkeypatch):
    """The real path: the outer run, the preflight, the generation, the agent (torchrun with the backend), the end."""
    backend = case.split()[0]
    rid = f"team/a-{uuid.uuid4().hex[:6]}"
    if "user" in case:
        etcd = request.getfixturevalue("etcd_rbac")
        access_flags, env = ["--etcd-user", "alice"], {"TRAINPOD_ETCD_PASSWORD": "alice-pw"}
        access = EtcdAccess(user="alice", password_var="TRAINPOD_ETCD_PASSWORD")
    else:
        etcd = request.getfixturevalue("etcd_tls")
        access_flags, env = ["--etcd-cacert", pki.ca, "--etcd-cert", pki.client_cert, "--etcd-key", pki.client_key], {}
        access = tls(pki)
    result = trainpod("run", "--no-supervise", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", backend,
                      "--rdzv-endpoint", etcd.url, "--rdzv-id", rid, *access_flags, "--connect-timeout", "30", "--",
                      "python", "-c", "import os; print('WORLD', os.environ['WORLD_SIZE'])", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WORLD 1" in result.stdout and "alice-pw" not in result.stdout + result.stderr
    monkeypatch.setenv("TRAINPOD_ETCD_PASSWORD", "alice-pw")  # (this test's client reads the password from it)
    key = f"/trainpod/generation/{rid.replace('/', '@2F')}".encode()
    assert EtcdClient(etcd.url, 5, access).get(key)[0] == b"1"  # the run closed generation 0: the next run meets in 1


@pytest.mark.slow
def test_trainpod_run_with_a_wrong_password_is_one_line_78(etcd_rbac):
    result = trainpod("run", "--no-supervise", "--nnodes", "1:2", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint",
                      etcd_rbac.endpoint, "--etcd-user", "alice", "--connect-timeout", "30", "--", "true",
                      env={"TRAINPOD_ETCD_PASSWORD": SECRET})
    assert result.returncode == 78, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if ": warning: " not in line]  # (this host's name)
    assert len(lines) == 1 and "refused user 'alice'" in lines[0] and etcd_rbac.endpoint in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert SECRET not in result.stdout + result.stderr
