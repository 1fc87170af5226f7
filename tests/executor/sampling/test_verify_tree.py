"""Verifying draft trees: the longest root path whose tokens equal the targets,
greedy and sampled, and a chain keeps drafts while they equal the argmax."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from executor_svc.sampling.sampler import draw
from executor_svc.sampling.verifier import accept_tree, chain_parents


def greedy(argmax_rows):
    return lambda row, _: argmax_rows[row]


#         root
#        /    \
#   0: 5      1: 6
#    |       /    \
#   2: 7   3: 8   4: 9
#                   |
#                 5: 10
TOKENS = [5, 6, 7, 8, 9, 10]
PARENTS = [-1, -1, 0, 1, 1, 4]


@pytest.mark.parametrize(
    "argmax_rows,emitted,kept",
    [
        # the root's target is in no child: emit it, keep nothing
        ([1, 0, 0, 0, 0, 0, 0], [1], []),
        # the first branch wins, then its child is wrong
        ([5, 3, 0, 0, 0, 0, 0], [5, 3], [0]),
        # the first branch wins all the way (node 2 is a leaf: its row supplies the last token)
        ([5, 7, 0, 2, 0, 0, 0], [5, 7, 2], [0, 2]),
        # the first branch is rejected, the second accepted, then its second child and grandchild
        ([6, 0, 9, 0, 0, 10, 4], [6, 9, 10, 4], [1, 4, 5]),
        # second branch, first child, then a leaf
        ([6, 0, 8, 0, 11, 0, 0], [6, 8, 11], [1, 3]),
        # second branch, then no child matches
        ([6, 0, 12, 0, 0, 0, 0], [6, 12], [1]),
    ],
)
def test_greedy_keeps_the_longest_matching_root_path(argmax_rows, emitted, kept):
    assert accept_tree(greedy(argmax_rows), TOKENS, PARENTS) == (emitted, kept)


def test_the_output_offset_is_the_depth_not_the_row():
    offsets = []

    def target_at(row, j):
        offsets.append((row, j))
        return {0: 6, 2: 9, 5: 10, 6: 0}[row]

    accept_tree(target_at, TOKENS, PARENTS)
    assert offsets == [(0, 0), (2, 1), (5, 2), (6, 3)]


def test_malformed_trees_are_refused():
    with pytest.raises(ValueError, match="precede"):
        accept_tree(greedy([0, 0]), [1, 2], [1, -1])
    with pytest.raises(ValueError, match="sibling"):
        accept_tree(greedy([0, 0, 0]), [1, 1], [-1, -1])


@given(
    argmax_rows=st.lists(st.integers(0, 3), min_size=7, max_size=7),
    drafts=st.lists(st.integers(0, 3), max_size=6),
)
def test_a_chain_keeps_drafts_while_they_equal_the_argmax(argmax_rows, drafts):
    rows = argmax_rows[: len(drafts) + 1]
    emitted, kept = accept_tree(greedy(rows), drafts, chain_parents(len(drafts)))
    num_kept = next((j for j, draft in enumerate(drafts) if draft != rows[j]), len(drafts))
    assert (emitted, len(kept)) == (drafts[:num_kept] + [rows[num_kept]], num_kept)
    assert kept == list(range(len(kept)))


def test_sampled_trees_emit_exactly_the_tokens_plain_decoding_draws():
    """A model whose distribution depends on the whole context, and random trees that
    share a prefix with plain decoding's path for a while: with the same position-keyed
    uniforms, what the tree emits is plain decoding's output."""
    generator = torch.Generator().manual_seed(0)
    vocab = 4
    distributions: dict[tuple[int, ...], torch.Tensor] = {}

    def model(context: tuple[int, ...]) -> torch.Tensor:
        if context not in distributions:
            distributions[context] = torch.softmax(torch.randn(vocab, generator=generator, dtype=torch.float64) * 2, -1)
        return distributions[context]

    rng = random.Random(0)
    for _ in range(300):
        uniforms = [rng.random() for _ in range(12)]
        plain: list[int] = []
        for j in range(12):
            plain.append(draw(model(tuple(plain)), uniforms[j]))
        # A random tree: each new node under a random earlier node (or the root), with a
        # token that is often plain decoding's next token there.
        tokens, parents, paths = [], [], {-1: ()}
        for _ in range(rng.randint(0, 10)):
            parent = rng.randint(-1, len(tokens) - 1)
            path = paths[parent]
            token = (
                plain[len(path)] if rng.random() < 0.6 and path == tuple(plain[: len(path)]) else rng.randrange(vocab)
            )
            if any(p == parent and t == token for t, p in zip(tokens, parents)):
                continue
            tokens.append(token)
            parents.append(parent)
            paths[len(tokens) - 1] = path + (token,)
        emitted, kept = accept_tree(
            lambda row, j: draw(model(paths[row - 1]), uniforms[j]),
            tokens,
            parents,
        )
        assert emitted == plain[: len(emitted)]
        assert [tokens[i] for i in kept] == emitted[:-1]
