"""`swarmserve bench spec`'s pure parts: the workloads and tree-vs-chain ratios."""

from __future__ import annotations

import argparse

import pytest

from clients.bench.repeats import Spread, is_below_beyond_noise, paired_ratio
from clients.bench.speculation import add_arguments, max_new_tokens, tree_vs_chain, workload_messages


def row(workload, batch_size, policy, shape, tokens_per_s, accepted_per_step):
    return dict(
        workload=workload,
        batch_size=batch_size,
        policy=policy if shape == "chain" else f"{policy}+{shape}",
        shape=shape,
        tokens_per_s=tokens_per_s,
        accepted_per_step=accepted_per_step,
    )


def test_tree_rows_are_compared_with_the_chain_row_of_their_policy_workload_and_batch():
    results = [
        row("branchy", 1, "fixed:8", "chain", 10.0, 1.0),
        row("branchy", 1, "fixed:8", "tree", 15.0, 2.0),
        row("branchy", 4, "fixed:8", "chain", 20.0, 0.5),
        row("branchy", 4, "fixed:8", "tree", 18.0, 0.5),
        row("branchy", 1, "off", "chain", 8.0, 0.0),
        row("branchy", 1, "off", "tree", 8.0, 0.0),  # no drafts: nothing to compare
        row("copy", 1, "goodput", "tree", 30.0, 3.0),  # no chain row
    ]
    ratios = tree_vs_chain(results)
    assert [(q["workload"], q["batch_size"], q["policy"]) for q in ratios] == [
        ("branchy", 1, "fixed:8"),
        ("branchy", 4, "fixed:8"),
    ]
    assert ratios[0]["tokens_per_s_ratio"] == 1.5 and ratios[0]["accepted_per_step_ratio"] == 2.0
    assert ratios[1]["tokens_per_s_ratio"] == 0.9 and ratios[1]["accepted_per_step_ratio"] == 1.0


def test_the_branchy_workload_repeats_one_context_with_different_continuations():
    for index in range(3):
        (message,) = workload_messages("branchy", index)
        assert "in the same style" in message["content"]
    assert workload_messages("branchy", 0) != workload_messages("branchy", 1)


def test_shapes_default_to_chains_alone():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).shapes == "chain"
    assert parser.parse_args(["--shapes", "tree,chain"]).shapes == "tree,chain"


def test_spread_lengths_are_the_seeds_scaled_so_the_longest_is_num_new_tokens():
    assert [max_new_tokens("spread", i, 900) for i in range(8)] == [40, 90, 150, 220, 300, 480, 650, 900]
    assert [max_new_tokens("spread", i, 90) for i in range(10)] == [4, 9, 15, 22, 30, 48, 65, 90, 4, 9]
    assert [max_new_tokens("spread", i, 48) for i in range(8)] == [2, 5, 8, 12, 16, 26, 35, 48]
    assert max_new_tokens("spread", 0, 10) == 1  # 40 * 10 / 900 rounds to 0: at least one token
    assert {max_new_tokens(kind, i, 48) for kind in ("copy", "branchy", "free") for i in range(9)} == {48}


def test_spread_asks_the_copy_branchy_and_free_prompts_in_turn():
    for i in range(6):
        kind = ("copy", "branchy", "free")[i % 3]
        assert workload_messages("spread", i) == workload_messages(kind, i)
    assert workload_messages("spread", 0) != workload_messages("spread", 1)


def test_workloads_are_checked_by_name():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--workloads", "branchy,spread"]).workloads == ("branchy", "spread")
    with pytest.raises(SystemExit):
        parser.parse_args(["--workloads", "branchy,sprad"])


def test_a_spread_is_the_median_and_range_of_the_repeats():
    spread = Spread.of([12.0, 10.0, 30.0])
    assert (spread.median, spread.low, spread.high, spread.num_repeats) == (12.0, 10.0, 30.0, 3)
    assert Spread.of([1.0, 2.0, 4.0, 10.0]).median == 3.0  # an even count: the middle two's mean
    assert spread.text() == "12.0 (10.0–30.0)"
    assert Spread.of([1.234]).text(2, "x") == "1.23x"  # one repeat: no range to show
    with pytest.raises(ValueError):
        Spread.of([])


def test_ratios_pair_repeat_r_with_repeat_r():
    ratio = paired_ratio([20.0, 30.0, 12.0], [10.0, 15.0, 12.0])
    assert (ratio.median, ratio.low, ratio.high) == (2.0, 1.0, 2.0)  # unpaired extremes: 12/15 to 30/10
    assert paired_ratio([1.0, 2.0], [1.0]) is None
    assert paired_ratio([1.0], [0.0]) is None
    assert paired_ratio([], []) is None


@pytest.mark.parametrize(
    ("values", "reference", "verdict"),
    [
        ([8.0, 9.0, 9.5], [10.0, 11.0, 12.0], True),  # ranges apart
        ([8.0, 9.0, 10.5], [10.0, 11.0, 12.0], False),  # overlapping: within the noise
        ([8.0, 9.0, 10.0], [10.0, 11.0, 12.0], False),  # touching is not below
        ([12.0, 13.0], [10.0, 11.0], False),  # above
        ([8.0], [10.0, 11.0], None),  # one repeat: no spread
        ([8.0, 9.0], [10.0], None),
    ],
)
def test_below_by_more_than_noise_means_the_ranges_do_not_overlap(values, reference, verdict):
    assert is_below_beyond_noise(values, reference) is verdict
