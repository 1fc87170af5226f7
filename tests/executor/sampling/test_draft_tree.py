"""Draft trees: the follower counts against brute force, the tree's shape, the
module docstring's worked example, and the chain as the special case."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.sampling.drafter import (
    Drafter,
    DraftTree,
    NodeCalibration,
    RequestIndex,
    SwarmIndex,
    grow_tree,
    match_confidence,
)


def letters(text: str) -> list[int]:
    return [ord(c) for c in text.replace(" ", "")]


def as_letters(token_ids: list[int]) -> str:
    return " ".join(chr(t) for t in token_ids)


def brute_force_followers(documents: list[list[int]], query: list[int], max_ngram: int) -> tuple[int, dict[int, int]]:
    """(n, {token: count}) straight from the rule: the longest suffix n-gram of `query`
    (n <= max_ngram) that occurs in a document with a token after it, and how often
    each token followed it there."""
    for n in range(min(max_ngram, len(query)), 0, -1):
        suffix = query[len(query) - n :]
        counts: dict[int, int] = {}
        for document in documents:
            for end in range(n, len(document)):  # occurrence document[end - n : end], follower document[end]
                if document[end - n : end] == suffix:
                    counts[document[end]] = counts.get(document[end], 0) + 1
        if counts:
            return n, counts
    return 0, {}


def brute_force_votes(history: list[int], path: list[int], max_ngram: int) -> tuple[int, dict[int, int]]:
    """(n + len(path), {token: votes}) straight from the rule: the occurrences of the history's
    longest match (n tokens; the 32 most recent) that go on along `path` (read in the history
    followed by the path), and the tokens that follow them there."""
    n, _ = brute_force_followers([history], history, max_ngram)
    suffix, sequence = history[len(history) - n :], history + path
    starts = [end for end in range(len(history) - 1, n - 1, -1) if history[end - n : end] == suffix][:32]
    votes: dict[int, int] = {}
    for start in starts:
        if sequence[start : start + len(path)] == path:
            token = sequence[start + len(path)]
            votes[token] = votes.get(token, 0) + 1
    return n + len(path), votes


def check_is_a_tree(tree: DraftTree, max_nodes: int) -> None:
    assert tree.num_nodes <= max_nodes
    assert len(tree.parent_indexes) == len(tree.path_probabilities) == tree.num_nodes
    siblings: set[tuple[int, int]] = set()
    for i, parent in enumerate(tree.parent_indexes):
        assert -1 <= parent < i  # parents precede children
        assert (parent, tree.token_ids[i]) not in siblings  # no duplicate sibling tokens
        siblings.add((parent, tree.token_ids[i]))
        parent_probability = 1.0 if parent < 0 else tree.path_probabilities[parent]
        assert 0 < tree.path_probabilities[i] <= parent_probability


# ------------------------------------------------------------- hand-worked


def test_module_docstring_tree_example():
    tree = RequestIndex(letters("x a b c y a b d z a b"), max_ngram=3).propose_tree(4)
    assert as_letters(tree.token_ids) == "d c z y"
    assert tree.parent_indexes == [-1, -1, 0, 1]
    assert tree.path_probabilities == [0.375, 0.375, 0.375 * 0.875, 0.375 * 0.875]
    assert tree.depths() == [1, 1, 2, 2]
    assert as_letters(tree.path(3)) == "c y"
    assert tree.expected_num_accepted_tokens == 0.375 * 2 + 0.375 * 0.875 * 2


def test_module_docstring_tree_shape_and_what_each_node_budget_buys():
    tree = RequestIndex(letters("x a b c y a b d z a b"), max_ngram=3).propose_tree(4)
    assert tree.depth == 2 and tree.num_leaves == 2
    assert tree.expected_num_accepted_tokens_by_nodes() == pytest.approx(
        [0.375, 0.75, 0.75 + 0.375 * 0.875, 0.75 + 0.375 * 0.875 * 2]
    )
    chain = DraftTree([5, 6, 7], [-1, 0, 1], [0.5, 0.25, 0.125])
    assert (chain.depth, chain.num_leaves) == (3, 1)
    assert DraftTree([], [], []).depth == DraftTree([], [], []).num_leaves == 0
    assert DraftTree([], [], []).expected_num_accepted_tokens_by_nodes() == []


def test_drafter_next_tree_is_the_full_budget_tree():
    drafter = Drafter(max_draft_tokens=5, max_ngram=3)
    drafter.add_request("r", letters("x a b c y a b d z a b"))
    assert drafter.next_tree("r") == drafter.propose_tree("r", 5)


def test_calibration_docstring_example_and_its_prior():
    calibration = NodeCalibration(decay=1.0)
    assert calibration(0.98) == 0.98 and calibration(0.3) == 0.3  # before any verification: the evidence
    chain = DraftTree([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3], [0.98] * 5, [0.98] * 5)
    calibration.observe(chain, [0, 1, 2])  # 0..2 kept, 3 rejected, 4 under a rejected node: no outcome
    assert calibration(0.98) == pytest.approx((3 + 2 * 0.98) / (4 + 2))
    calibration.observe(DraftTree([6], [-1], [0.98], [0.98]), [])
    assert calibration(0.98) == pytest.approx((3 + 2 * 0.98) / (5 + 2))
    assert calibration(0.96) == pytest.approx((3 + 2 * 0.96) / (5 + 2))  # the same bin (0.95-0.99), its own prior
    assert calibration(0.3) == 0.3  # other bins are untouched


def test_calibration_files_every_node_whose_parent_was_kept():
    calibration = NodeCalibration(decay=1.0)
    # Root's children 0 (x) and 1 (y); 2 under 0, 3 under 1. Verification kept 1: y.
    tree = DraftTree([7, 8, 9, 10], [-1, -1, 0, 1], [0.5, 0.4, 0.45, 0.2], [0.5, 0.4, 0.9, 0.5])
    calibration.observe(tree, [1])
    assert calibration.totals() == (3.0, 1.0)  # nodes 0, 1 and 3 (node 2's parent was rejected)
    assert calibration(0.4) == pytest.approx((1 + 2 * 0.4) / 3)  # node 1, kept
    assert calibration(0.5) == pytest.approx((0 + 2 * 0.5) / 4)  # nodes 0 and 3, rejected
    assert calibration(0.9) == 0.9


def test_verified_trees_calibrate_the_next_ones():
    """A copy the model keeps leaving: once verification has rejected its sure-looking nodes,
    the drafter expects less of the same tree, and the path probabilities are the calibrated
    chances multiplied down the path."""
    history = letters("p q r s t u v w p q r s t u v w p q r")
    drafter = Drafter(max_draft_tokens=4, max_ngram=3)
    drafter.add_request("r", history)
    before = drafter.next_tree("r")
    assert before.is_chain() and before.expected_num_accepted_tokens > 3.0  # evidence 0.875-0.98 a node
    for _ in range(20):
        drafter.observe_tree(before, [0])  # the first node kept, the second rejected
    after = drafter.next_tree("r")
    assert after.token_ids == before.token_ids and after.node_evidence == before.node_evidence
    assert after.expected_num_accepted_tokens < 0.6 * before.expected_num_accepted_tokens
    probability = 1.0
    for evidence, path_probability in zip(after.node_evidence, after.path_probabilities):
        probability *= drafter.calibration(evidence)
        assert path_probability == pytest.approx(probability)


def swarm_drafter(outputs: dict[str, str], reader_prompt: str) -> Drafter:
    drafter = Drafter(max_draft_tokens=6, use_swarm_index=True, max_ngram=4)
    for request_id, text in outputs.items():
        drafter.add_request(request_id, [])
        drafter.append(request_id, letters(text))
    drafter.add_request("reader", letters(reader_prompt))
    return drafter


def test_propose_tree_takes_next_trees_first_nodes_only_while_the_indexes_are_unchanged():
    """The executor grows next_tree for the result's curve; the next step's propose_tree takes
    its first nodes instead of growing it again, unless an index grew in between."""
    drafter = swarm_drafter({"w1": "g o o d b y e", "w2": "g o a l s"}, "s a y g o")
    grown = drafter.next_tree("reader")
    reused = drafter.propose_tree("reader", 3)
    assert reused == grown.first(3)
    assert reused == swarm_drafter({"w1": "g o o d b y e", "w2": "g o a l s"}, "s a y g o").propose_tree("reader", 3)

    stale = drafter.next_tree("reader")
    drafter.append("w2", letters("g o o f y g o o f y"))  # another request's output: the swarm index grows
    fresh = swarm_drafter({"w1": "g o o d b y e", "w2": "g o a l s g o o f y g o o f y"}, "s a y g o")
    assert drafter.propose_tree("reader", 6) == fresh.propose_tree("reader", 6) != stale


def test_counts_decide_before_recency():
    # [a] was followed by x three times, by y once (the most recent): x is the likelier child;
    # the three occurrences that went on with x all went on with a ([a x] matched: confidence
    # 3/4), two of those with x (2/3, at 7/8), and both of them with a (15/16): all likelier
    # than the root's y.
    tree = RequestIndex(letters("a x a x a x a y a"), max_ngram=1).propose_tree(5)
    assert as_letters(tree.token_ids) == "x a x a y"
    assert tree.parent_indexes == [-1, 0, 1, 2, -1]
    x, xa = 0.75 * 0.5, 0.75 * 0.5 * 0.75
    xax = xa * 2 / 3 * 0.875
    assert tree.path_probabilities == pytest.approx([x, xa, xax, xax * 0.9375, 0.25 * 0.5])


def test_a_branch_keeps_its_place_in_the_copied_text():
    """Near-identical blocks that differ in two places, far apart (past max_ngram): a branch
    that took a block's first difference takes its second one too, where re-matching the last
    max_ngram tokens ([m m m]) would vote for every block there."""
    blocks = [f"< {k} m m m m m m m {k} >" for k in "123"]
    index = RequestIndex(letters(" ".join(blocks) + " <"), max_ngram=3)
    tree = index.propose_tree(30)
    # [> <] went on with 2 and with 3 (block 1 came first): a branch each, as far as the block's end.
    assert sorted(chr(tree.token_ids[i]) for i, parent in enumerate(tree.parent_indexes) if parent < 0) == ["2", "3"]
    for k in "23":
        ends = [as_letters(tree.path(i)) for i in range(tree.num_nodes) if tree.path(i)[-1] == ord(">")]
        assert [e for e in ends if e.startswith(k)] == [f"{k} m m m m m m m {k} >"]


def test_nothing_matches_gives_an_empty_tree():
    assert RequestIndex(letters("a b c d")).propose_tree(8) == DraftTree([], [], [], [])
    assert RequestIndex(letters("a b a b")).propose_tree(0) == DraftTree([], [], [], [])
    # min_ngram: a one-token match is not enough
    assert RequestIndex(letters("a x a y a"), min_ngram=2).propose_tree(8).num_nodes == 0


def test_near_identical_functions_branch_where_they_differ():
    """The branchy copy workload in small: three copies of one line that differ in one
    token; the tree holds all three continuations where the chain holds one."""
    history = letters("f ( x ) = x + 1 ; f ( x ) = x + 2 ; f ( x ) = x + 3 ; f ( x ) = x +")
    index = RequestIndex(history, max_ngram=4)
    assert as_letters(index.propose(3)) == "3 ; f"
    tree = index.propose_tree(6)
    roots = sorted(chr(tree.token_ids[i]) for i, p in enumerate(tree.parent_indexes) if p == -1)
    assert roots == ["1", "2", "3"]
    assert tree.token_ids[0] == ord("3")  # equal counts: the most recent first


def test_swarm_followers_count_everyones_output_and_forget_evicted_output():
    swarm = SwarmIndex(max_ngram=2, max_num_tokens=8)
    swarm.append("r1", letters("a b c"))
    swarm.append("r2", letters("a b d"))
    assert swarm.followers(letters("z a b")) == (2, [(ord("d"), 1), (ord("c"), 1)])
    swarm.append("r3", letters("a b e"))  # 9 tokens > 8: r1's document goes
    assert swarm.followers(letters("z a b")) == (2, [(ord("e"), 1), (ord("d"), 1)])


def test_drafter_tree_uses_the_swarm_and_caps_at_max_draft_tokens():
    drafter = Drafter(max_draft_tokens=3, use_swarm_index=True, max_ngram=4)
    drafter.add_request("writer", [])
    drafter.append("writer", letters("g o o d b y e"))
    drafter.add_request("reader", letters("s a y g o"))
    tree = drafter.propose_tree("reader", 10)
    assert as_letters(tree.token_ids) == "o d b"
    assert tree.is_chain()


def test_grow_tree_keeps_the_best_nodes_of_a_wide_fan_out():
    def followers_of(path):  # ten children of the root, then nothing
        return (8, [(t, 10 - t) for t in range(10)]) if not path else (0, [])

    tree = grow_tree(followers_of, 3)
    assert tree.token_ids == [0, 1, 2]
    assert tree.parent_indexes == [-1, -1, -1]


# ------------------------------------------------------------------ properties


@settings(max_examples=200, deadline=None)
@given(
    history=st.lists(st.integers(0, 3), max_size=40),
    path=st.lists(st.integers(0, 3), max_size=4),
    max_ngram=st.integers(1, 5),
)
def test_follower_counts_equal_brute_force(history, path, max_ngram):
    n, counted = RequestIndex(history, max_ngram=max_ngram).followers(path)
    expected_n, expected_counts = brute_force_followers([history], history + path, max_ngram)
    assert n == expected_n
    assert dict(counted) == expected_counts
    assert len(counted) == len(expected_counts)  # no token twice


@settings(max_examples=150, deadline=None)
@given(
    appends=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 2), max_size=6)), max_size=20),
    query=st.lists(st.integers(0, 2), max_size=6),
    max_num_tokens=st.sampled_from([0, 7, 20, 10_000]),
    max_ngram=st.integers(1, 4),
)
def test_swarm_follower_counts_equal_brute_force_over_live_output(appends, query, max_num_tokens, max_ngram):
    swarm = SwarmIndex(max_ngram=max_ngram, max_num_tokens=max_num_tokens)
    for slot, token_ids in appends:
        swarm.append(f"r{slot}", token_ids)
    live_documents = list(swarm._documents.values())  # what eviction left: the documents themselves
    n, counted = swarm.followers(query)
    expected_n, expected_counts = brute_force_followers(live_documents, query, max_ngram)
    assert (n, dict(counted)) == (expected_n, expected_counts)


@settings(max_examples=200, deadline=None)
@given(
    history=st.lists(st.integers(0, 3), max_size=40),
    max_nodes=st.integers(0, 12),
    max_ngram=st.integers(1, 5),
    min_ngram=st.integers(1, 2),
)
def test_every_tree_is_a_tree_of_followers(history, max_nodes, max_ngram, min_ngram):
    index = RequestIndex(history, max_ngram=max_ngram, min_ngram=max(1, min(min_ngram, max_ngram)))
    tree = index.propose_tree(max_nodes)
    check_is_a_tree(tree, max_nodes)
    for i in range(tree.num_nodes):
        path = tree.path(i)
        _, counts = brute_force_followers([history], history + path[:-1], max_ngram)
        assert counts.get(path[-1], 0) > 0  # each node followed its context somewhere in the history
        matched, votes = brute_force_votes(history, path[:-1], max_ngram)
        parent = tree.parent_indexes[i]
        parent_probability = 1.0 if parent < 0 else tree.path_probabilities[parent]
        expected = parent_probability * votes[path[-1]] / sum(votes.values()) * match_confidence(matched)
        assert tree.path_probabilities[i] == pytest.approx(expected)


@settings(max_examples=200, deadline=None)
@given(
    base=st.lists(st.integers(0, 1000), min_size=2, max_size=30, unique=True),
    data=st.data(),
    max_nodes=st.integers(0, 40),
)
def test_one_continuation_everywhere_gives_todays_chain(base, data, max_nodes):
    """A history where every context has one follower (distinct tokens, then a copy
    of a prefix of them): the tree is a chain and starts with today's chain draft."""
    num_copied = data.draw(st.integers(1, len(base)), label="num_copied")
    index = RequestIndex(base + base[:num_copied])
    tree = index.propose_tree(max_nodes)
    assert tree.is_chain()
    chain = index.propose(max_nodes)
    assert tree.token_ids[: len(chain)] == chain
    assert tree.num_nodes == max_nodes  # the copy cycles back into base: it never runs dry


