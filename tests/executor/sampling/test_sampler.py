"""The sampler: each filter keeps exactly the right tokens, draws follow the distribution,
seeds reproduce, logprobs are the model's."""

from __future__ import annotations

import math

import pytest
import torch

from executor_svc.sampling.sampler import SampleSpec, draw, token_logprobs, token_probabilities, uniform
from executor_svc.sampling.verifier import verify
from service_common.sampling_params import SamplingParams


def sample_one(logits_row, params, seed=0, output_index=0):
    """What a step with no drafts emits for a request with these logits."""
    emitted, num_accepted = verify(
        logits_row[None], [int(logits_row.argmax())], [], SampleSpec(params, seed, output_index)
    )
    assert num_accepted == 0 and len(emitted) == 1
    return emitted[0]


LOGITS = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))


def test_temperature_rescales_the_distribution():
    probs = token_probabilities(LOGITS, SamplingParams(temperature=0.5))
    expected = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    torch.testing.assert_close(probs, expected / expected.sum())


def test_top_k_keeps_the_k_most_likely():
    probs = token_probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.5 + 0.2 = 0.7 < 0.8, so the third token is needed; the fourth is not.
    probs = token_probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    # A tiny top_p still keeps the most likely token.
    probs = token_probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.01))
    torch.testing.assert_close(probs, torch.tensor([1.0, 0, 0, 0, 0]))


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    probs = token_probabilities(LOGITS, SamplingParams(temperature=1.0, min_p=0.3))  # threshold 0.15
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    n = 20000
    counts = torch.zeros(5)
    for i in range(n):
        counts[draw(probs, uniform(seed=1, counter=i))] += 1
    expected = probs * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5, chi2  # p = 0.001 at 4 degrees of freedom


def test_draw_never_returns_a_filtered_token():
    probs = torch.tensor([0.0, 0.6, 0.0, 0.4, 0.0])
    assert {draw(probs, u) for u in (0.0, 0.3, 0.59999, 0.6, 0.99999999)} <= {1, 3}


def test_seed_and_output_index_determine_the_draw():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0)
    first = [sample_one(logits[i], params, seed=42, output_index=i) for i in range(3)]
    again = [sample_one(logits[i], params, seed=42, output_index=i) for i in range(3)]
    assert first == again
    # Different seeds give different streams.
    others = {tuple(sample_one(logits[i], params, seed=s, output_index=i) for i in range(3)) for s in range(20)}
    assert len(others) > 5


def test_greedy_is_argmax_with_lowest_index_on_ties():
    logits = torch.tensor([0.0, 3.0, 3.0, 1.0])
    assert sample_one(logits, SamplingParams()) == 1


def test_logprobs_are_the_raw_model_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    token = token_logprobs(logits, 0, 2)
    reference = torch.log_softmax(logits, -1)
    assert math.isclose(token.logprob, float(reference[0]), rel_tol=1e-6)
    assert [i for i, _ in token.top_logprobs] == [0, 1]
    assert math.isclose(token.top_logprobs[1][1], float(reference[1]), rel_tol=1e-6)
    assert token_logprobs(logits, 0, 0).logprob is None


@pytest.mark.parametrize(
    "top_k,top_p,min_p", [(0, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1), (5, 0.8, 0.05)]
)
def test_sampled_tokens_respect_every_filter(top_k, top_p, min_p):
    logits = torch.randn(200, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    allowed = set(torch.nonzero(token_probabilities(logits, params)).squeeze(1).tolist())
    for i in range(300):
        assert sample_one(logits, params, seed=9, output_index=i) in allowed


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 9.9e-6])
def test_a_vanishing_temperature_is_greedy(temperature):
    """Issue 12, item 10: 1e-38 used to overflow into NaN probabilities and a garbage token."""
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=temperature)
    assert params.is_greedy
    for seed in range(20):
        logits = torch.randn(50, generator=generator) * 10
        assert sample_one(logits, params, seed=seed) == int(logits.argmax())


def test_the_smallest_sampling_temperature_still_gives_a_distribution():
    probs = token_probabilities(torch.randn(50) * 30, SamplingParams(temperature=1e-5))
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1.0) < 1e-5
