"""trainpod.agent.hang: the hang watch's decision, from synthetic samples (no process, no torch)."""

import pytest

from trainpod.agent import hang
from trainpod.agent.hang import BUSY, GONE, IDLE, STOPPED, WAITING, Frame, RankView, Sample, Tracker, decide, describe

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


def test_every_rank_idle_outside_a_collective_is_a_hang_after_the_hang_timeout():
    # a one-process job, or ranks that all block outside torch.distributed: no rank waits for another, and before
    # this rule nothing was ever named (a DataParallel run asleep in its script sat there for good)
    assert decide([run(0, sleeping, 9)], 9.0, timeout=10, world_size=1) is None
    verdict = decide([run(0, sleeping, 10)], 10.0, timeout=10, world_size=1)
    assert [v.rank for v in verdict.behind] == [0] and verdict.waiting == () and verdict.stalled_for == 10.0
    assert describe(verdict, "0") == ("hang: no progress for 10s; every rank is idle, none computing or in a collective: "
                                      "rank 0 idle (no CPU, same stack) at app/data.py:9 in load_batch, step 7")
    both = decide([run(0, sleeping, 12), run(1, stopped, 12, node="1")], 12.0, timeout=10, world_size=2)
    assert [v.rank for v in both.behind] == [0, 1]
    assert "; rank 1 on node1 stopped at app/train.py:33 in main, step 7" in describe(both, "0")
    # not while one rank computes, nor while a node's ranks are not seen (its views missing), nor without the world
    assert decide([run(0, sleeping, 30), run(1, computing, 30)], 30.0, timeout=10, world_size=2) is None
    assert decide([run(0, sleeping, 30)], 30.0, timeout=10, world_size=2) is None
    assert decide([run(0, sleeping, 30)], 30.0, timeout=10) is None


def test_every_rank_idle_in_a_paced_job_is_judged_by_the_hang_timeout_not_its_pace():
    views = [paced(0, 0.1, 20, sleeping, 60), paced(1, 0.1, 20, sleeping, 60)]
    assert views[0].step_s == pytest.approx(0.1)  # a pace known, which would bound a wait for a rank at 8 s
    assert decide(views, 20 + 39, timeout=40, world_size=2) is None
    verdict = decide(views, 20 + 40.5, timeout=40, world_size=2)
    assert verdict is not None and verdict.limit == 40 and verdict.step_s == 0
    from trainpod.agent.hangwatch import verdict_from_json, verdict_to_json

    assert describe(verdict_from_json(verdict_to_json(verdict)), "0") == describe(verdict, "0")


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
    ((Frame("_GeneratorContextManager.__exit__", "/usr/lib/python3.11/contextlib.py", 144),
      Frame("threading.wait", "/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py", 320),
      Frame("train", "/opt/trainpod/venv/lib/python3.11/site-packages/trainpod/examples/harness.py", 550)),
     ("examples/harness.py:550 in train", "")),  # Python's own library is skipped, an installed package is not
    ((Frame("sleep", "/usr/lib/python3.11/selectors.py", 4),), ("python3.11/selectors.py:4 in sleep", "")),  # only it
    ((), ("", "")),
])
def test_position_names_the_callers_frame_and_the_torch_function(stack, expected):
    assert hang.position(stack) == expected


# --- what the launch plan sets ----------------------------------------------------------------------


def test_the_plan_puts_the_dumps_in_the_output_and_the_agent_the_pipe_beside_the_progress_files(tmp_path):
    assert hang.plan_env({"TRAINPOD_OUTPUT_DIR": "/out"}) == {"TORCH_FR_DUMP_TEMP_FILE": "/out/hangs/flight-recorder/rank"}
    assert hang.pipe_env("/tmp/sup/progress", {}) == {"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/tmp/sup/progress/nccl-dump-"}
    # The agent's progress directory: in the supervisor's directory, which outlives an agent.
    from trainpod.agent import policy

    assert policy.progress_dir({"TRAINPOD_SUPERVISOR_DIR": str(tmp_path)}) == str(tmp_path / "progress")


def test_the_users_own_variables_stay():
    assert hang.plan_env({"TORCH_FR_DUMP_TEMP_FILE": "/mine/fr_"}) == {}
    assert hang.pipe_env("/p", {"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/mine/pipe"}) == {}


# --- the adaptive bound: the job's pace -------------------------------------------------------------


def paced(rank: int, step_s: float, stop_at: float, how, seconds: int, node: str = "0") -> RankView:
    """A rank that reports a step every `step_s` (its own timestamps) until `stop_at`, then behaves as `how`(t);
    looked at every 0.5 s."""
    tracker = Tracker(rank, node)
    view = None
    for i in range(int(seconds * 2) + 1):
        t = i / 2
        if t < stop_at:
            step = int(t / step_s)
            view = tracker.update(Sample(rank, rank, t, "R", 1.0 + t, step, step_time=step * step_s))
        else:
            state, cpu, _, stack = how(t)
            step = int(stop_at / step_s)
            view = tracker.update(Sample(rank, rank, t, state, cpu, step, stack, step_time=step * step_s))
    return view


