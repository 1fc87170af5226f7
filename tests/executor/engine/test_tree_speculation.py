"""Draft trees never change output: `--draft-shape tree` against speculation off.

Greedy on the embedded model (alone and batched, requests joining and leaving,
chunked prefill), including a branchy prompt whose trees really branch and whose
accepted paths are not always the first branch (so the kept path's K/V is moved);
seeded sampling on the tiny model gives the very tokens it gives without drafts.
"""

from __future__ import annotations

import pytest

from executor_svc.engine.request_state import NewRequest
from service_common.sampling_params import SamplingParams
from tests.executor.engine.test_speculation_equivalence import (
    NUM_NEW_TOKENS,
    TINY_MODEL_TEMPERATURE,
    requests_for,
)
from tests.executor.engine.test_speculation_equivalence import (
    prompts as prompts,  # noqa: F401 (a fixture)
)
from tests.support.engine_driver import drive
from tests.support.tiny_gguf import TinyModelSpec

# Several near-identical functions: the context after "return x" was followed in different ways.
BRANCHY = "".join(f"def scale_{i}(x):\n    return x * {i} + {i % 3}\n\n" for i in range(1, 9)) + "def scale_9(x):\n"


@pytest.fixture(scope="module")
def tree_engine():
    from executor_svc.engine.engine import Engine, EngineConfig

    return Engine(EngineConfig(model="default", kv_cache_bytes=512 << 20, draft_shape="tree"))


class TreeLog:
    """Records the trees the engine's drafter proposes and the kept paths it moves (it still
    does both itself)."""

    def __init__(self, engine):
        self.num_trees = self.num_branching = self.num_moves = 0
        self._propose_tree = engine.drafter.propose_tree
        self._move_tokens = engine.kv.move_tokens

        def move_tokens(request_id, src_positions, dst_positions):
            self.num_moves += 1
            self._move_tokens(request_id, src_positions, dst_positions)

        def propose_tree(request_id, max_nodes):
            tree = self._propose_tree(request_id, max_nodes)
            self.num_trees += tree.num_nodes > 0
            self.num_branching += tree.num_nodes > 0 and not tree.is_chain()
            return tree

        engine.drafter.propose_tree = propose_tree
        engine.kv.move_tokens = move_tokens
        self.engine = engine

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        del self.engine.drafter.propose_tree  # back to the classes' methods
        del self.engine.kv.move_tokens


@pytest.fixture(scope="module")
def branchy_prompt(tree_engine):
    return tree_engine.tokenizer.tokenizer.encode(BRANCHY, add_special_tokens=False).ids


@pytest.mark.slow
def test_greedy_trees_change_no_token(engine_default, tree_engine, prompts, branchy_prompt):  # noqa: F811
    reqs = requests_for(prompts[:4], copies=1) + [
        NewRequest("branchy", branchy_prompt, SamplingParams(), NUM_NEW_TOKENS, ignore_eos=True)
    ]
    baseline = drive(engine_default, reqs).tokens
    arrivals = {r.request_id: 2 * i for i, r in enumerate(reqs)}
    with TreeLog(tree_engine) as log:
        run = drive(tree_engine, reqs, chunk_size=16, arrival_steps=arrivals, draft_budget=8)
    for r in reqs:
        assert run.tokens[r.request_id] == baseline[r.request_id], r.request_id
    assert log.num_branching > 0, "no tree branched: the test did not test trees"
    assert log.num_moves > 0, "no later branch won: the kept path never moved"
    assert run.num_accepted > 0.2 * len(reqs) * NUM_NEW_TOKENS / 2
    assert tree_engine.kv.num_free_blocks == tree_engine.kv.num_usable_blocks


@pytest.mark.slow
def test_a_branchy_request_alone_with_large_trees(engine_default, tree_engine, branchy_prompt):
    request = NewRequest("branchy", branchy_prompt, SamplingParams(), NUM_NEW_TOKENS, ignore_eos=True)
    expected = drive(engine_default, [request]).tokens["branchy"]
    with TreeLog(tree_engine) as log:
        run = drive(tree_engine, [request], draft_budget=16)
    assert run.tokens["branchy"] == expected
    assert log.num_branching > 0
    assert run.num_steps < NUM_NEW_TOKENS


