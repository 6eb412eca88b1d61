"""--rdzv-conf checked against what each backend reads, before anything starts: one line, 64 or 78."""

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainpod.errors import ConfigError, TrainpodError, UsageError
from trainpod.launcher.resolve import Options, resolve_topology
from trainpod.rendezvous import conf

ETCD = {"c10d": {"rdzv_endpoint": "10.0.0.1:29400"}, "etcd": {"rdzv_endpoint": "e:2379"}, "etcd-v3": {"rdzv_endpoint": "e:2379"}}


def resolve(backend, rdzv_conf, as_variable=False):
    flags = {"nnodes": "1:2", "rdzv_backend": backend, **ETCD[backend]}
    env = {}
    if as_variable:
        env["TRAINPOD_RDZV_CONF"] = rdzv_conf
    else:
        flags["rdzv_conf"] = rdzv_conf
    return resolve_topology(Options(**flags), env, resolve_names=False)


@pytest.mark.parametrize("backend,given", [
    ("c10d", "keep_alive_interval=2,join_timeout=60,is_host=t,read_timeout=30,store_type=tcp,heartbeat_timeout=9"),
    ("etcd-v3", "keep_alive_interval=2,keep_alive_max_attempt=5,close_timeout=10,read_timeout=5,ttl=600"),
    ("etcd", "timeout=60,last_call_timeout=0,etcd_prefix=/jobs/p2p,keep_alive_ttl=6"),
])  # fmt: skip
def test_what_the_backend_reads_is_taken(backend, given):
    settings = resolve(backend, given).rdzv.settings
    for pair in given.split(","):
        key, value = pair.split("=")
        assert settings[key] == value


@pytest.mark.parametrize("backend,given,says", [
    ("etcd-v3", "keep_alive_interval=abc", "--rdzv-conf keep_alive_interval='abc': expected an integer from 1"),
    ("c10d", "keep_alive_interval=0", "keep_alive_interval='0': expected an integer from 1"),
    ("c10d", "join_timeout=1_0", "join_timeout='1_0'"),
    ("c10d", "is_host=on", "is_host='on': expected one of 1, true, t"),
    ("c10d", "store_type=file", "store_type='file'"),
    ("etcd-v3", "keep_alive_intreval=2", "the etcd-v3 rendezvous reads no key 'keep_alive_intreval'"),
    ("etcd-v3", "timeout=60", "(the dynamic rendezvous calls it join_timeout)"),
    ("etcd", "join_timeout=60", "(torch's etcd backend calls it timeout)"),
    ("etcd-v3", "is_host=1", "reads no key 'is_host'"),
    ("etcd", "keep_alive_ttl=1", "keep_alive_ttl='1': expected an integer from 2 to 3600"),
    ("etcd", "etcd_prefix=rel/path", "etcd_prefix='rel/path'"),
    ("etcd", "cacert=/ca.pem", "cacert: trainpod sets it for the etcd rendezvous from --etcd-cacert"),
    ("etcd-v3", "protocol=https", "protocol: trainpod sets it"),
    ("c10d", "cacert=/ca.pem", "the c10d rendezvous reads no key 'cacert'"),
])  # fmt: skip
@pytest.mark.parametrize("as_variable", [False, True])
def test_a_bad_key_or_value_is_one_line_by_its_origin(backend, given, says, as_variable):
    with pytest.raises(TrainpodError) as refused:
        resolve(backend, given, as_variable)
    error = refused.value
    assert isinstance(error, ConfigError if as_variable else UsageError)
    assert error.exit_code == (78 if as_variable else 64)
    expected = says.replace("--rdzv-conf", "TRAINPOD_RDZV_CONF") if as_variable else says
    assert expected in str(error) and "\n" not in str(error)
    assert str(error).startswith("TRAINPOD_RDZV_CONF" if as_variable else "--rdzv-conf")


def test_trainpods_own_defaults_pass_the_same_check():
    from trainpod.launcher.resolve import ELASTIC_CONF, ETCD_V2_CONF

    conf.check("c10d", ELASTIC_CONF, "default")
    conf.check("etcd-v3", ELASTIC_CONF, "default")
    conf.check("etcd", ETCD_V2_CONF, "default")


def _keys_read(source: str) -> set[str]:
    keys = set(re.findall(r'params\.(?:config\.)?get(?:_as_int|_as_bool)?\(\s*"(\w+)"', source))
    keys |= {f"{name}_timeout" for name in re.findall(r'_get_timeout\(params, "(\w+)"\)', source)}
    return keys


def test_the_table_is_what_torch_reads():
    """If a torch upgrade adds or drops a key, this fails before a job meets it (torch 2.13: trainpod.agent)."""
    pytest.importorskip("torch")
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous, etcd_rendezvous

    from trainpod.rendezvous import etcd_v3

    dynamic = _keys_read(inspect.getsource(dynamic_rendezvous.create_handler))
    c10d = _keys_read(inspect.getsource(c10d_rendezvous_backend))
    etcd = _keys_read(inspect.getsource(etcd_rendezvous.create_rdzv_handler) + inspect.getsource(etcd_rendezvous._create_etcd_client))
    ours = _keys_read(inspect.getsource(etcd_v3))
    assert set(conf.KEYS["c10d"]) == dynamic | c10d - {"path"}  # (store_type=file's path: not offered)
    assert set(conf.KEYS["etcd-v3"]) == dynamic | ours
    assert set(conf.KEYS["etcd"]) | set(conf.TLS_KEYS) == etcd | {conf.KEEP_ALIVE_TTL}


ENTRYPOINT = str(Path(__file__).resolve().parents[3] / "entrypoint")


def trainpod(*args, env=None):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PAI_", "PET_", "TRAINPOD_", "MASTER_", "SLURM_"))}
    return subprocess.run([sys.executable, "-m", "trainpod", *args], env={**clean, "PYTHONPATH": ENTRYPOINT, **(env or {})},
                          capture_output=True, text=True, timeout=60)


def one_line_error(result, code):
    assert result.returncode == code, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip()


@pytest.mark.slow
def test_the_cli_says_it_in_one_line_before_anything_starts():
    line = one_line_error(trainpod("explain", "--nnodes", "1:2", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "e:2379",
                                   "--rdzv-conf", "keep_alive_interval=abc"), 64)
    assert "keep_alive_interval='abc'" in line
    run = trainpod("run", "--nnodes", "1:2", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "127.0.0.1:9",
                   "--no-supervise", "--", "true", env={"TRAINPOD_RDZV_CONF": "keep_alive_interval=abc"})
    assert "keep_alive_interval='abc'" in one_line_error(run, 78)
