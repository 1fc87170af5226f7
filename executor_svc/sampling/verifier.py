"""Verifying draft tokens: which drafts a request keeps, and the token after them.

A request that drafted d_1..d_m computes [t, d_1, ..., d_m] in one pass (t is its
last sampled token), giving logits rows 0..m: row j is the model's distribution
for the position after d_j (row 0: after t).

Greedy: keep drafts while d_{j+1} equals row j's argmax; the first row whose
argmax differs (or row m when all are kept) supplies one more token. Each kept
token is exactly what plain decoding would have produced, so greedy output does
not depend on speculation.

Sampling (drafts are point masses, q = δ_d): draw y_j from row j's sampling
distribution p_j with the very uniform plain decoding would use for that output
position, and keep d_{j+1} iff y_j == d_{j+1}; the first y_j that differs (or y_m
when all are kept) is emitted after the kept drafts. Lossless: every emitted token
is y_j ~ p_j given exactly the tokens before it, so the output distribution is plain
sampling's; a draft is kept with probability p_j(d), the same acceptance rate as
the residual form ((p − q)+) of speculative sampling. And reproducible: the tokens
are the very ones plain decoding draws with the same seed, whether or not anything
was drafted (the residual form used a second uniform on rejection, so a seeded
request's tokens depended on what the drafter proposed).

The uniforms come from the request's counter-based stream (sampler.uniform) keyed
by the output index, so a step's outcome does not depend on the batch around it.

Trees (drafter.DraftTree): row 0 is t, row i + 1 is node i, computed at position
(length + depth) over t's context and its own ancestors only. Walk down from the
root: the target token of the current row (greedy: its argmax; sampling: y_j drawn
with output offset j's uniform, j = nodes kept so far) is looked up among the
current node's children (sibling tokens are distinct); if one holds it, keep that
child and go on, else emit the target and stop. The kept path is the longest root
path whose every token equals the target, and each emitted token is the very token
plain decoding gives at its output position, because the row that chose it saw
exactly the tokens before it (its ancestors) at their positions. A chain is the
tree with parents -1, 0, 1, ...: `verify` runs the same walk on it, so chains and
trees keep drafts by one rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from executor_svc.sampling.sampler import SampleSpec, draw, token_probabilities, uniform


def chain_parents(num_drafts: int) -> list[int]:
    """A chain's parent indexes as a tree's: -1, 0, 1, ..., num_drafts - 2."""
    return list(range(-1, num_drafts - 1))


def _children_by_token(token_ids: Sequence[int], parent_indexes: Sequence[int]) -> list[dict[int, int]]:
    """children[i + 1][token] = the node under node i holding token (children[0]: under the root)."""
    children: list[dict[int, int]] = [{} for _ in range(len(token_ids) + 1)]
    for node, (token_id, parent) in enumerate(zip(token_ids, parent_indexes)):
        if not -1 <= parent < node:
            raise ValueError(f"node {node}'s parent {parent} must precede it")
        if token_id in children[parent + 1]:
            raise ValueError(f"node {node} repeats its sibling's token {token_id}")
        children[parent + 1][token_id] = node
    return children


def accept_tree(
    target_at: Callable[[int, int], int], token_ids: Sequence[int], parent_indexes: Sequence[int]
) -> tuple[list[int], list[int]]:
    """The longest root path of a draft tree whose tokens equal the targets.

    target_at(row, j): the target token of logits row `row` (0 = the root, i + 1 =
    node i) at output offset j (= nodes kept before it). Returns (emitted tokens:
    the kept nodes' tokens then one target; the kept node indexes, root first).
    """
    children = _children_by_token(token_ids, parent_indexes)
    kept: list[int] = []
    row = 0
    while True:
        target = target_at(row, len(kept))
        node = children[row].get(target)
        if node is None:
            return [token_ids[i] for i in kept] + [target], kept
        kept.append(node)
        row = node + 1


def verify_tree(
    logits: torch.Tensor,
    argmax_ids: list[int],
    token_ids: Sequence[int],
    parent_indexes: Sequence[int],
    spec: SampleSpec,
) -> tuple[list[int], list[int]]:
    """One request's tree rows: logits [m + 1, V] float32 (row 0 the root), their argmax, its m nodes."""
    if spec.params.is_greedy:
        return accept_tree(lambda row, _: argmax_ids[row], token_ids, parent_indexes)
    return accept_tree(
        lambda row, j: draw(token_probabilities(logits[row], spec.params), uniform(spec.seed, spec.output_index + j)),
        token_ids,
        parent_indexes,
    )


def verify(
    logits: torch.Tensor, argmax_ids: list[int], draft_ids: list[int], spec: SampleSpec
) -> tuple[list[int], int]:
    """One request's chain rows: logits [m + 1, V] float32, their argmax, its m drafts → (emitted
    tokens, drafts kept): verify_tree on the chain."""
    emitted, kept = verify_tree(logits, argmax_ids, draft_ids, chain_parents(len(draft_ids)), spec)
    return emitted, len(kept)
