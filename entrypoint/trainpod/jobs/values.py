"""What a job file's values may be, checked for where each goes, so that no value reshapes the file.

A job file is YAML, a shell script or a command line that someone else's scheduler parses; a
value that carries a newline, a leading '-' or a quote can turn into a second key, a second
command or an option of `docker run`. So every value is either checked against the grammar of the
place it lands (Kubernetes' DNS-1123 labels, the OCI image reference, an sbatch option's word) or
quoted where it is free text (the example's own flags), and no value anywhere holds a control
character: those are refused up front, with the flag's 64 or the variable's 78. The header's
`trainpod job ...` line is printable ASCII whatever the values are (shell_line).
"""

from __future__ import annotations

import codecs
import os
import re
import shlex
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainpod.errors import error_for, invalid
from trainpod.settings import Invalid
from trainpod.text import CONTROL_EXPECTED, has_control, printable

__all__ = ["CONTROL_EXPECTED", "DnsLabel", "ImageReference", "Pattern", "SbatchWord", "check_text", "has_control",
           "printable", "read_bytes", "read_text", "shell_line", "shell_word"]


def check_text(value: Any, origin: str, *, shown: str | None = None) -> None:
    """A one-line error (64 for a flag, 78 for a variable) when `value` holds a control character.
    `shown` replaces the value in the message (a redacted endpoint)."""
    if isinstance(value, str) and has_control(value):
        raise invalid(origin, value if shown is None else shown, CONTROL_EXPECTED)


@dataclass(frozen=True)
class DnsLabel:
    """A Kubernetes name or namespace: an RFC 1123 label (lower-case letters, digits and '-', starting
    and ending with a letter or digit), at most `maximum` characters; `letter_first`: a job name, whose
    pods' names (`<name>-worker-3`) and OpenPAI's and SLURM's rules want a letter first."""

    maximum: int = 63
    letter_first: bool = False

    def expected(self) -> str:
        first = "a letter" if self.letter_first else "a letter or digit"
        return f"lower-case letters, digits and '-', starting with {first} and ending with a letter or digit, " \
               f"at most {self.maximum} characters"

    def __call__(self, value: Any) -> str:
        text = str(value).strip()
        first = "[a-z]" if self.letter_first else "[a-z0-9]"
        if len(text) > self.maximum or not re.fullmatch(first + r"(?:[-a-z0-9]*[a-z0-9])?", text, re.ASCII):
            raise Invalid(self.expected())
        return text


# The OCI image reference, as distribution/reference's regexp.go (v0.6) defines it; Go's \w and
# [[:xdigit:]] are ASCII (re.ASCII). Its first character is a letter or digit: never an option.
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = rf"[a-z0-9]+(?:{_SEPARATOR}[a-z0-9]+)*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])"
_NAME = rf"(?:{_HOST}(?::[0-9]+)?/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_REFERENCE = re.compile(
    rf"(?P<name>{_NAME})(?::[\w][\w.-]{{0,127}})?(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{{32,}})?",
    re.ASCII)
NAME_TOTAL_LENGTH_MAX = 255  # reference.go: a repository name's limit
_REFERENCE_MAX = 1024  # bounds the regular expression's work on absurd input; no real reference comes near


@dataclass(frozen=True)
class ImageReference:
    """An image reference per the OCI distribution grammar: [registry[:port]/]path[:tag][@digest]."""

    def expected(self) -> str:
        return ("an image reference such as registry.example.com/team/trainpod:cuda (lower-case repository path, "
                "optional :tag and @digest; no spaces, never starting with '-')")

    def __call__(self, value: Any) -> str:
        text = str(value).strip()
        match = _REFERENCE.fullmatch(text) if len(text) <= _REFERENCE_MAX else None
        # A bare 64-hex name is an image id to docker, not a repository (reference.ParseNormalizedNamed).
        if not match or len(match["name"]) > NAME_TOTAL_LENGTH_MAX or re.fullmatch(r"[a-f0-9]{64}", match["name"]):
            raise Invalid(self.expected())
        return text


