"""The restart budget: restarts without progress, the same failure twice, one budget for both layers."""

import pytest

from trainpod.contract import PROGRESS_DIR_VAR
from trainpod.supervisor.restarts import Budget, Failure, describe_code, read_where, reported, traceback_where
from trainpod.train import progress

TRACEBACK = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/app/train.py", line 30, in <module>
[rank1]:     main()
[rank1]:   File "/app/train.py", line 12, in main
[rank1]:     step(batch)
[rank1]:     ^^^^^^^^^^^
[rank1]: ValueError: bad batch 7
"""


def test_the_innermost_frame_and_type_of_the_last_traceback():
    assert traceback_where(TRACEBACK) == "ValueError in /app/train.py:12 (main)"
    assert traceback_where(TRACEBACK.replace("[rank1]: ", "")) == "ValueError in /app/train.py:12 (main)"
    chained = TRACEBACK + "\nDuring handling of the above exception, another exception occurred:\n\n" + TRACEBACK.replace(
        "ValueError: bad batch 7", "torch.distributed.DistBackendError: lost").replace("line 12", "line 40")
    assert traceback_where(chained) == "torch.distributed.DistBackendError in /app/train.py:40 (main)"
    assert traceback_where("Killed\n") == "" and traceback_where("Traceback (most recent call last):\n") == ""


def test_a_rank_log_is_read_from_its_end(tmp_path):
    log = tmp_path / "stderr.log"
    log.write_text("noise\n" * 50_000 + TRACEBACK)
    assert read_where(log) == "ValueError in /app/train.py:12 (main)"
    assert read_where(tmp_path / "missing.log") == "" and read_where(None) == ""


def test_codes_read_as_a_shell_says_them():
    assert describe_code(3) == "exited with 3" and describe_code(137) == "exited with 137 (SIGKILL)"


def fail(code=1, committed=-1, step=-1, where="", ran_s=1.0):
    return Failure(code=code, committed=committed, step=step, where=where, ran_s=ran_s, who="rank 0")


def test_codes_that_are_never_restarted():
    for code, why in ((64, "a usage error"), (73, "a checkpoint cannot be written"), (78, "a configuration error"),
                      (143, "stopped by SIGTERM")):
        budget = Budget(3, 600)
        decision = budget.decide(fail(code))
        assert not decision.restart and decision.code == code and why in decision.line and decision.line.endswith("not restarting")
        assert budget.final() == {"code": code, "line": decision.line}
    assert Budget(3, 600).decide(fail(0)).line == ""


def test_the_same_failure_twice_without_progress_ends_the_job():
    budget = Budget(5, 600)
    first = budget.decide(fail(1, committed=20, step=27, where="ValueError in /app/train.py:12 (main)"))
    assert first.restart and first.used == 1
    second = budget.decide(fail(1, committed=20, step=27, where="ValueError in /app/train.py:12 (main)"))
    assert not second.restart and second.code == 1 and second.repeated and not first.repeated
    assert second.line == ("the same failure twice at step 27 without progress: not restarting "
                           "(exit code 1, ValueError in /app/train.py:12 (main))")


@pytest.mark.parametrize("other", [
    fail(2, committed=20, where="ValueError in /app/train.py:12 (main)"),  # another code
    fail(1, committed=20, where="KeyError in /app/train.py:12 (main)"),  # another exception
    fail(1, committed=20, where="ValueError in /app/train.py:13 (main)"),  # another frame
])
def test_a_different_failure_is_restarted(other):
    budget = Budget(5, 600)
    budget.decide(fail(1, committed=20, where="ValueError in /app/train.py:12 (main)"))
    assert budget.decide(other).restart


def test_an_unreachable_master_is_never_the_same_failure():
    budget = Budget(3, 600)
    assert [budget.decide(fail(69)).restart for _ in range(4)] == [True, True, True, False]


def test_restarts_without_progress_spend_the_budget():
    budget = Budget(2, 600)
    assert budget.decide(fail(3)).restart and budget.decide(fail(4)).restart
    last = budget.decide(fail(5))
    assert not last.restart and last.code == 5
    assert last.line == ("rank 0 exited with 5 after 3 attempt(s), 2 restart(s) without progress (--max-restarts 2): giving up; "
                         "the first failure without progress: rank 0 exited with 3")


def test_the_end_names_the_first_failure_where_the_last_one_differs():
    # Issue 29: a failed download left an empty file, and the retry died on the empty file: both are named.
    download = fail(1, where="URLError in /app/data.py:30 (fetch)")
    empty = fail(1, where="RuntimeError in /app/train.py:51 (collate)")
    budget = Budget(1, 600)
    assert budget.decide(download).restart
    assert budget.decide(empty).line == (
        "rank 0 exited with 1 (RuntimeError in /app/train.py:51 (collate)) after 2 attempt(s), 1 restart(s) without progress "
        "(--max-restarts 1): giving up; the first failure without progress: rank 0 exited with 1 (URLError in /app/data.py:30 (fetch))")
    budget = Budget(3, 600)  # the same failure twice, after another one first
    assert budget.decide(download).restart and budget.decide(empty).restart
    assert budget.decide(empty).line.endswith("; the first failure without progress: rank 0 exited with 1 "
                                              "(URLError in /app/data.py:30 (fetch))")
    budget = Budget(1, 600)  # the same failure from the start: nothing more to say
    assert budget.decide(download).restart and "first failure" not in budget.decide(download).line
    budget = Budget(5, 600)  # progress since: the streak begins anew
    assert budget.decide(download).restart and budget.decide(fail(1, committed=10, where=empty.where)).restart
    assert "first failure" not in budget.decide(fail(1, committed=10, where=empty.where)).line


def test_a_failure_with_a_cause_is_named_by_it_and_the_same_by_where_it_happened():
    # Issue 24: "rank 0 exited with 137 (SIGKILL)" said nothing of memory. The cause names it, with the count,
    # which grows with each kill: what makes a second OOM at the same step the same failure is `where`.
    from trainpod.supervisor import oom

    def killed(kills: int, who: str = "rank 0") -> Failure:
        return Failure(code=137, committed=20, step=23, where=oom.WHERE, who=who,
                       cause=f"{who} was killed by the kernel's OOM killer (its cgroup's memory limit is 400 MiB, oom_kill {kills})")

    budget = Budget(3, 600)
    first = budget.decide(killed(1))
    assert first.restart and first.line == ("rank 0 was killed by the kernel's OOM killer (its cgroup's memory limit is 400 MiB, "
                                            "oom_kill 1): restart 1 of 3 without progress")
    second = budget.decide(killed(2, "rank 1"))  # another rank this time: the same failure
    assert not second.restart and second.code == 137
    assert second.line == ("the same failure twice at step 23 without progress: not restarting (exit code 137: rank 1 was killed "
                           "by the kernel's OOM killer (its cgroup's memory limit is 400 MiB, oom_kill 2))")
    spent = Budget(0, 600).decide(killed(1))
    assert spent.line.startswith("rank 0 was killed by the kernel's OOM killer (its cgroup's memory limit is 400 MiB, oom_kill 1) "
                                 "after 1 attempt(s)")
    budget = Budget(3, 600)
    assert budget.decide(fail(1, committed=20)).restart
    assert budget.decide(killed(1)).restart  # another failure than the first
    assert budget.decide(killed(2)).line.endswith("; the first failure without progress: rank 0 exited with 1")


def test_a_newer_committed_checkpoint_gives_the_budget_back():
    budget = Budget(2, 600)
    assert budget.decide(fail(137, committed=10)).restart
    assert budget.decide(fail(1, committed=10)).used == 2  # no progress in between: the budget is spent
    decision = budget.decide(fail(137, committed=20))
    assert decision.restart and decision.used == 1
    assert decision.line.endswith("restart 1 of 2 without progress (progress since the last failure: checkpoint of step 20 "
                                  "committed; the budget is full again)")
    for committed in range(30, 200, 10):  # a kill now and then, each after a newer checkpoint: never runs out
        assert budget.decide(fail(137, committed=committed)).restart
    assert not budget.decide(fail(137, committed=190)).restart  # the same kill at the same point: a deterministic one


def test_a_job_without_checkpoints_made_progress_when_it_ran_longer_than_the_window():
    budget = Budget(1, 60)
    assert budget.decide(fail(3, ran_s=100)).restart
    assert budget.decide(fail(4, ran_s=100)).restart  # ran long: the budget is full again
    decision = budget.decide(fail(3, ran_s=10))
    assert not decision.restart and "giving up" in decision.line
    checkpointed = Budget(1, 60)
    assert checkpointed.decide(fail(3, committed=5, ran_s=100)).restart
    assert not checkpointed.decide(fail(4, committed=5, ran_s=100)).restart  # checkpoints, none newer: time is no progress


def test_both_layers_share_one_budget_through_the_file(tmp_path):
    agent, listener = Budget(2, 600, tmp_path), Budget(2, 600, tmp_path)
    assert agent.decide(fail(3)).restart  # a rank failed: torchrun restarts the group
    decision = listener.decide(Failure(code=69, who="the job"))  # then the agent failed: supervisord restarts it
    assert decision.restart and decision.used == 2 and decision.attempt == 3
    assert agent.left() == listener.left() == 0
    assert not agent.decide(fail(9)).restart and listener.final()["code"] == 9


def test_reported_progress(tmp_path, monkeypatch):
    assert reported(tmp_path) == (-1, -1) and reported(None) == (-1, -1)
    monkeypatch.setenv(PROGRESS_DIR_VAR, str(tmp_path))
    for local_rank, (step, committed) in enumerate([(12, 10), (11, -1)]):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setattr(progress, "_reporter", progress._Reporter())
        progress.step(step)
        if committed >= 0:
            progress.committed(committed)
    assert reported(tmp_path) == (10, 12)


def test_a_membership_change_gives_back_its_restart_and_is_not_the_same_failure_twice():
    budget = Budget(max_restarts=1, progress_window=600)
    lost = Failure(code=1, committed=2, where="RuntimeError in harness.py:402 (train)")
    assert budget.decide(lost).restart
    budget.membership_changed()  # the next rendezvous had fewer nodes: that failure was a node leaving
    assert budget.left() == 1
    again = budget.decide(lost)  # another node lost at the same step: neither spent nor "the same failure"
    assert again.restart and budget.final() is None
    assert not budget.decide(lost).restart  # the same failure twice with the same nodes: the job ends
    budget.membership_changed()  # ... unless the rendezvous shows a node left after all
    assert budget.final() is None
