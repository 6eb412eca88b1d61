"""trainpod's own lines on stderr, and the one place their prefix is built: `[node1] trainpod: ...`.

The outer `trainpod run`, the supervised job, the restart-policy listener and the agent all run in
different processes; they all say who is speaking the same way, so a multi-node log reads as one.
(The ranks' own lines get `[node1 rank3] ` from torchrun: see launch.py.)
"""

from __future__ import annotations

import os
import sys
from typing import Callable

NODE_RANK_VAR = "TRAINPOD_NODE_RANK"  # set for the agent and the ranks by the launch plan

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
        # One write: print() writes the message and its newline apart, and a rank's line (trainpod.ranklog,
        # on another thread of the agent) could land between the two.
        sys.stderr.write(f"{head}: {message}\n")
        sys.stderr.flush()

    return log
