"""The supervisor: what runs under supervisord, between the launcher and torch's agent.

supervise.py writes supervisord's configuration and its event listener (the restart policy between
attempts); job.py is the program supervisord starts (`python -m trainpod.supervisor.job`: preflight,
the directory lock, the etcd generation, then it becomes the agent); restarts.py is the restart budget
that the listener and the agent share through budget.json; orphans.py and oom.py name how a process
died and make sure none outlives its parent.
"""