def test_a_paced_job_is_judged_by_its_pace_not_the_hang_timeout():
    views = [paced(0, 0.1, 20, waiting(), 40), paced(1, 0.1, 20, stopped, 40)]
    assert views[0].step_s == pytest.approx(0.1) and views[1].step_s == pytest.approx(0.1)
    assert hang.limit(views, 120) == (hang.ADAPTIVE_FLOOR_S, pytest.approx(0.1))  # 5 x 0.1 s is under the floor
    assert decide(views, 20 + hang.ADAPTIVE_FLOOR_S - 1, timeout=120) is None
    verdict = decide(views, 20 + hang.ADAPTIVE_FLOOR_S + 0.5, timeout=120)
    assert verdict is not None and [v.rank for v in verdict.behind] == [1] and verdict.limit == hang.ADAPTIVE_FLOOR_S
    assert describe(verdict, "0").startswith("hang: no progress for 8s (the job's pace: steps of 0.1s; bound 8s); behind:")
    # slow steps: 5 of them
    slow = [paced(0, 4.0, 40, waiting(), 60), paced(1, 4.0, 40, stopped, 60)]
    assert hang.limit(slow, 120) == (20.0, pytest.approx(4.0))
    assert hang.limit(slow, 15) == (15, 0.0)  # --hang-timeout is the most it waits
    assert decide(slow, 59, timeout=120) is None and decide(slow, 61, timeout=120) is not None


def test_without_every_ranks_pace_the_hang_timeout_is_the_bound():
    reports = paced(1, 0.1, 20, stopped, 40)
    silent = run(0, waiting(), 40)  # reports no steps: a script without trainpod.train.progress
    assert silent.step_s == 0 and hang.limit([silent, reports], 120) == (120, 0.0)
    assert decide([silent, reports], 39, timeout=120) is None
    few = paced(1, 0.1, 1, stopped, 40)  # stopped after too few looks saw it advance
    assert few.step_s == 0
    views = [paced(0, 0.1, 20, waiting(), 40), paced(1, 0.1, 20, stopped, 40)]
    assert decide(views, 40, timeout=120, world_size=3) is None  # a node's views missing: its pace unknown


def test_a_rank_in_uninterruptible_io_is_bounded_by_the_hang_timeout_only():
    writing = paced(1, 0.1, 20, lambda t: ("D", 3.0, 7, SLEEP), 60)  # a write to slow shared storage
    assert writing.kind == IDLE and writing.io_wait and writing.step_s > 0
    views = [paced(0, 0.1, 20, waiting(), 60), writing]
    assert hang.limit(views, 120) == (120, 0.0) and decide(views, 60, timeout=120) is None


def test_a_new_attempt_that_starts_over_at_step_0_keeps_a_sane_pace():
    tracker = Tracker(0, "0")
    for t, step in [(0, 0), (1, 10), (2, 20), (3, 30), (4, 0), (5, 10), (6, 20)]:
        tracker.update(Sample(0, 0, float(t), "R", float(t), step, step_time=float(t)))
    assert tracker.step_s == pytest.approx(0.1)


def test_the_pace_crosses_nodes_with_the_view():
    view = paced(3, 0.25, 20, waiting(), 30, node="1")
    assert RankView.from_dict(view.to_dict()) == view and view.step_s == pytest.approx(0.25)


def test_the_verdict_crosses_nodes_with_its_bound():
    from trainpod.agent.hangwatch import verdict_from_json, verdict_to_json

    views = [paced(0, 0.1, 20, waiting(), 40), paced(1, 0.1, 20, stopped, 40)]
    verdict = decide(views, 30, timeout=120)
    assert verdict_from_json(verdict_to_json(verdict)) == verdict
    assert describe(verdict_from_json(verdict_to_json(verdict)), "1") == describe(verdict, "1")


def test_a_group_that_forms_is_bounded_by_the_hang_timeout():
    # in-process recovery: a replacement waits in init_process_group while the survivors re-form in trainpod's code
    recovering = (Frame("recover", "/opt/venv/lib/python3.11/site-packages/trainpod/train/inprocess.py", 200),
                  Frame("main", "/app/train.py", 50))
    views = [paced(0, 0.1, 20, waiting(INIT), 60), paced(1, 0.1, 20, lambda t: ("S", 3.0, 7, recovering), 60)]
    assert hang.limit(views[:1] + [paced(1, 0.1, 20, stopped, 60)], 120) == (120, 0.0)  # init_process_group
    assert hang.limit(views, 120) == (120, 0.0) and decide(views, 60, timeout=120) is None