def test_seeded_sampling_gives_the_same_tokens_with_trees_on_and_off(make_tiny_engine):
    engine = make_tiny_engine(TinyModelSpec(seed=3), kv_cache_bytes=8 << 20, draft_shape="tree")
    # Two continuations of [40 41 42]: the trees branch there.
    prompt = [40, 41, 42, 43, 44, 40, 41, 42, 45, 46, 40, 41, 42, 43, 44, 40, 41, 42]
    params = dict(temperature=TINY_MODEL_TEMPERATURE)

    def tokens(budget):
        reqs = [
            NewRequest(f"s{seed}", prompt, SamplingParams(seed=seed, **params), 8, ignore_eos=True)
            for seed in range(40)
        ]
        run = drive(engine, reqs, draft_budget=budget)
        return {r.request_id: run.tokens[r.request_id] for r in reqs}, run

    off, _ = tokens(0)
    with TreeLog(engine) as log:
        on, run_on = tokens(6)
    assert len({tuple(t) for t in off.values()}) > 20, "the seeds should sample different tokens"
    assert log.num_branching > 0 and run_on.num_accepted > 10, "trees were not exercised"
    assert on == off


def drive_recording_results(engine, requests, budget):
    """drive(), keeping every step's RequestResults."""
    results = []
    step = engine.step

    def recording_step(plan):
        response = step(plan)
        results.extend(response.outputs)
        return response

    engine.step = recording_step
    try:
        drive(engine, requests, draft_budget=budget)
    finally:
        del engine.step
    return results


@pytest.mark.parametrize("draft_shape", ["tree", "chain"])
def test_results_report_the_drafts_shape_and_what_the_next_tree_buys(make_tiny_engine, draft_shape):
    """Each result says the verified drafts' shape (a chain: depth = nodes, one leaf) and, for
    a tree request whose next tree branches, the curve the scheduler prices budgets by."""
    engine = make_tiny_engine(TinyModelSpec(seed=3), kv_cache_bytes=8 << 20, draft_shape=draft_shape)
    prompt = [40, 41, 42, 43, 44, 40, 41, 42, 45, 46, 40, 41, 42, 43, 44, 40, 41, 42]
    reqs = [NewRequest(f"r{i}", prompt, SamplingParams(), 12, ignore_eos=True) for i in range(2)]
    results = drive_recording_results(engine, reqs, 6)
    drafted = [r for r in results if r.num_drafted_tokens]
    assert drafted, "nothing was drafted: the test tested nothing"
    for r in results:
        assert r.num_accepted_tokens <= r.draft_depth <= r.num_drafted_tokens
        if not r.num_drafted_tokens:
            assert r.draft_depth == r.num_draft_leaves == 0
            assert r.expected_num_accepted_tokens == 0
        curve = r.expected_accepted_tokens_by_nodes
        if curve:
            assert len(curve) == r.num_draftable_tokens
            gains = [b - a for a, b in zip([0.0, *curve], curve)]
            assert all(0 < later <= earlier + 1e-12 for earlier, later in zip(gains, gains[1:]))
    if draft_shape == "chain":
        assert all(r.draft_depth == r.num_drafted_tokens and r.num_draft_leaves == 1 for r in drafted)
        assert not any(r.expected_accepted_tokens_by_nodes or r.expected_num_accepted_tokens for r in results)
    else:
        assert any(r.num_draft_leaves > 1 for r in drafted), "no tree branched"
        assert all(1 <= r.num_draft_leaves <= r.num_drafted_tokens for r in drafted)
        assert all(0 < r.expected_num_accepted_tokens <= r.draft_depth for r in drafted)
        assert any(r.expected_accepted_tokens_by_nodes for r in results)


