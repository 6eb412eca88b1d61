"""The soak test's short form (bench/soak.py, issue 29; `make soak` is the long one): the 2-node compose job with
--recovery restart and a warm start, --rejoin-timeout 5 and --hang-timeout 10, takes two faults, a checkpoint write
killed then a SIGKILL of a rank on node1. After each it must train on for twice the longest timer with no trouble on
either node, and end with exit 0 and the uninterrupted run's weights.

It catches a timer that a recovery leaves behind: with the agent's job control closed at each worker-group restart
(the bug of issue 29), node1 declared the master lost 3.9 s after the first recovery and the job ended 143/69. The
reference run (unpaced), then the faulted one, 192 steps each.
"""

import sys

import pytest

from fixtures.docker_env import REPO

sys.path.append(str(REPO / "bench"))
import soak  # noqa: E402  (bench/soak.py)

pytestmark = [pytest.mark.docker, pytest.mark.slow]

MINUTES = 1.25  # 192 steps of at least 0.4 s (soak.STEP_S): the failpoint at step 12, SETTLE_S, the kill, 1.5 SETTLE_S
# and 16 s to spare at 2.5 steps a second at most (fewer under the load of other jobs: the job then lasts longer)


# The straggler watch off: beside other tests on a 2-core host, one node's ranks can do their own work half as fast again
# as the other's for a minute while the job keeps its pace (seen after a recovery: node 1 named a straggler, a line
# the soak counts as trouble). The watch is right to name that; `make soak`, on a machine of its own, keeps it.
SETTINGS = {"TRAINPOD_STRAGGLER_WINDOW": "0"}


def test_training_goes_on_past_every_timer_after_each_fault(docker_ready, tmp_path):
    (result,) = soak.soak(MINUTES, [soak.CONFIGS["restart/warm-on"]], tmp_path,
                          cycle=("kill-rank-node1",), max_faults=2, settings=SETTINGS)
    assert result.ok, f"{result.line()}\nlogs: {tmp_path}"
    assert [fault.kind for fault in result.faults] == [soak.CHECKPOINT_WRITE, "kill-rank-node1"], result.line()
    for fault in result.faults:
        assert len(fault.resumes) == 1, (fault, result.line())
        assert fault.clean_s >= soak.SETTLE_S >= 2 * max(soak.REJOIN_S, soak.HANG_S), (fault, result.line())
