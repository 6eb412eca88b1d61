import pytest

from fixtures.etcd import EtcdProcess


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """etcd without --enable-v2 (as etcd 3.6 is for torch): only the v3 API."""
    with EtcdProcess(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture(scope="module")
def etcd_v2(tmp_path_factory):
    """etcd with --enable-v2."""
    with EtcdProcess(tmp_path_factory.mktemp("etcd-v2"), enable_v2=True) as server:
        yield server
