"""trainpod.hang: the hang watch's decision, from synthetic samples (no process, no torch)."""

import pytest

from trainpod import hang
from trainpod.hang import BUSY, GONE, IDLE, STOPPED, WAITING, Frame, RankView, Sample, Tracker, decide, describe

SITE = "/venv/lib/python3.11/site-packages/torch/distributed/"
ALL_REDUCE = (Frame("all_reduce", SITE + "distributed_c10d.py", 3252),
              Frame("_exception_logger.<locals>.wrapper", SITE + "c10d_logger.py", 83),
              Frame("main", "/app/train.py", 40))
BARRIER = (Frame("barrier", SITE + "distributed_c10d.py", 5356),
           Frame("_exception_logger.<locals>.wrapper", SITE + "c10d_logger.py", 83),
           Frame("main", "/app/train.py", 47))
INIT = (Frame("_create_c10d_store", SITE + "rendezvous.py", 199),
        Frame("init_process_group", SITE + "distributed_c10d.py", 1892),
        Frame("_time_logger.<locals>.wrapper", SITE + "c10d_logger.py", 97),
        Frame("main", "/app/train.py", 12))
BACKWARD = (Frame("_engine_run_backward", "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", 979),
            Frame("backward", "/venv/lib/python3.11/site-packages/torch/autograd/__init__.py", 395),
            Frame("Tensor.backward", "/venv/lib/python3.11/site-packages/torch/_tensor.py", 623),
            Frame("train", "/app/train.py", 70))
SLEEP = (Frame("load_batch", "/app/data.py", 9), Frame("main", "/app/train.py", 30))
COMPUTE = (Frame("conv2d", "/venv/lib/python3.11/site-packages/torch/nn/modules/conv.py", 543),
           Frame("main", "/app/train.py", 33))


def feed(tracker: Tracker, looks) -> RankView:
    """looks: (time, state, cpu, step, stack) tuples; the last view."""
    view = None
    for time, state, cpu, step, stack in looks:
        view = tracker.update(Sample(tracker.rank, tracker.rank, time, state, cpu, step, stack))
    return view


def run(rank: int, pattern, seconds: int, node: str = "0") -> RankView:
    """A rank sampled once a second for `seconds`; pattern(t) -> (state, cpu, step, stack)."""
    return feed(Tracker(rank, node), [(float(t), *pattern(t)) for t in range(seconds + 1)])


def waiting(stack=ALL_REDUCE):
    return lambda t: ("S", 5.0, 7, stack)


def sleeping(t):
    return ("S", 3.0, 7, SLEEP)


def stopped(t):
    return ("T", 4.0, 7, COMPUTE)


def computing(t):
    return ("R", 2.0 + 0.9 * t, 7, COMPUTE)


def training(t):
    return ("R", 2.0 + 0.5 * t, t, COMPUTE)


# --- one rank's view --------------------------------------------------------------------------------


def test_a_rank_that_uses_cpu_or_reports_steps_is_busy():
    assert run(0, computing, 5).kind == BUSY
    assert run(0, lambda t: ("S", 1.0, t, SLEEP), 5).kind == BUSY  # a new step every look, no CPU to speak of


def test_a_rank_idle_in_a_collective_is_waiting_since_its_first_idle_interval():
    view = run(0, lambda t: ("R", 0.5 * t, t, COMPUTE) if t < 5 else ("S", 2.5, 5, ALL_REDUCE), 30)
    assert view.kind == WAITING and view.call == "all_reduce" and view.where == "app/train.py:40 in main"
    assert view.since == 5.0 and view.step == 5


def test_waiting_in_init_process_group_and_in_ddps_backward():
    assert run(0, waiting(INIT), 3).call == "init_process_group"
    view = run(0, waiting(BACKWARD), 3)
    assert view.kind == WAITING and view.call == "backward" and view.where == "app/train.py:70 in train"


def test_a_rank_idle_elsewhere_is_idle_and_a_stopped_one_stopped():
    assert run(1, sleeping, 3).kind == IDLE
    view = run(1, stopped, 3)
    assert (view.kind, view.where, view.since) == (STOPPED, "app/train.py:33 in main", 0.0)


