"""Rendezvous ids: the same on every node of a job, never shared by two jobs or two runs of one.

torch keys a rendezvous by its id, and a run that ends closes it: the same id again (the same
command run twice, a job resubmitted) fails at once with RendezvousClosedError, and two jobs with
one id on one etcd join each other. So the id is made of

- the job's identity, the same on every node and different for every job: --rdzv-id /
  TRAINPOD_RDZV_ID / PET_RDZV_ID when given, else what the cluster says (OpenPAI's job name and
  attempt, SLURM's job, step and restart count), else a digest of the job itself (node range,
  processes, what runs, the rendezvous endpoint): two different jobs differ there;
- for etcd, a generation (generation.py) that the nodes read from etcd when they start and that a
  run advances when it closes its rendezvous: the next run of the same job meets in a fresh one.

The identity is kept exactly: escape() maps it to the id the rendezvous uses, one-to-one, so two
different identities never meet (`team/a`, `team-a`, `team a` and `team_a` are four jobs). The id
is a key in etcd (v3: `/trainpod/rdzv/<id>...`, any bytes) and a segment of a URL path (torch's
etcd backend: python-etcd puts `/torchelastic/p2p/run_<id>/...` into the URL unquoted), so it
keeps ASCII letters, digits, `.`, `_`, `-` and `~` (OpenPAI's `user~job` names read as they are) and
writes every other byte of the identity's UTF-8 as `@XX` (hex; `@` itself too): `team/a` -> `team@2Fa`,
`team a` -> `team@20a`, `Zürich` -> `Z@C3@BCrich` (`%` would be decoded by etcd's URL handling).
unescape() gives the identity back. What cannot be kept is refused (check()): control and other
invisible characters (a newline, a zero-width space: two ids that print alike would differ), an
empty id, and an id longer than MAX_LENGTH once escaped.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable

MAX_LENGTH = 200  # characters of the escaped id: a key path and an environment variable, never near a limit
ESCAPE = "@"
_KEPT = re.compile(r"[A-Za-z0-9._~-]")
_ESCAPED = re.compile(r"(?:@[0-9A-F]{2})+")
# Unicode's control, format (zero-width, bidi), surrogate, private-use and unassigned characters, and the
# line and paragraph separators: none prints as itself.
_INVISIBLE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def check(text: str) -> str:
    """`text` if it can be a job's identity; else ValueError with what was expected (one line, no value)."""
    if not text:
        raise ValueError("a non-empty id")
    for char in text:
        if unicodedata.category(char) in _INVISIBLE:
            raise ValueError(f"an id of printable characters, without {_name(char)}")
    escaped = len(_escape(text))
    if escaped > MAX_LENGTH:
        raise ValueError(f"an id of at most {MAX_LENGTH} characters once escaped for etcd (this one has {escaped})")
    return text


def escape(text: str) -> str:
    """The rendezvous id of the identity `text`, one-to-one: `team/a` -> `team@2Fa` (check() first)."""
    return _escape(check(text))


def unescape(escaped: str) -> str:
    """The identity an escaped id stands for: unescape(escape(x)) == x."""
    return _ESCAPED.sub(lambda m: bytes.fromhex(m.group().replace(ESCAPE, "")).decode("utf-8"), escaped)


def _escape(text: str) -> str:
    return "".join(char if _KEPT.fullmatch(char) else "".join(f"{ESCAPE}{byte:02X}" for byte in char.encode("utf-8"))
                   for char in text)


_CONTROL_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab"}


def _name(char: str) -> str:
    if char in _CONTROL_NAMES:
        return f"{_CONTROL_NAMES[char]} (U+{ord(char):04X})"
    name = unicodedata.name(char, "control character" if unicodedata.category(char) == "Cc" else "")
    return f"U+{ord(char):04X}" + (f" ({name.lower()})" if name else "")


def digest_id(parts: Iterable[str]) -> str:
    """'job-1a2b3c4d5e6f': the same for the same job on every node, different for a different one."""
    return "job-" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]
