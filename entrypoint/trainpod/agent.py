"""torchrun's agent, with what a container needs: node-prefixed logs, real exit codes, a shared budget.

`python -m trainpod.agent ARGS` takes exactly torchrun's arguments. torchrun itself exits 1
whatever its workers returned; here the exit code is the first failed rank's own code (earliest by
time; a signal becomes 128 + its number, as a shell reports it), so a cluster can tell a crash
from a pre-emption. torchrun restarts a failed worker group up to --max-restarts times whatever
the code; here a rank that exits 64 or 78 (a usage or configuration error) ends the job at once,
and the restarts torchrun made are written for the supervisor, which counts them against the
same budget.

It also runs the hang watch (trainpod.hangwatch, --hang-timeout): a stalled worker group is
restarted as a failure, and ends the job with 124 when no restart is left.

torch offers no hook for these changes, so the agent relies on some of torch's private API:
`torch.distributed.launcher.api.LocalElasticAgent` (replaced by a subclass), and in the subclass
`_monitor_workers()`, `_start_workers()`, `_shutdown()`, `_remaining_restarts` and `_worker_group`. Checked with torch 2.13.0
(CHECKED_WITH); `torch_internals_missing()` lists what a newer torch no longer has, and a unit test
(tests/unit/test_agent.py) fails with that list before an upgrade can break a job.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from trainpod import hangwatch, log
from trainpod.errors import EXIT_UNAVAILABLE
from trainpod.hang import EXIT_HANG
from trainpod.supervise import NEVER_RESTARTED, record_worker_restarts

CHECKED_WITH = ("2.13.0",)  # torch versions the private API below was read and tested against


def torch_internals_missing() -> list[str]:
    """What of torch's private API the agent uses is missing from the installed torch ([] if nothing)."""
    import torch.distributed.launcher.api as launcher
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    missing = []
    if getattr(launcher, "LocalElasticAgent", None) is not LocalElasticAgent:
        missing.append("torch.distributed.launcher.api.LocalElasticAgent (the class the launcher builds)")
    for method in ("_monitor_workers", "_start_workers", "_shutdown"):  # the last two: the hang watch's hooks
        if not callable(getattr(LocalElasticAgent, method, None)):
            missing.append(f"LocalElasticAgent.{method}()")
    try:
        spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=None, entrypoint="true", max_restarts=2)
        agent = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs())
    except Exception as exc:  # a changed constructor: nothing below can be checked
        return [*missing, f"LocalElasticAgent(spec, logs_specs=...) ({type(exc).__name__}: {exc})"]
    if getattr(agent, "_remaining_restarts", None) != 2:
        missing.append("LocalElasticAgent._remaining_restarts (the restarts left)")
    if getattr(getattr(getattr(agent, "_worker_group", None), "spec", None), "max_restarts", None) != 2:
        missing.append("LocalElasticAgent._worker_group.spec.max_restarts")
    return missing


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


def _report(failures, say: log.Log) -> None:
    for rank, failure in sorted(failures.items()):
        what = f"was stopped by the hang watch ({EXIT_HANG})" if hangwatch.is_hang(failure) else _describe(failure.exitcode)
        say(f"rank {rank} (local rank {failure.local_rank}) {what}")


def _install_agent_class(say: log.Log, watch: hangwatch.Watch | None = None) -> None:
    """Make torchrun's launcher build our agent: torch offers no hook for the changes below."""
    import torch.distributed.launcher.api as launcher
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent(hangwatch.WatchedAgent, LocalElasticAgent):
        hang_watch = watch

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if not result.is_failed() or hangwatch.said(result):  # a hang: its line said what comes next
                return result
            codes = [_exit_code(failure.exitcode) for failure in result.failures.values()]
            if any(code in NEVER_RESTARTED for code in codes):
                self._remaining_restarts = 0  # a usage or configuration error: a restart cannot help
            if self._remaining_restarts > 0:  # torchrun restarts the group next, without a word of why
                _report(result.failures, say)
                say(f"restarting the worker group ({self._remaining_restarts} restart(s) left)")
            return result

        def run(self, *args, **kwargs):
            try:
                return super().run(*args, **kwargs)
            finally:
                record_worker_restarts(self._worker_group.spec.max_restarts - self._remaining_restarts)

    launcher.LocalElasticAgent = Agent


def _without_unknown_shutdown_timeout(parser, argv: list[str], say: log.Log) -> list[str]:
    """torchrun's --shutdown-timeout (the wait between SIGTERM and SIGKILL of the workers) came with
    torch 2.13; an older torch keeps its fixed 30 s, and the flag is left out rather than refused."""
    if "--shutdown-timeout" not in argv or "--shutdown-timeout" in parser.format_usage():
        return argv
    at = argv.index("--shutdown-timeout")
    say(f"warning: this torch has no --shutdown-timeout: the ranks get its fixed 30 s after SIGTERM, not {argv[at + 1]} s")
    return argv[:at] + argv[at + 2 :]


def main(argv: list[str] | None = None) -> int:
    node = log.node_from_env() or "?"
    say = log.writer(node)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    _prefix_logs(log.tag(node) + " ")
    watch = hangwatch.Watch.from_env(node, say)  # --hang-timeout (TRAINPOD_HANG_TIMEOUT), None when 0
    if watch is not None:
        os.environ.update(watch.environment())  # the ranks inherit the agent's environment
    _install_agent_class(say, watch)

    parser = get_args_parser()
    argv = _without_unknown_shutdown_timeout(parser, sys.argv[1:] if argv is None else argv, say)
    args = parser.parse_args(argv)
    try:
        run(args)
    except ChildFailedError as error:
        _report(error.failures, say)
        return _exit_code(error.get_first_failure()[1].exitcode)
    except SignalException as error:
        # torchrun has already stopped the workers; a stop request is no crash, so no traceback.
        say(f"received {signal.Signals(error.sigval).name}: the workers were stopped")
        return 128 + error.sigval
    except RendezvousError as error:
        # The other nodes did not come (or the store went away): as transient as an unreachable master.
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        say(f"error: rendezvous at {args.rdzv_endpoint} failed: {type(error).__name__}: {first_line}")
        return EXIT_UNAVAILABLE
    return 0


if __name__ == "__main__":
    sys.exit(main())
