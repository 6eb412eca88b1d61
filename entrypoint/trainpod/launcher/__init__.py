"""The launcher: the process a user (or a cluster's job script) starts, `trainpod ...`.

It reads flags and the cluster's environment into a Topology (resolve.py over environments/), checks
what it can without the network (preflight.py's offline checks), turns the run into a RunSpec and a
launch plan (launch.py), and hands both to supervisord (trainpod.supervisor). It never imports torch:
`explain` and a bad flag answer in a fraction of a second.
"""