@dataclass(frozen=True)
class SbatchWord:
    """A value on an #SBATCH line: sbatch splits the line at blanks, takes quotes and backslashes as
    its own quoting and an unquoted '#' as the start of a comment, so none of those may be in it."""

    def expected(self) -> str:
        return "a value without blanks, quotes, backslashes or '#'"

    def __call__(self, value: Any) -> str:
        text = str(value).strip()
        if not text or has_control(text) or any(c.isspace() or c in "'\"\\#" for c in text):
            raise Invalid(self.expected())
        return text


@dataclass(frozen=True)
class Pattern:
    """A value that must match `regex` in full (ASCII); `expected` says what that means to a person."""

    regex: str
    description: str

    def expected(self) -> str:
        return self.description

    def __call__(self, value: Any) -> str:
        text = str(value).strip()
        if not re.fullmatch(self.regex, text, re.ASCII):
            raise Invalid(self.expected())
        return text


# --- the header's command line --------------------------------------------------------------------

_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]*")


def shell_word(word: str) -> str:
    """`word` quoted for bash, in printable ASCII: shlex.quote where it is printable ASCII already,
    else ANSI-C quoting with the UTF-8 bytes of everything else as \\xHH (bash, zsh and ksh read it)."""
    if _PRINTABLE_ASCII.fullmatch(word):
        return shlex.quote(word)
    escaped = "".join("\\" + char if char in "\\'" else char if _PRINTABLE_ASCII.fullmatch(char)
                      else "".join(f"\\x{byte:02x}" for byte in _utf8(char)) for char in word)
    return f"$'{escaped}'"


def _utf8(char: str) -> bytes:
    try:
        return char.encode("utf-8", "surrogateescape")  # an undecodable byte of argv: that byte again
    except UnicodeEncodeError:
        return char.encode("utf-8", "surrogatepass")


def shell_line(argv: Sequence[str]) -> str:
    """An argv as one line of printable ASCII that bash reads back as exactly that argv."""
    return " ".join(shell_word(word) for word in argv)


# --- files a flag names -----------------------------------------------------------------------------

MAX_TEXT_FILE = 1 << 20  # a host list, a key or a known_hosts file; anything larger is not one


def read_bytes(path: str, origin: str, what: str) -> bytes:
    """A small file named by `origin` (a flag: 64, a variable: 78). A missing or unreadable file, a
    directory, a device or a FIFO (opened without waiting for a writer) or a huge file: one line naming
    the flag and the path."""
    error = error_for(origin)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise error(f"{origin}={path!r}: cannot be read ({getattr(exc, 'strerror', None) or exc}): expected {what}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{origin}={path!r}: not a regular file: expected {what}")
    with os.fdopen(fd, "rb") as file:
        try:
            data = file.read(MAX_TEXT_FILE + 1)
        except OSError as exc:
            raise error(f"{origin}={path!r}: cannot be read ({exc.strerror or exc}): expected {what}") from None
    if len(data) > MAX_TEXT_FILE:
        raise error(f"{origin}={path!r}: larger than {MAX_TEXT_FILE >> 20} MiB: expected {what}")
    return data


def read_text(path: str, origin: str, what: str) -> str:
    """read_bytes() as UTF-8, with or without a BOM; another encoding (UTF-16 names itself) is one line."""
    data = read_bytes(path, origin, what)
    error = error_for(origin)
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) or b"\0" in data:
        raise error(f"{origin}={path!r}: UTF-16 or binary data: expected {what} in UTF-8 (save it as UTF-8)")
    try:
        return data.decode("utf-8-sig")  # a BOM, as editors on Windows write one, is not part of the text
    except UnicodeDecodeError as exc:
        raise error(f"{origin}={path!r}: not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}): "
                    f"expected {what} in UTF-8") from None

