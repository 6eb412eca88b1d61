"""Imported first by trainpod.agent.warm's fork server (its preload list), for what it does to that process:

- it gets SIGKILL when the agent that started it dies, and then so does every rank forked from it.
  multiprocessing's server exits only when no process holds its "alive" pipe any more, and each
  rank holds it (multiprocessing passes it to every child it forks), so without this a killed agent
  would leave the server and the ranks running (trainpod.supervisor.orphans: no rank outlives its agent);
- it leaves the agent's session and process group, as torch puts each rank it starts in a session
  of its own, and it ignores the signals that stop a job (SIGTERM, SIGHUP, SIGQUIT; multiprocessing
  already ignores SIGINT there). Whoever signals the job's processes (supervisord's stopasgroup on
  `docker stop`, a shell's kill -TERM -PGID, scancel signalling every process of the step) reaches
  the agent and the ranks, which save their checkpoint within --term-grace; the server, whose death
  would SIGKILL them mid-checkpoint, goes only with the agent. run_rank gives the ranks the default
  dispositions back.
"""

import os
import signal

from trainpod.agent.warm import STOP_SIGNALS
from trainpod.supervisor import orphans


def become_server() -> None:
    """What the import does (the module docstring); called again by a server whose process had imported this
    module already (trainpod.agent.zygote: a copy of the job's process, where the import would not run again)."""
    orphans.die_with_parent(orphans.RANK_SIGNAL)
    if os.getsid(0) != os.getpid():
        os.setsid()
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


become_server()
