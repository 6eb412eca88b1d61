"""trainpod.agent.stragglers: who paces the job, from the ranks' own work per step."""

import pytest

from trainpod.agent.stragglers import MIN_REPORTS, SPAN_S, Judge, Pace, Reports, describe, describe_recovered, slow


def paces(*busy, node_of=lambda rank: str(rank // 2)):
    return [Pace(rank, node_of(rank), b) for rank, b in enumerate(busy)]


def test_a_rank_30_percent_above_the_others_median_is_slow():
    assert list(slow(paces(0.10, 0.10, 0.10, 0.13), 4)) == [3]
    assert slow(paces(0.10, 0.10, 0.10, 0.129), 4) == {}
    pace, others = slow(paces(0.10, 0.26), 2)[1]
    assert (pace.rank, others) == (1, 0.10)  # with two ranks: against the other one, not the mean of both


def test_no_judgement_until_every_rank_has_a_figure():
    assert slow(paces(0.1, 0.5), 3) == {}
    assert slow(paces(0.5), 1) == {}


def test_reports_keep_one_figure_per_new_step_over_the_span():
    reports = Reports()
    for look, step in enumerate([1, 1, 2, 3]):  # the same step seen twice counts once
        reports.add(0, step, 0.2 + 0.01 * look, now=100.0 + look)
    assert reports.paces("a", now=103.0) == [Pace(0, "a", 0.22)]  # the median of 0.20, 0.22, 0.23
    reports.add(0, 4, 0.0, now=104.0)  # not measured: not a figure
    assert len(reports._seen[0]) == MIN_REPORTS
    assert reports.paces("a", now=100.0 + SPAN_S + 1.5) == []  # two of the three are older than the span


def test_a_rank_slow_for_the_whole_window_is_named_once_then_keeps_pace():
    judge = Judge(window=60)
    slow_job = paces(0.1, 0.1, 0.1, 0.2)
    assert judge.update(slow_job, 4, now=0) == ([], [])
    assert judge.update(slow_job, 4, now=59) == ([], [])
    named, _ = judge.update(slow_job, 4, now=60)
    assert [(s.rank, s.busy_s, s.others_s, s.since) for s in named] == [(3, 0.2, 0.1, 0)]
    assert judge.update(slow_job, 4, now=90) == ([], [])  # named once
    assert judge.update(paces(0.1, 0.1, 0.1, 0.11), 4, now=95) == ([], [])  # keeping pace: for the window too
    named, recovered = judge.update(paces(0.1, 0.1, 0.1, 0.11), 4, now=155)
    assert named == [] and [(s.rank, s.busy_s) for s in recovered] == [(3, 0.11)]


def test_a_named_rank_wavering_about_the_bound_stays_named_and_is_named_once():
    # CI, a loaded host: 1.59 then 1.27 then 2.85 times the others' own work: named, "keeps pace", named again.
    judge = Judge(window=4)
    for now, slowest in enumerate([0.16, 0.16, 0.16, 0.16, 0.16, 0.127, 0.135, 0.127, 0.2, 0.127, 0.14, 0.127]):
        named, recovered = judge.update(paces(0.1, slowest), 2, now=now)
        assert recovered == [] and (named == [] or now == 4), (now, named, recovered)
    assert list(judge.named) == [1]


def test_one_look_at_the_usual_pace_starts_the_count_again():
    judge = Judge(window=60)
    judge.update(paces(0.1, 0.2), 2, now=0)
    judge.update(paces(0.1, 0.1), 2, now=30)
    assert judge.update(paces(0.1, 0.2), 2, now=61) == ([], [])
    assert [s.rank for s in judge.update(paces(0.1, 0.2), 2, now=121)[0]] == [1]


def test_a_look_without_every_figure_judges_nothing():
    judge = Judge(window=10)
    judge.update(paces(0.1, 0.2), 2, now=0)
    assert judge.update(paces(0.1), 2, now=5) == ([], [])  # rank 1's figure missing: the count goes on
    assert [s.rank for s in judge.update(paces(0.1, 0.2), 2, now=10)[0]] == [1]


@pytest.mark.parametrize("ranks, expected", [
    ((3,), "straggler: rank 3 (node 1) spends 0.2s of its own work per step, the other ranks 0.1s (+100%), for 60s"),
    ((2, 3), "straggler: node 1 (ranks 2, 3) spends 0.2s of its own work per step, the other ranks 0.1s (+100%), for 60s"),
])
def test_a_node_whose_every_rank_is_slow_is_named_as_the_node(ranks, expected):
    judge = Judge(window=60)
    job = paces(*[0.2 if r in ranks else 0.1 for r in range(4)])
    judge.update(job, 4, now=0)
    named, _ = judge.update(job, 4, now=60)
    [line] = describe(named, job, now=60)
    assert line.startswith(expected), line
    assert line.endswith("the whole job runs at its pace")


def test_keeping_pace_again_is_said():
    judge = Judge(window=0)
    judge.update(paces(0.1, 0.3), 2, now=0)
    _, recovered = judge.update(paces(0.1, 0.1), 2, now=1)
    assert describe_recovered(recovered) == [
        "straggler: rank 1 (node 0) keeps pace again: 0.1s of its own work per step, the other ranks 0.1s"]
