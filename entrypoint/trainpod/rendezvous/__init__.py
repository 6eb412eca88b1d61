"""Rendezvous backends trainpod adds to torch's: `etcd-v3` (etcd_v3.py), on etcd's v3 API.

etcd_http.py (no torch) holds the HTTP client and probe(), which preflight uses to ask an etcd
endpoint for its version and whether it serves the v2 API.
"""
