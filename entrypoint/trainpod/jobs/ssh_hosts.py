"""The host list of `trainpod job ssh`: [user@]host[:port] parsed and checked as a setting kind, and the
line each remote command prints first (its PID, which the stop signals). Shared by the job's rendering
(ssh.py) and its launch (ssh_launch.py), which import nothing from each other at run time."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from trainpod.settings import Host, Invalid

PID_TAG = "trainpod-ssh-pid"  # the first line every remote command prints: its PID, for the stop


@dataclass(frozen=True)
class Target:
    """One host of the list: [user@]host[:port]."""

    host: str
    user: str | None = None
    port: int = 22

    @property
    def label(self) -> str:
        return self.host

    def __str__(self) -> str:
        user = f"{self.user}@" if self.user else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{user}{host}:{self.port}"


# A user name as POSIX systems take them (letters, digits, '_', '.', '-', not starting with '-'); it is
# printed beside the host in the job's listing.
_TARGET = re.compile(r"(?:(?P<user>[A-Za-z0-9_][A-Za-z0-9_.-]*)@)?(?P<host>\[[^\]]+\]|[^:\s@\[\]]+)(?::(?P<port>[0-9]+))?")


def parse_target(text: str) -> Target:
    """'alice@gpu1:2222' -> Target('gpu1', 'alice', 2222); ValueError when malformed."""
    match = _TARGET.fullmatch(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not [user@]host[:port]")
    try:
        host = Host()(match["host"])
    except Invalid as bad:
        raise ValueError(f"{text!r}: {bad}") from None
    port = int(match["port"]) if match["port"] else 22
    if not 1 <= port <= 65535:
        raise ValueError(f"{text!r}: the port must be from 1 to 65535")
    return Target(host=host, user=match["user"], port=port)


class HostList:
    """Comma-separated [user@]host[:port]; checked as a setting kind."""

    def expected(self) -> str:
        return "comma-separated [user@]host[:port], each host once"

    def __call__(self, value: Any) -> tuple[Target, ...]:
        items = [item.strip() for item in str(value).split(",")]
        if not items or any(not item for item in items):
            raise Invalid(self.expected())
        try:
            targets = tuple(parse_target(item) for item in items)
        except ValueError as bad:
            raise Invalid(f"{self.expected()}: {bad}") from None
        if len({(t.host, t.port) for t in targets}) != len(targets):
            raise Invalid(f"{self.expected()}: a host is listed twice")
        return targets
