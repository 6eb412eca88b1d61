import os
import subprocess
import sys
import textwrap

from fixtures.ports import free_port

# shutdown() pauses (DRAIN_S) before it destroys a group that would be freed, so that gloo's threads can finish
# freeing their collectives' tensors (they need the GIL): a group that trainpod.train.inprocess holds (kept()) is
# never freed, and a survivor of a dead rank goes on to recover without the pause (it was on the recovery's path).
SHUTDOWN = textwrap.dedent("""
    import os, sys, types
    import torch.distributed as dist
    from trainpod.train import distributed, inprocess

    slept = []
    distributed.time = types.SimpleNamespace(sleep=slept.append)
    if sys.argv[1] == "held":
        os.environ[inprocess.INPROCESS_GENERATION_VAR] = "0"  # as under a keeper (trainpod.agent.keeper)
        store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=True, wait_for_workers=False)
        inprocess.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    distributed.shutdown(barrier=sys.argv[2] == "barrier")
    print(dist.is_initialized(), slept, flush=True)
    os._exit(0)
""")


def shutdown(group: str, barrier: str) -> str:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}  # the store is the keeper's: here, the script's own
    done = subprocess.run([sys.executable, "-c", SHUTDOWN, group, barrier], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_after_an_error_a_group_that_inprocess_holds_is_left_without_the_pause():
    assert shutdown("held", "no-barrier") == "False []"


def test_a_group_that_would_be_freed_gets_the_pause_after_an_error_and_at_the_end():
    assert shutdown("torchs", "no-barrier") == "False [0.2]"
    assert shutdown("torchs", "barrier") == "False [0.2]"
    assert shutdown("held", "barrier") == "False [0.2]"  # the clean end: as before
