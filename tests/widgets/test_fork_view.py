"""What both front-ends draw of a fork (widgets/fork_view.py), without a terminal or a
browser: the variants' evaluations over the parent's evaluation curve, and the memory
figure said before a fork starts."""

from __future__ import annotations

from workbench.widgets.fork_view import fork_cost_text, fork_eval_metric, fork_eval_series, fork_series


def report(evals: dict[str, dict[str, float]], parent: dict[str, float]) -> dict:
    """A fork of 2 steps from step 10, as session/fork_commands.py publishes it."""
    return {"id": 1, "step": 10, "steps": 2, "state": "done", "parent": {"eval": parent},
            "memory": {"variants": 2, "bytes": 3 * 2**20, "bytes_each": 2**20, "limit": 8 * 2**20},
            "variants": {name: {"changes": {}, "loss": [[11, 1.0], [12, 0.9]], "eval": ev, "batches": ["x", "x"],
                                "final_loss": 0.9, "end_step": 12} for name, ev in evals.items()}}


def test_each_variants_evaluation_is_a_point_after_its_steps_over_the_parents_curve():
    fork = report({"a": {"eval_loss": 0.8, "eval_accuracy": 0.5}, "b": {"eval_loss": 0.7, "eval_accuracy": 0.6}},
                  {"eval_loss": 0.85, "eval_accuracy": 0.4})
    series = {"loss": [(s, 2.0 - s / 10) for s in range(1, 11)], "eval_loss": [(0, 1.5), (5, 1.1), (10, 0.85)]}
    assert fork_eval_metric(fork) == "eval_loss"  # the loss, not the accuracy: it shares the loss axis
    evals = fork_eval_series(fork, series)
    # The parent's curve up to the pause, its last point the fork's own evaluation of the paused
    # state (the logged one at the pause measured the same weights); each variant a point.
    assert evals == {"parent": [(0, 1.5), (5, 1.1), (10, 0.85)], "a": [(12, 0.8)], "b": [(12, 0.7)]}
    # The parent's evaluations start where fork_series starts its train loss.
    short = fork_eval_series(fork, series, history=3)
    assert fork_series(fork, series["loss"], history=3)["parent"][0][0] == 8 and short["parent"] == [(10, 0.85)]


def test_a_named_eval_sets_loss_is_drawn_and_no_loss_draws_nothing():
    named = report({"a": {"eval_wiki_loss": 0.8}}, {"eval_wiki_loss": 0.9})
    assert fork_eval_series(named, {"eval_wiki_loss": [(4, 1.0)], "loss": [(4, 2.0)]}) == {
        "parent": [(4, 1.0), (10, 0.9)], "a": [(12, 0.8)]}
    assert fork_eval_series(report({"a": {"eval_accuracy": 0.5}}, {}), {}) == {}
    unevaluated = report({"a": {}, "b": {}}, {})  # fork(evaluate=False)
    assert fork_eval_series(unevaluated, {}) == {}


def test_the_memory_figure_says_the_total_the_copies_and_the_limit():
    cost = report({}, {})["memory"]
    assert fork_cost_text(cost) == ("3.0 MiB of host memory for 2 variants (3 copies of weights and optimizer "
                                    "state, 1.0 MiB each); the limit is 8.0 MiB")
    assert "limit" not in fork_cost_text({**cost, "limit": None})
    assert "1.0 MiB each, on each of 2 ranks of this machine); the limit" in fork_cost_text({**cost, "ranks": 2})
