"""trainpod's own lines on stderr, and the one place their prefix is built: `[node1] trainpod: ...`.

The outer `trainpod run`, the supervised job, the restart-policy listener and the agent all run in
different processes; they all say who is speaking the same way, so a multi-node log reads as one.
(The ranks' own lines get `[node1 rank3] ` from torchrun: see launch.py.)
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable

from trainpod.contract import NODE_RANK_VAR

Log = Callable[[str], None]


def tag(node_rank: int | str) -> str:
    """'[node1]': what starts every line of a node, trainpod's and torch's."""
    return f"[node{node_rank}]"


def rank_tag_template(node_rank: int | str) -> str:
    """torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE: each rank's lines start '[node1 rank3] '."""
    return f"[node{node_rank} rank${{rank}}] "


def prefix(node_rank: int | str | None = None) -> str:
    """'[node1] trainpod', or plain 'trainpod' before this node's rank is known."""
    return "trainpod" if node_rank is None else f"{tag(node_rank)} trainpod"


def node_from_env() -> str | None:
    """This process's node rank, where the launch plan set it (the agent, the ranks)."""
    return os.environ.get(NODE_RANK_VAR) or None


def writer(node_rank: int | str | None = None) -> Log:
    """A function that prints one prefixed line on stderr, flushed at once."""
    head = prefix(node_rank)

    def log(message: str) -> None:
        # One write: print() writes the message and its newline apart, and a rank's line (trainpod.agent.ranklog,
        # on another thread of the agent) could land between the two.
        sys.stderr.write(f"{head}: {message}\n")
        sys.stderr.flush()

    return log


# torch's own lines about what a line of trainpod's says already: a rank's failure ("failed (exitcode: 64) local_rank:
# 0 (pid: ...)" beside "rank 0 exited with 64 (a usage error): not restarting"), the stop of the ranks ("Received 15
# death signal", "Closing process N via signal SIGTERM", "Terminating process ..." beside "received SIGINT: the workers were stopped", which
# names the signal the job was given). (logger, the start of its message's format)
ASIDE_LINES = (
    ("torch.distributed.elastic.multiprocessing.api", "failed (exitcode:"),
    ("torch.distributed.elastic.multiprocessing.api", "Closing process"),  # a MultiprocessContext's (--warm-start)
    ("torch.distributed.elastic.multiprocessing.api", "Sending process"),  # a SubprocessContext's: "... closing signal"
    ("torch.distributed.elastic.agent.server.api", "Received %s death signal"),
    ("torch.multiprocessing.spawn", "Terminating process"),
)
ASIDE_FILE = "agent.log"  # in torch's log directory of the run, beside attempt_<N>/<local rank>/stderr.log


class Aside(logging.Filter):
    """A filter for the agent's console handlers: torch's lines in ASIDE_LINES go to the file `path` instead
    (the pids, the times and torch's wording are kept there). Until `path` is set (before the first ranks
    start, the run's log directory does not exist) they stay on the console."""

    def __init__(self) -> None:
        super().__init__()
        self.path: str | None = None
        self._format = logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s")

    def filter(self, record: logging.LogRecord) -> bool:
        if self.path is None or not any(record.name == name and str(record.msg).startswith(start) for name, start in ASIDE_LINES):
            return True
        if getattr(record, "trainpod_aside", False):
            return False  # written by another handler's filter already (torch's loggers have handlers of their own)
        try:
            with open(self.path, "a", encoding="utf-8") as file:
                file.write(self._format.format(record) + "\n")
        except OSError:
            return True  # no file to keep it in: the console keeps it
        record.trainpod_aside = True
        return False


ASIDE = Aside()  # the agent's (trainpod.agent installs it, trainpod.agent.policy sets its path)
