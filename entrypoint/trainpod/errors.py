"""The one-line error type (the exit codes are named in trainpod.contract).

Every failure a user can cause ends here: one line on stderr that names the flag, variable or
file and what was expected, and an exit code from the BSD sysexits family, so that schedulers
and supervisors can tell "retrying will not help" (64, 73, 78) from "try again later" (69).
"""

from __future__ import annotations

import errno

from trainpod.contract import EXIT_CANTCREAT, EXIT_CONFIG, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE  # noqa: F401 (the codes' home)

# errno values that say a write failed for lack of space (73 where a write must succeed to go on)
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class TrainpodError(Exception):
    """An error the user can fix; printed as one line, never as a traceback."""

    exit_code = 1
    node: str | None = None  # the node's label once it is known: the line then starts `[node1] trainpod: error:`

    def __init__(self, message: str, *, exit_code: int | None = None):
        super().__init__(message)
        self.message = message
        if exit_code is not None:
            self.exit_code = exit_code  # this one error's code, where the class's default does not fit

    def __str__(self) -> str:
        return self.message


class UsageError(TrainpodError):
    exit_code = EXIT_USAGE


class ConfigError(TrainpodError):
    exit_code = EXIT_CONFIG


class UnreachableError(TrainpodError):
    exit_code = EXIT_UNAVAILABLE


def error_for(origin: str) -> type[TrainpodError]:
    """The error type for a bad value: a flag's is a usage error (fix the command), anything else's
    (a variable, a file) a configuration error (fix the job)."""
    return UsageError if origin.startswith("--") else ConfigError


def invalid(origin: str, value: object, expected: str) -> TrainpodError:
    """The one-line error for `origin`=`value`: "--nnodes='x': expected an integer from 1 to 65536"."""
    return error_for(origin)(f"{origin}={value!r}: expected {expected}")