@settings(max_examples=200, deadline=None)
@given(
    history=st.lists(st.integers(0, 3), max_size=40),
    max_nodes=st.integers(1, 12),
    max_ngram=st.integers(1, 5),
)
def test_a_smaller_budget_grows_the_first_nodes_of_the_full_tree(history, max_nodes, max_ngram):
    """What the executor reports as the expected accepted tokens of n nodes (the n-th value of
    tree's curve) is what a budget of n buys: the tree grown with n is the full tree's first
    n nodes; and each node adds no more than the one before (the policy's gains only fall)."""
    index = RequestIndex(history, max_ngram=max_ngram)
    full = index.propose_tree(max_nodes)
    curve = full.expected_num_accepted_tokens_by_nodes()
    assert len(curve) == full.num_nodes
    for n in range(1, full.num_nodes + 1):
        smaller = index.propose_tree(n)
        assert smaller.token_ids == full.token_ids[:n]
        assert smaller.parent_indexes == full.parent_indexes[:n]
        assert smaller.expected_num_accepted_tokens == pytest.approx(curve[n - 1])
    gains = [b - a for a, b in zip([0.0, *curve], curve)]
    assert all(later <= earlier + 1e-12 for earlier, later in zip(gains, gains[1:]))  # each node buys less
    assert full.depth == max(full.depths(), default=0)
    assert full.num_leaves == sum(1 for i in range(full.num_nodes) if i not in full.parent_indexes)