def test_every_verified_tree_calibrates_the_drafter_and_a_chain_shaped_one_verifies_as_a_chain(make_tiny_engine):
    from executor_svc.engine.engine import _Draft
    from executor_svc.sampling.drafter import DraftTree, NodeCalibration

    chain_shaped = DraftTree([5, 6], [-1, 0], [0.9, 0.8], [0.9, 0.9])
    branching = DraftTree([5, 6], [-1, -1], [0.5, 0.4], [0.5, 0.4])
    assert _Draft.tree_of(chain_shaped).parent_indexes is None  # ordinary verify rows
    assert _Draft.tree_of(branching).parent_indexes == (-1, -1)
    assert _Draft.tree_of(chain_shaped).tree is chain_shaped

    engine = make_tiny_engine(TinyModelSpec(seed=3), kv_cache_bytes=8 << 20, draft_shape="tree")
    engine.drafter.calibration = NodeCalibration(decay=1.0)
    prompt = [40, 41, 42, 43, 44, 40, 41, 42, 45, 46, 40, 41, 42, 43, 44, 40, 41, 42]
    reqs = [NewRequest(f"c{i}", prompt, SamplingParams(), 12, ignore_eos=True) for i in range(2)]
    results = drive_recording_results(engine, reqs, 6)
    num_nodes, num_accepted = engine.drafter.calibration.totals()
    assert num_accepted == sum(r.num_accepted_tokens for r in results) > 0
    assert num_nodes > num_accepted  # a rejected node whose parent was kept is filed too


def test_a_tree_request_whose_tree_does_not_branch_is_offered_what_a_chain_request_is(make_tiny_engine):
    """Its draftable count stops where the chain's does, though its tree would go on into its own path."""
    engine = make_tiny_engine(TinyModelSpec(seed=3), kv_cache_bytes=8 << 20, draft_shape="tree")
    prompt = [40, 41, 42, 43, 44] * 4 + [40, 41]  # one continuation per context: trees do not branch
    capped, checked = 0, 0
    step = engine.step

    def checking_step(plan):
        nonlocal capped, checked
        response = step(plan)
        for r in response.outputs:
            if r.finish_reason is None and not r.expected_accepted_tokens_by_nodes:
                checked += 1
                assert r.num_draftable_tokens <= engine.drafter.num_draftable(r.request_id)
                capped += engine.drafter.next_tree(r.request_id).num_nodes > r.num_draftable_tokens
        return response

    engine.step = checking_step
    try:
        drive(engine, [NewRequest("p", prompt, SamplingParams(), 12, ignore_eos=True)], draft_budget=6)
    finally:
        del engine.step
    assert checked and capped, "no unbranched tree went past the chain: the test tested nothing"


def test_a_result_over_several_runs_sums_the_shapes_and_keeps_the_last_curve():
    from executor_svc.engine.step_messages import RequestResult

    first = RequestResult(
        "r",
        [1, 2],
        None,
        10,
        [],
        3,
        1,
        draft_depth=2,
        num_draft_leaves=2,
        expected_num_accepted_tokens=1.5,
        expected_accepted_tokens_by_nodes=[0.9, 1.5],
        num_draft_misses=1,
    )
    later = RequestResult(
        "r",
        [3],
        None,
        11,
        [],
        4,
        0,
        draft_depth=4,
        num_draft_leaves=1,
        expected_num_accepted_tokens=0.5,
        expected_accepted_tokens_by_nodes=[0.8],
        num_draft_misses=1,
    )
    both = first.then(later)
    assert (both.num_drafted_tokens, both.draft_depth, both.num_draft_leaves) == (7, 6, 3)
    assert both.num_draft_misses == 2 and both.to_pb().num_draft_misses == 2
    assert both.expected_num_accepted_tokens == 2.0
    assert both.expected_accepted_tokens_by_nodes == [0.8]  # about the next step: the last run's
    msg = both.to_pb()
    assert (msg.draft_depth, msg.num_draft_leaves) == (6, 3)
    assert list(msg.expected_accepted_tokens_by_nodes) == pytest.approx([0.8])
