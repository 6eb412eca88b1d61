"""The agent: torch's elastic agent, as trainpod runs it (`python -m trainpod.agent`, or in the job's process).

agent.py is torchrun's launcher with node-prefixed logs and real exit codes; policy.py decides each
worker-group restart; control.py is a fixed-size job's stop key; hangwatch.py (with hang.py's pure
verdicts and stacks.py) watches the ranks; warm.py and warm_server.py start them from a fork server;
keeper.py replaces a rank in place (--recovery in-process); ranklog.py shows their lines. Nothing here
is imported at package import: the launcher reads hang.py without starting torch.
"""