def test_a_rank_that_exited_is_gone():
    tracker = Tracker(1, "0")
    feed(tracker, [(0.0, "R", 1.0, 3, None)])
    view = tracker.update(Sample(1, 1, 1.0, "", 0.0, 3, exitcode=0))
    assert (view.kind, view.detail, view.since) == (GONE, "exited with 0", 0.0)


def test_the_clock_restarts_when_the_stack_moves_or_the_rank_computes():
    tracker = Tracker(0, "0")
    feed(tracker, [(0.0, "S", 1.0, 2, None), (1.0, "S", 1.0, 2, SLEEP), (5.0, "S", 1.0, 2, None)])
    assert tracker.view.since == 0.0
    feed(tracker, [(6.0, "S", 1.0, 2, SLEEP[1:])])  # a new stack: it moved between two looks
    assert tracker.view.since == 5.0
    feed(tracker, [(7.0, "R", 3.0, 2, None), (8.0, "S", 3.0, 2, SLEEP)])
    assert tracker.view.since == 7.0


def test_a_stack_is_wanted_for_a_rank_not_busy_and_then_only_when_it_is_old():
    tracker = Tracker(0, "0")
    assert not tracker.wants_stack("S", 1.0, 3, 0.0, refresh=2.0)  # first look: nothing to compare
    feed(tracker, [(0.0, "S", 1.0, 3, None)])
    assert not tracker.wants_stack("R", 2.0, 3, 1.0, refresh=2.0)  # it computed
    assert tracker.wants_stack("S", 1.0, 3, 1.0, refresh=2.0)
    feed(tracker, [(1.0, "S", 1.0, 3, SLEEP)])
    assert not tracker.wants_stack("S", 1.0, 3, 2.0, refresh=2.0)
    assert tracker.wants_stack("S", 1.0, 3, 3.0, refresh=2.0)
    assert tracker.wants_stack("T", 1.0, 3, 3.0, refresh=2.0)


def test_a_stack_that_cannot_be_read_makes_an_idle_rank_never_a_waiting_one():
    tracker = Tracker(0, "0")
    feed(tracker, [(0.0, "S", 1.0, 3, None)])
    view = tracker.update(Sample(0, 0, 1.0, "S", 1.0, 3, None, stack_error="py-spy: Permission denied"))
    assert view.kind == IDLE and "Permission denied" in view.detail


# --- the job's verdict ------------------------------------------------------------------------------


def test_a_stopped_rank_with_a_waiting_one_is_a_hang_after_the_timeout_and_not_before():
    views = [run(0, waiting(), 12), run(1, stopped, 12)]
    assert decide(views, 9.0, timeout=10) is None
    verdict = decide(views, 12.0, timeout=10)
    assert [v.rank for v in verdict.behind] == [1] and [v.rank for v in verdict.waiting] == [0]
    assert verdict.stalled_for == 12.0


def test_the_hang_starts_when_both_a_waiting_and_a_behind_rank_exist():
    late_stop = run(1, lambda t: computing(t) if t < 6 else stopped(t), 20)
    views = [run(0, waiting(), 20), late_stop]
    assert decide(views, 14.0, timeout=10) is None  # stopped from t=5 only
    assert decide(views, 15.0, timeout=10).stalled_for == 10.0


def test_sleeping_before_init_while_the_others_wait_in_it():
    verdict = decide([run(0, waiting(INIT), 15), run(1, sleeping, 15), run(2, waiting(INIT), 15)], 15.0, timeout=10)
    assert [v.rank for v in verdict.behind] == [1] and [v.rank for v in verdict.waiting] == [0, 2]
    line = describe(verdict, here="0")
    assert "\n" not in line
    assert "behind: rank 1 idle (no CPU, same stack) at app/data.py:9 in load_batch, step 7" in line
    assert "ranks 0, 2 wait for it in init_process_group" in line


def test_a_long_compute_phase_is_never_a_hang_even_with_ranks_waiting_for_it():
    views = [run(0, computing, 300), run(1, waiting(), 300), run(2, waiting(), 300)]
    assert decide(views, 300.0, timeout=10) is None


