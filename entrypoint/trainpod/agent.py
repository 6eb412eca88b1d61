"""torchrun's agent, with two changes a container needs: node-prefixed log lines, real exit codes.

`python -m trainpod.agent ARGS` takes exactly torchrun's arguments. torchrun itself exits 1
whatever its workers returned; here the exit code is the first failed rank's own code (earliest by time) (a
signal becomes 128 + its number, as a shell reports it), so a cluster can tell a crash from a
pre-emption.
"""

from __future__ import annotations

import logging
import os
import signal
import sys


def _exit_code(exitcode: int) -> int:
    return 128 - exitcode if exitcode < 0 else exitcode


def _describe(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with {exitcode}"


class _PrefixedFormatter(logging.Formatter):
    """Puts the node prefix in front of every line another formatter produces."""

    def __init__(self, inner: logging.Formatter | None, prefix: str):
        super().__init__()
        self.inner = inner or logging.Formatter()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(self.prefix + line for line in self.inner.format(record).splitlines())


def _prefix_logs(prefix: str) -> None:
    logging.basicConfig(format="%(name)s %(levelname)s: %(message)s", stream=sys.stderr)
    # torch installs handlers of its own ("torch", "torch.distributed"), so wrap every handler.
    loggers = [logging.getLogger()] + [
        logger for logger in logging.root.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            handler.setFormatter(_PrefixedFormatter(handler.formatter, prefix))


def main(argv: list[str] | None = None) -> int:
    node = os.environ.get("TRAINPOD_NODE_RANK", "?")

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    _prefix_logs(f"[node{node}] ")

    args = get_args_parser().parse_args(argv)
    try:
        run(args)
    except ChildFailedError as error:
        failures = sorted(error.failures.items())
        for rank, failure in failures:
            print(
                f"[node{node}] trainpod: rank {rank} (local rank {failure.local_rank}) {_describe(failure.exitcode)}",
                file=sys.stderr,
                flush=True,
            )
        return _exit_code(error.get_first_failure()[1].exitcode)
    except SignalException as error:
        # torchrun has already stopped the workers; a stop request is no crash, so no traceback.
        print(f"[node{node}] trainpod: received {signal.Signals(error.sigval).name}: the workers were stopped",
              file=sys.stderr, flush=True)
        return 128 + error.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main())
