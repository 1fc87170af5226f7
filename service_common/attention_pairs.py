"""Attention pairs: the cost measure of a step's attention that both services count alike.

A query row at position p of a request attends the p + 1 keys up to and including its own
(causal), so `num_tokens` consecutive rows after `num_cached_tokens` cached ones attend

    Σ_{i=1..n} (c + i) = n·c + n(n + 1)/2        (c = num_cached_tokens, n = num_tokens)

(query, key) pairs. The attention's arithmetic is proportional to it (q·k and p·v for every
pair), whatever splits the rows into steps. One decode row reads its whole context (c + 1); a
256-token chunk at 4k of context, ~1.1M pairs, costs ~256 decode rows' attention, not one
request's context length — the measure that let a long prompt's chunks look cheap to the
scheduler's cost model (its mixed steps at 3-5k of context ran 1.1-1.4x the prediction).
"""

from __future__ import annotations


def attention_pairs(num_cached_tokens: int, num_tokens: int) -> int:
    """(query, key) pairs of `num_tokens` causal query rows after `num_cached_tokens` cached tokens."""
    if num_cached_tokens < 0 or num_tokens < 0:
        raise ValueError(f"token counts must be non-negative, got {num_cached_tokens} and {num_tokens}")
    return num_tokens * num_cached_tokens + num_tokens * (num_tokens + 1) // 2
