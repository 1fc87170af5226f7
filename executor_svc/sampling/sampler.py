"""Choosing tokens from logits: greedy, temperature, top-k, top-p, min-p, logprobs.

Randomness is counter-based: the uniform number behind a request's n-th output
token comes from a generator seeded by (request seed, n). A request therefore
samples the same tokens whatever batch it runs in, and after a preemption that
recomputes its KV, and the speculative verifier can draw the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service_common.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, counter: int) -> int:
    """splitmix64 of (seed, counter): well-spread generator seeds from nearby inputs."""
    z = (seed * 0x9E3779B97F4A7C15 + counter + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def uniform(seed: int, counter: int, stream: int = 0) -> float:
    """A float64 in [0, 1) determined by (seed, counter, stream)."""
    generator = torch.Generator().manual_seed(mix_seed(seed, counter * 8 + stream))
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def token_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: logits [V] float32 → probs [V] float32.

    Temperature first, then top-k, top-p and min-p cut the tempered distribution;
    the survivors are renormalised. Not for greedy requests (temperature 0).
    """
    probs = torch.softmax(logits / params.temperature, dim=-1)
    vocab_size = probs.shape[-1]
    if params.top_k and params.top_k < vocab_size:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep_sorted = mass_before < params.top_p * sorted_probs.sum()
        keep_sorted[0] = True
        keep = torch.zeros_like(keep_sorted).scatter_(0, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs / probs.sum()


def draw(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from probs [V] with a uniform u in [0, 1)."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    index = min(index, probs.shape[-1] - 1)
    while probs[index] == 0 and index > 0:  # never land on a filtered-out token at the end of the CDF
        index -= 1
    return index


@dataclass(frozen=True)
class SampleSpec:
    """One row of logits to turn into a token."""

    params: SamplingParams
    seed: int
    output_index: int  # which output token of the request this is (0 = the first)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None  # of the model's raw distribution; None unless logprobs were asked for
    top_logprobs: list[tuple[int, float]]  # the num_logprobs most likely (token id, logprob)


def token_logprobs(logits: torch.Tensor, token_id: int, num_logprobs: int) -> SampledToken:
    """The chosen token's log-probability under the model's raw distribution (logits [V]),
    and the top `num_logprobs` alternatives; no log-softmax when none were asked for."""
    if num_logprobs == 0:
        return SampledToken(token_id, None, [])
    logprobs = torch.log_softmax(logits, dim=-1)
    top = torch.topk(logprobs, num_logprobs)
    return SampledToken(
        token_id,
        float(logprobs[token_id]),
        list(zip(top.indices.tolist(), top.values.tolist())),
    )
