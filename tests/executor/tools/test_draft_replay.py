"""The replay's accept rules and its two ceilings on hand-made histories (draft_replay.py)."""

from __future__ import annotations

from executor_svc.sampling.drafter import DraftTree
from executor_svc.tools.draft_replay import (
    Ceiling,
    DrafterReplay,
    accepted_by_chain,
    any_path,
    best_occurrence,
    kept_path,
    replay,
)


def letters(text: str) -> list[int]:
    return [ord(c) for c in text.split()]


def test_a_chain_keeps_its_prefix_equal_to_the_output():
    assert accepted_by_chain(letters("a b c"), letters("a b d e")) == 2
    assert accepted_by_chain(letters("x"), letters("a")) == 0
    assert accepted_by_chain(letters("a b"), letters("a")) == 1


def test_a_tree_keeps_its_longest_matching_root_path_even_off_the_first_branch():
    # d (0) and c (1) under the root; z under d, y under c, q under y.
    tree = DraftTree(letters("d c z y q"), [-1, -1, 0, 1, 3], [0.4, 0.4, 0.3, 0.3, 0.2])
    assert kept_path(tree, letters("c y q r")) == [1, 3, 4]
    assert kept_path(tree, letters("d y")) == [0]
    assert kept_path(tree, letters("e")) == []


def test_best_occurrence_takes_the_best_continuation_of_any_suffix_occurrence():
    context = letters("a b c a b d a b")
    assert best_occurrence(context, letters("c x"), depth=4) == 1  # after the first "b": c a b d
    assert best_occurrence(context, letters("d a b a"), depth=4) == 3  # after the second: d a b (then the end)
    assert best_occurrence(context, letters("d a b a"), depth=2) == 2
    assert best_occurrence(context, letters("x"), depth=4) == 0


def test_any_path_needs_each_token_to_have_followed_its_two_predecessors():
    context = letters("a b c a b")
    # [a b] -> c, then [b c] -> a, then [c a] -> b (each seen), then [a b] was never followed by d.
    assert any_path(context, letters("c a b d"), depth=8) == 3
    assert any_path(context, letters("c a b d"), depth=2) == 2
    # The path itself counts: after "c a b c", [b c] -> a was seen in the context.
    assert any_path(letters("a b c a b"), letters("c a b c a"), depth=8) == 5


def test_replay_counts_verify_steps_each_emitting_its_accepted_drafts_and_one_token():
    prompt, output = [1, 2, 3, 4, 1, 2], [3, 4, 1, 2, 3, 4]
    # Step 1 drafts 3 4 1 2 (after the earlier "1 2"), all kept, and adds 3; step 2 adds the last 4.
    assert replay(prompt, output, Ceiling(best_occurrence, 4)) == 2
    assert replay(prompt, output, DrafterReplay(prompt, "chain", 4, max_ngram=12)) == 2
    assert replay(prompt, output, DrafterReplay(prompt, "tree", 4, max_ngram=12)) == 2
    # Nothing drafted at all: one step per token.
    assert replay(prompt, output, Ceiling(lambda context, rest, depth: 0, 4)) == len(output)


def test_the_tool_replays_the_embedded_models_own_output():
    from executor_svc.tools.draft_replay import STRATEGIES, greedy_outputs, report

    outputs = greedy_outputs("default", ["branchy"], num_requests=1, num_new_tokens=24)
    (prompt, output) = outputs["branchy[0]"]
    assert len(output) == 24 and len(prompt) > 100
    lines = report(outputs, [8], max_ngram=12)
    (row,) = [line for line in lines if line.strip().startswith("branchy[0]")]
    steps = dict(zip(STRATEGIES, (int(cell.split("(")[0]) for cell in row.split("|")[1:5]), strict=True))
    assert all(1 <= s <= 24 for s in steps.values())
    # The chain drafts the continuation of one occurrence of a suffix; the ceiling takes the best of
    # all of them, at every step, so it never needs more steps.
    assert steps["best occurrence"] <= steps["chain"]
