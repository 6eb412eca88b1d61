"""Text from outside (variables, flags, files) as it may be shown or written: one line, nothing hidden.

An error line quotes values; a job file carries them. A value with a line break would make a second
line (of a message, of a YAML document, of a script), and a lone surrogate (an undecodable byte of
the environment) cannot be written as UTF-8 at all; both kinds are found by has_control() and
written visibly by printable().
"""

from __future__ import annotations

import unicodedata

__all__ = ["CONTROL_EXPECTED", "has_control", "number", "printable"]

# Cc: C0, DEL and C1 (NEL among them); Zl/Zp: U+2028/U+2029, which YAML and str.splitlines() read as line
# breaks; Cs: a lone surrogate.
_REFUSED = frozenset(("Cc", "Cs", "Zl", "Zp"))
CONTROL_EXPECTED = "text without control characters (newline, tab, NUL, ...)"


def has_control(text: str) -> bool:
    return any(unicodedata.category(char) in _REFUSED for char in text)


def printable(text: str) -> str:
    """`text` as one line of printable ASCII: every other character escaped as Python writes it (\\n, \\xfc)."""
    return "".join(char if " " <= char <= "~" else ascii(char)[1:-1] for char in text)


def number(value: float) -> str:
    """A number as a command's argument: the shortest text that reads back as exactly it (1234567, 12.25), where
    format's g would round (1.23457e+06)."""
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**53 else repr(float(value))
