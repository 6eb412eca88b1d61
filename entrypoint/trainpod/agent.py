"""torchrun's agent, with what a container needs: node-prefixed logs, real exit codes, a shared budget.

`python -m trainpod.agent ARGS` takes exactly torchrun's arguments. torchrun itself exits 1
whatever its workers returned; here the exit code is the first failed rank's own code (earliest by
time; a signal becomes 128 + its number, as a shell reports it), so a cluster can tell a crash
from a pre-emption. torchrun restarts a failed worker group up to --max-restarts times whatever
the code; here a rank that exits 64 or 78 (a usage or configuration error) ends the job at once,
and the restarts torchrun made are written for the supervisor, which counts them against the
same budget.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from trainpod.errors import EXIT_UNAVAILABLE
from trainpod.supervise import NEVER_RESTARTED, record_worker_restarts


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


def _log(node: str, message: str) -> None:
    print(f"[node{node}] trainpod: {message}", file=sys.stderr, flush=True)


def _report(failures, node: str) -> None:
    for rank, failure in sorted(failures.items()):
        _log(node, f"rank {rank} (local rank {failure.local_rank}) {_describe(failure.exitcode)}")


def _install_agent_class(node: str) -> None:
    """Make torchrun's launcher build our agent: torch offers no hook for either change below."""
    import torch.distributed.launcher.api as launcher
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent(LocalElasticAgent):
        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if not result.is_failed():
                return result
            codes = [_exit_code(failure.exitcode) for failure in result.failures.values()]
            if any(code in NEVER_RESTARTED for code in codes):
                self._remaining_restarts = 0  # a usage or configuration error: a restart cannot help
            if self._remaining_restarts > 0:  # torchrun restarts the group next, without a word of why
                _report(result.failures, node)
                _log(node, f"restarting the worker group ({self._remaining_restarts} restart(s) left)")
            return result

        def run(self, *args, **kwargs):
            try:
                return super().run(*args, **kwargs)
            finally:
                record_worker_restarts(self._worker_group.spec.max_restarts - self._remaining_restarts)

    launcher.LocalElasticAgent = Agent


def main(argv: list[str] | None = None) -> int:
    node = os.environ.get("TRAINPOD_NODE_RANK", "?")

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    _prefix_logs(f"[node{node}] ")
    _install_agent_class(node)

    args = get_args_parser().parse_args(argv)
    try:
        run(args)
    except ChildFailedError as error:
        _report(error.failures, node)
        return _exit_code(error.get_first_failure()[1].exitcode)
    except SignalException as error:
        # torchrun has already stopped the workers; a stop request is no crash, so no traceback.
        _log(node, f"received {signal.Signals(error.sigval).name}: the workers were stopped")
        return 128 + error.sigval
    except RendezvousError as error:
        # The other nodes did not come (or the store went away): as transient as an unreachable master.
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        _log(node, f"error: rendezvous at {args.rdzv_endpoint} failed: {type(error).__name__}: {first_line}")
        return EXIT_UNAVAILABLE
    return 0


if __name__ == "__main__":
    sys.exit(main())
