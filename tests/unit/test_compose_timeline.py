"""compose/timeline.py: an elastic job's membership timeline from `docker logs -t` lines as trainpod and the bundled
examples write them, with the nodes that left the job on their own decision as rows of their own."""

import importlib.util
import sys
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("compose_timeline", Path(__file__).resolve().parents[2] / "compose" / "timeline.py")
timeline = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = timeline  # dataclasses look their module up there
SPEC.loader.exec_module(timeline)

T = "2026-11-27T02:10:{:02d}.000000000Z "
LOGS = {
    "trainer0": "\n".join([
        T.format(1) + "[node@trainer0 rank0] imagenet-elastic: world 3, backend gloo, fp32",
        T.format(2) + "[node@trainer0 rank0] epoch 1/2 step 1/10 loss 1.0",
        T.format(9) + "[node@trainer0] trainpod: the same failure twice at step 6 without progress: not restarting (exit code 1: "
                      "rank 0 exited with 1), unless a node left the job: one more rendezvous tells (an elastic job)",
        T.format(30) + "[node@trainer0 rank0] imagenet-elastic: world 2, backend gloo, fp32",
        T.format(31) + "[node@trainer0 rank0] imagenet-elastic: resumed from the checkpoint of step 4 (epoch 1)",
        T.format(32) + "[node@trainer0 rank0] epoch 1/2 step 5/15 loss 0.9",
    ]),
    "trainer2": T.format(8) + ("[node@trainer2] trainpod: error: the same failure twice at step 6 without progress: not "
                               "restarting (exit code 1, trainpod.failpoints.Crash in /x/failpoints.py:74 (crash)): this node's "
                               "ranks failed the same way twice, the other nodes' only for want of them: it leaves the elastic "
                               "job, excluded from its next rounds; the others go on if --nnodes' minimum remains"),
    "trainer1": T.format(5) + ("[node@trainer1] trainpod: error: the link from node 0 (trainer1) to node 2 (trainer0) carries "
                               "0.0178 Gbit/s, below --min-bandwidth 0.5 Gbit/s (round trip 0.0134 ms): node 0 (trainer1) is "
                               "named: this node leaves the elastic job (--netcheck); the others go on if --nnodes' minimum "
                               "remains"),
}


def test_the_nodes_that_left_on_their_own_decision_are_found_with_why_and_when():
    found = timeline.departures(LOGS)
    assert [text for text, _ in found] == ["trainer1 left the job (named by --netcheck)",
                                           "trainer2 left the job (its ranks failed the same way twice)"]
    assert found[1][1] - found[0][1] == 3.0


def test_the_timeline_shows_each_departure_and_how_soon_the_others_trained_again():
    text = timeline.render(timeline.segments(LOGS), timeline.departures(LOGS))
    assert "trainer2 left the job (its ranks failed the same way twice)" in text
    assert "after trainer2 left the job (its ranks failed the same way twice): world 2 started 22.0 s later, its first " \
           "step line at 24.0 s" in text, text
    assert [segment.world for segment in timeline.segments(LOGS)] == [3, 2]


def test_a_node_whose_own_ranks_spent_the_budget_is_found_with_that_reason():
    line = T.format(7) + ("[node@trainer1] trainpod: error: rank 1 exited with 1 (ValueError in /app/train.py:6 (step)) "
                          "after 4 attempt(s), 3 restart(s) without progress (--max-restarts 3): giving up: this node's "
                          "ranks failed on their own until --max-restarts was spent, the other nodes' only for want of them: "
                          "it leaves the elastic job, excluded from its next rounds")
    assert timeline.departures({"trainer1": line}) == [("trainer1 left the job (its ranks kept failing: --max-restarts spent)",
                                                        timeline.unix_time(line))]


def test_a_node_started_again_that_stayed_out_is_found_once_not_as_a_second_departure():
    left = T.format(7) + ("[node@trainer2] trainpod: error: the same failure twice at step 6 without progress: not restarting "
                          "(exit code 1): this node's ranks failed the same way twice, the other nodes' only for want of them: "
                          "it leaves the elastic job, excluded from its next rounds")
    again = T.format(19) + ("[node@trainer2] trainpod: error: this node left this elastic job (rendezvous crashing-1.g0) and "
                            "stays out of it: 4c1d (boot 8a3e51c2), since 2026-11-27 09:02:11 UTC, exit 1: "
                            + left.split("trainpod: error: ", 1)[1] + "; started on another host, ..., it joins")
    found = timeline.departures({"trainer2": f"{left}\n{again}"})
    assert [text for text, _ in found] == ["trainer2 left the job (its ranks failed the same way twice)",
                                           "trainer2 was started again and stayed out (excluded)"]
    assert found[1][1] - found[0][1] == 12.0


def test_a_spare_is_found_when_it_waits_and_once_per_round_it_took_a_place_in():
    took = ("trainpod: 1 node(s) took the place of one that left: the job has 3 node(s), as before: a membership change, "
            "not counted against --max-restarts")
    logs = {
        "trainer0": "\n".join([T.format(1) + "[node@trainer0 rank0] imagenet-elastic: world 3, backend gloo, fp32",
                               T.format(14) + f"[node@trainer0] {took}",
                               T.format(15) + "[node@trainer0 rank0] imagenet-elastic: world 3, backend gloo, fp32"]),
        "trainer2": T.format(14) + f"[node@trainer2] {took}",
        "trainer3": "\n".join([T.format(6) + "[node@trainer3] trainpod: this node waits as a spare: the job has --nnodes' "
                                             "maximum of 3 node(s) and --spares 1; it trains nothing and takes the place of "
                                             "the first node that leaves",
                               T.format(14) + f"[node@trainer3] {took}"]),
    }
    found = timeline.spares(logs)
    assert [(text, at - found[0][1]) for text, at in found] == [("trainer3 waits as a spare", 0.0),
                                                                ("1 spare(s) took the place of node(s) that left", 8.0)]
    assert "after 1 spare(s) took the place of node(s) that left: world 3 started 1.0 s later" in timeline.render(
        timeline.segments(logs), found)


def test_a_nodes_lines_count_in_the_order_of_their_times_not_of_the_text():
    # `docker logs -t c 2>&1`: the container's stdout and stderr come as two streams, and a reader of both may get a
    # later line of one before an earlier line of the other (seen: a resume line placed in the segment before it).
    lines = [T.format(1) + "[node@trainer2 rank0] imagenet-elastic: world 3, backend gloo, fp32",
             T.format(2) + "[node@trainer2 rank0] epoch 1/2 step 1/20 loss 1.0",
             T.format(9) + "[node@trainer2 rank0] imagenet-elastic: world 3, backend gloo, fp32",
             T.format(10) + "[node@trainer2 rank0] epoch 1/2 step 9/20 loss 0.9"]
    resumed = (T.format(9).replace(".000000000Z", ".000400000Z")
               + "[node@trainer2 rank0] imagenet-elastic: resumed from the checkpoint of step 8 (epoch 1)")
    found = timeline.segments({"trainer2": "\n".join([resumed, *lines])})
    assert [(s.resumed_from, s.first_step, s.last_step) for s in found] == [(0, 1, 1), (8, 9, 9)]
