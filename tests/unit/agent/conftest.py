from fixtures.etcd import etcd, etcd_v2  # noqa: F401 (pytest fixtures)
