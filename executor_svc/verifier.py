"""Verifying draft tokens: which drafts a request keeps, and the token after them.

A request that drafted d_1..d_m computes [t, d_1, ..., d_m] in one pass (t is its
last sampled token), giving logits rows 0..m: row j is the model's distribution
for the position after d_j (row 0: after t).

Greedy: keep drafts while d_{j+1} equals row j's argmax; the first row whose
argmax differs (or row m when all are kept) supplies one more token. Each kept
token is exactly what plain decoding would have produced, so greedy output does
not depend on speculation.

Sampling (drafts are point masses, q = δ_d): keep d with probability p(d), where p
is row j's sampling distribution; on rejection draw from p with d removed and
renormalised, i.e. the residual (p − q)+. This is standard speculative sampling
with a deterministic proposal: P(emit x) = [x = d]·p(d) + (1 − p(d))·p(x)/(1 − p(d))
= p(x) for every x, so the output distribution is exactly plain sampling's. If all m
drafts are kept, the bonus token is drawn from row m.

The uniforms come from the request's counter-based stream (sampler.uniform) keyed
by the output index, with separate streams for the accept test and the residual
draw, so a step's outcome does not depend on the batch around it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor_svc.sampler import SampleSpec, draw, token_probabilities, uniform

ACCEPT_STREAM = 1
RESIDUAL_STREAM = 2


def accept_greedy(argmax_ids: list[int], draft_ids: list[int]) -> tuple[list[int], int]:
    """argmax of rows 0..m and drafts d_1..d_m → (emitted tokens, number of drafts kept)."""
    num_accepted = 0
    while num_accepted < len(draft_ids) and draft_ids[num_accepted] == argmax_ids[num_accepted]:
        num_accepted += 1
    return draft_ids[:num_accepted] + [argmax_ids[num_accepted]], num_accepted


def accept_sampled(
    probs_of_row: Callable[[int], torch.Tensor],
    draft_ids: list[int],
    uniform_at: Callable[[int, int], float],
) -> tuple[list[int], int]:
    """Speculative sampling with point-mass drafts.

    probs_of_row(j): row j's sampling distribution [V]; uniform_at(j, stream): a
    uniform in [0, 1) for output offset j. Returns (emitted tokens, drafts kept).
    """
    for j, draft in enumerate(draft_ids):
        probs = probs_of_row(j)
        p_draft = float(probs[draft])
        if uniform_at(j, ACCEPT_STREAM) < p_draft:
            continue
        residual = probs.clone()
        residual[draft] = 0.0
        return draft_ids[:j] + [draw(residual / residual.sum(), uniform_at(j, RESIDUAL_STREAM))], j
    m = len(draft_ids)
    return draft_ids + [draw(probs_of_row(m), uniform_at(m, 0))], m


def verify(logits: torch.Tensor, argmax_ids: list[int], draft_ids: list[int], spec: SampleSpec) -> tuple[list[int], int]:
    """One request's rows: logits [m + 1, V] float32, their argmax, its m drafts."""
    if spec.params.is_greedy:
        return accept_greedy(argmax_ids, draft_ids)
    return accept_sampled(
        lambda j: token_probabilities(logits[j], spec.params),
        draft_ids,
        lambda j, stream: uniform(spec.seed, spec.output_index + j, stream),
    )
