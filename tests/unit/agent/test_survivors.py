"""trainpod.agent.survivors on torch's real process contexts: after a rank crashed, a peer that ignores SIGTERM (as a
rank blocked in a collective does) is SIGKILLed within two graces, not torch's 30 s; after an orderly stop (143) the
peers keep torch's bound and end on their own."""

import signal
import sys
import time

import pytest

from trainpod.agent import survivors

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="torch's elastic process contexts: POSIX signals")

GRACE_S = 0.3
# The peer, which ignores SIGTERM, writes its mark and ends on its own this long after rank 0: beyond two graces,
# within torch's 30 s. Killed, it writes none.
CRASHED_PEER_S = 15.0
ORDERLY_PEER_S = 1.5

PEER = """
import pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: None)
time.sleep(0.5)
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    time.sleep(0.02)
pathlib.Path(sys.argv[1]).write_text("ended on its own")
sys.exit(7)
"""


def _rank(first_code: int, mark: str, peer_s: str) -> None:
    """Local rank 0 exits with `first_code` after 0.5 s; local rank 1 runs PEER."""
    import os

    if os.environ["LOCAL_RANK"] == "0":
        time.sleep(0.5)
        sys.exit(first_code)
    sys.argv = ["peer", mark, peer_s]
    exec(PEER)


def _run(kind: str, first_code: int, peer_s: float, tmp_path) -> dict[int, int]:
    """Both ranks in torch's process context of `kind`, bounded; the exit codes torch reports."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    mark = str(tmp_path / "peer-ended")
    envs = {rank: {"LOCAL_RANK": str(rank)} for rank in range(2)}
    logs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"))
    if kind == "function":
        args = {rank: (first_code, mark, str(peer_s)) for rank in range(2)}
        pcontext = start_processes("survivors", _rank, args, envs, logs, start_method="fork")
    else:
        first = f"import time, sys; time.sleep(0.5); sys.exit({first_code})"
        pcontext = start_processes("survivors", sys.executable, {0: ("-c", first), 1: ("-c", PEER, mark, str(peer_s))},
                                   envs, logs)
    survivors.bound(pcontext, GRACE_S)
    try:
        while (result := pcontext.wait(timeout=0)) is None:
            time.sleep(0.05)
    finally:
        pcontext.close(timeout=1)
    return {rank: failure.exitcode for rank, failure in result.failures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["function", "command"])
def test_a_crashed_ranks_peer_that_ignores_sigterm_is_killed(kind, tmp_path):
    codes = _run(kind, 1, CRASHED_PEER_S, tmp_path)
    assert codes[0] == 1 and codes.get(1) in (-signal.SIGKILL, None), codes  # torch keeps the first failure at least
    assert not (tmp_path / "peer-ended").exists()  # torch alone waits 30 s: the peer would have ended on its own


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["function", "command"])
def test_after_an_orderly_stop_the_peers_keep_torchs_bound_and_end_on_their_own(kind, tmp_path):
    codes = _run(kind, 143, ORDERLY_PEER_S, tmp_path)
    assert codes[0] == 143, codes
    assert (tmp_path / "peer-ended").exists()  # not cut at the crash grace


@pytest.mark.parametrize(("codes", "crash"), [((None, None), False), ((0, None), False), ((143, None), False),
                                              ((-signal.SIGTERM, 0), False), ((1, None), True), ((-signal.SIGKILL, 143), True)])
def test_which_exit_codes_are_a_crash(codes, crash):
    assert survivors.crashed(codes) is crash