def test_a_long_data_phase_without_a_waiting_rank_is_never_a_hang():
    views = [run(0, sleeping, 300), run(1, sleeping, 300), run(2, computing, 300)]
    assert decide(views, 300.0, timeout=10, world_size=3) is None
    assert decide([run(0, training, 300), run(1, training, 300)], 300.0, timeout=10, world_size=2) is None


def test_a_rank_that_exited_while_the_others_wait_is_named():
    gone = Tracker(1, "0")
    feed(gone, [(0.0, "R", 1.0, 6, None)])
    gone.update(Sample(1, 1, 1.0, "", 0.0, 6, exitcode=0))
    gone.update(Sample(1, 1, 20.0, "", 0.0, 6, exitcode=0))
    verdict = decide([run(0, waiting(), 20), gone.view], 20.0, timeout=10)
    assert "rank 1 exited with 0, step 6" in describe(verdict, "0")


def test_a_skipped_collective_every_rank_waiting_names_the_odd_one_out():
    views = [run(0, waiting(), 15), run(1, waiting(), 15), run(2, waiting(), 15, node="1"),
             run(3, waiting(BARRIER), 15, node="1")]
    assert decide(views, 15.0, timeout=10) is None  # the world size unknown: a rank may be elsewhere
    assert decide(views[:3], 15.0, timeout=10, world_size=4) is None  # one rank's view missing
    verdict = decide(views, 15.0, timeout=10, world_size=4)
    assert verdict.mismatch and [v.rank for v in verdict.behind] == [3]
    line = describe(verdict, here="0")
    assert "ranks 0, 1, 2 in all_reduce at app/train.py:40 in main; rank 3 in barrier at app/train.py:47 in main" in line
    assert line.endswith("out of step: rank 3 on node1 (step 7)")


def test_a_tie_names_every_rank_with_its_collective():
    verdict = decide([run(0, waiting(), 15), run(1, waiting(BARRIER), 15)], 15.0, timeout=10, world_size=2)
    assert verdict.mismatch and [v.rank for v in verdict.behind] == [0, 1]


def test_a_rank_on_another_node_is_named_with_its_node():
    local = [run(0, waiting(BACKWARD), 15), run(1, waiting(BACKWARD), 15)]
    remote = [RankView.from_dict(run(2, stopped, 15, node="1").to_dict()), run(3, waiting(BACKWARD), 15, node="1")]
    verdict = decide(local + remote, 15.0, timeout=10, world_size=4)
    assert [v.rank for v in verdict.behind] == [2]
    assert "behind: rank 2 on node1 stopped at app/train.py:33 in main, step 7; ranks 0, 1, 3 wait for it in backward" \
        in describe(verdict, here="0")
    assert "rank 2 stopped" in describe(verdict, here="1")


@pytest.mark.parametrize("stack,expected", [
    (ALL_REDUCE, ("app/train.py:40 in main", "all_reduce")),
    (INIT, ("app/train.py:12 in main", "init_process_group")),
    (SLEEP, ("app/data.py:9 in load_batch", "")),
    ((), ("", "")),
])
def test_position_names_the_callers_frame_and_the_torch_function(stack, expected):
    assert hang.position(stack) == expected


# --- what the launch plan sets ----------------------------------------------------------------------


def test_the_plan_puts_the_progress_files_in_the_supervisors_directory_and_the_dumps_in_the_output():
    env = hang.plan_env({"TRAINPOD_SUPERVISOR_DIR": "/tmp/sup", "TRAINPOD_OUTPUT_DIR": "/out"}, 10)
    assert env == {"TRAINPOD_HANG_TIMEOUT": "10", "TRAINPOD_PROGRESS_DIR": "/tmp/sup/progress",
                   "TORCH_FR_DUMP_TEMP_FILE": "/out/hangs/flight-recorder/rank",
                   "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/tmp/sup/progress/nccl-dump-"}


def test_the_users_own_variables_stay_and_without_a_supervisor_the_agent_picks_the_directory():
    env = hang.plan_env({"TORCH_FR_DUMP_TEMP_FILE": "/mine/fr_"}, 0)
    assert env == {"TRAINPOD_HANG_TIMEOUT": "0"}
