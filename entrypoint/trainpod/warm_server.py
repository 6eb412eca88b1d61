"""Imported first by trainpod.warm's fork server (its preload list), for what it does to that process:

- it gets SIGKILL when the agent that started it dies, and then so does every rank forked from it.
  multiprocessing's server exits only when no process holds its "alive" pipe any more, and each
  rank holds it (multiprocessing passes it to every child it forks), so without this a killed agent
  would leave the server and the ranks running (trainpod.orphans: no rank outlives its agent);
- it leaves the agent's session and process group, as torch puts each rank it starts in a session
  of its own: a signal to the agent's group (supervisord's stopasgroup on `docker stop`, a shell's
  kill -TERM -PGID) reaches the agent, which gives the ranks their --term-grace, and not the server,
  whose death would SIGKILL the ranks mid-checkpoint.
"""

import os

from trainpod import orphans

orphans.die_with_parent(orphans.RANK_SIGNAL)
os.setsid()
