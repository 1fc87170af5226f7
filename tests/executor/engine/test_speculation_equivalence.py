"""Speculation never changes output.

Greedy, on the embedded model: a request's tokens are identical with speculation off,
fixed draft budgets 1/2/4/8 and budgets that change every step (what the seed and
goodput policies do), at batch sizes 1 to 16 with requests joining and leaving, and
across prefill chunk sizes; with prompts whose drafts are accepted in long runs
(copying code) and prompts whose drafts are mostly rejected.

Sampling, on a tiny model: speculation on and off draw from the same distribution
(a chi-square test over many seeds), and a seeded request draws the very same tokens.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from scipy.stats import chi2_contingency

from executor_svc.engine.request_state import NewRequest
from service_common.sampling_params import SamplingParams
from tests.support.engine_driver import drive
from tests.support.prompts import CODE, PLAIN_PROMPTS
from tests.support.tiny_gguf import TinyModelSpec

NUM_NEW_TOKENS = 40

COPY_SOURCE = """class RateLimiter:
    def __init__(self, rate, burst):
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.updated = time.monotonic()

    def allow(self):
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False
"""


@pytest.fixture(scope="module")
def prompts(engine_default):
    tok = engine_default.tokenizer.tokenizer

    def chat(text):
        return "<|im_start|>user\n" + text + "<|im_end|>\n<|im_start|>assistant\n"

    texts = [
        chat("Repeat this code exactly, renaming RateLimiter to TokenBucket:\n\n" + COPY_SOURCE),
        chat("Copy this function verbatim:\n\n" + CODE + "    return merge(left, right)\n"),
        "Here is the file again, unchanged:\n" + COPY_SOURCE + "\nAnd once more:\n" + COPY_SOURCE[:200],
        CODE * 2,
        *PLAIN_PROMPTS[1:5],
    ]
    return [tok.encode(t, add_special_tokens=False).ids for t in texts]


def requests_for(prompts, copies=2):
    reqs = []
    for c in range(copies):
        for i, ids in enumerate(prompts):
            reqs.append(
                NewRequest(f"p{i}c{c}", ids if c == 0 else ids[1:], SamplingParams(), NUM_NEW_TOKENS, ignore_eos=True)
            )
    return reqs


@pytest.fixture(scope="module")
def baseline(engine_default, prompts):
    """Speculation off: every request's tokens (batch-invariant, so any batch will do)."""
    run = drive(engine_default, requests_for(prompts))
    assert run.num_drafted == 0
    return run.tokens


@pytest.mark.parametrize("budget,chunk_size", [(1, 7), (2, 16), (4, 64), (8, None)])
def test_fixed_budgets_change_no_token(engine_default, prompts, baseline, budget, chunk_size):
    reqs = requests_for(prompts)
    arrivals = {r.request_id: 2 * i for i, r in enumerate(reqs)}
    run = drive(engine_default, reqs, chunk_size=chunk_size, arrival_steps=arrivals, draft_budget=budget)
    assert run.max_batch_size >= 8
    for r in reqs:
        assert run.tokens[r.request_id] == baseline[r.request_id], (r.request_id, budget)
    assert run.num_accepted > 0.2 * len(reqs) * NUM_NEW_TOKENS / 2, "copy prompts should accept long drafts"
    assert run.num_drafted > run.num_accepted, "some drafts should be rejected"


def test_budgets_that_change_every_step_change_no_token(engine_default, prompts, baseline):
    rng = random.Random(0)
    budgets: dict[tuple[int, str], int] = {}

    def budget(step, request_id):
        return budgets.setdefault((step, request_id), rng.choice([0, 0, 1, 2, 3, 5, 8, 16]))

    reqs = requests_for(prompts)
    # Requests join over time and leave when done: live batch sizes sweep 1..16.
    arrivals = {r.request_id: (0 if i == 0 else 3 + 3 * i) for i, r in enumerate(reqs)}
    run = drive(engine_default, reqs, chunk_size=5, arrival_steps=arrivals, draft_budget=budget)
    for r in reqs:
        assert run.tokens[r.request_id] == baseline[r.request_id], r.request_id


def test_batch_of_one_with_long_drafts(engine_default, prompts, baseline):
    for r in requests_for(prompts[:2], copies=1):
        run = drive(engine_default, [r], draft_budget=16)
        assert run.tokens[r.request_id] == baseline[r.request_id]
        assert run.num_steps < NUM_NEW_TOKENS, "copying should take fewer steps than tokens"
    assert engine_default.kv.num_free_blocks == engine_default.kv.num_usable_blocks


def test_drafts_never_overrun_max_new_tokens_or_stop_tokens(engine_default, prompts, baseline):
    r = requests_for(prompts[:1], copies=1)[0]
    expected = baseline[r.request_id]
    short = NewRequest("short", r.prompt_token_ids, SamplingParams(), 7, ignore_eos=True)
    assert drive(engine_default, [short], draft_budget=16).tokens["short"] == expected[:7]
    stop = expected[12]
    stopped = NewRequest(
        "stop", r.prompt_token_ids, SamplingParams(), 40, stop_token_ids=frozenset({stop}), ignore_eos=True
    )
    assert drive(engine_default, [stopped], draft_budget=16).tokens["stop"] == expected[: expected.index(stop) + 1]


# ------------------------------------------------------------------- sampling

# The tiny model's logits are sharp (its top token leads the next by ~80 nats): at
# ordinary temperatures every seed samples the same tokens and nothing is tested.
TINY_MODEL_TEMPERATURE = 20.0


@pytest.fixture(scope="module")
def tiny_engine(make_tiny_engine):
    return make_tiny_engine(TinyModelSpec(seed=3), kv_cache_bytes=8 << 20)


def test_sampling_distribution_is_unchanged_by_speculation(tiny_engine):
    # A repetitive prompt makes the drafter propose; the temperature makes drafts plausible, not certain.
    prompt = [40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41, 42]
    params = dict(temperature=TINY_MODEL_TEMPERATURE)
    num_seeds = 400

    def outcomes(budget):
        reqs = [
            NewRequest(f"s{seed}", prompt, SamplingParams(seed=seed, **params), 3, ignore_eos=True)
            for seed in range(num_seeds)
        ]
        run = drive(tiny_engine, reqs, draft_budget=budget)
        return [tuple(run.tokens[r.request_id]) for r in reqs], run

    off, _ = outcomes(0)
    on, run_on = outcomes(4)
    assert run_on.num_drafted > 100 and run_on.num_accepted > 20, "speculation was not exercised"
    for position in range(3):
        a = Counter(o[position] for o in off)
        b = Counter(o[position] for o in on)
        tokens = [t for t, _ in (a + b).most_common(8)]
        table = [
            [a[t] for t in tokens] + [num_seeds - sum(a[t] for t in tokens)],
            [b[t] for t in tokens] + [num_seeds - sum(b[t] for t in tokens)],
        ]
        table = [list(col) for col in zip(*[c for c in zip(*table) if sum(c) > 0])]
        _, p_value, _, _ = chi2_contingency(table)
        assert p_value > 0.001, f"position {position}: distributions differ (p={p_value:.2g}) {table}"


def test_seeded_sampling_gives_the_same_tokens_with_speculation_on_and_off(tiny_engine):
    """Issue 12, item 7: a seed reproduces its tokens whether or not drafts were proposed."""
    prompt = [40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41, 42]
    params = dict(temperature=TINY_MODEL_TEMPERATURE)

    def tokens(budget):
        reqs = [
            NewRequest(f"s{seed}", prompt, SamplingParams(seed=seed, **params), 8, ignore_eos=True)
            for seed in range(40)
        ]
        run = drive(tiny_engine, reqs, draft_budget=budget)
        return {r.request_id: run.tokens[r.request_id] for r in reqs}, run

    off, _ = tokens(0)
    on, run_on = tokens(4)
    assert len({tuple(t) for t in off.values()}) > 20, "the seeds should sample different tokens"
    assert run_on.num_drafted > 50 and run_on.num_accepted > 10, "speculation was not exercised"
    assert on == off


@pytest.mark.parametrize("temperature", [0.0, TINY_MODEL_TEMPERATURE])
def test_a_request_sent_again_with_its_output_so_far_continues_token_for_token(tiny_engine, temperature):
    """What the scheduler does after an executor restart: prompt + the tokens already streamed,
    as output_token_ids; greedy and seeded sampling go on exactly as undisturbed."""
    prompt = [40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41, 42]
    params = SamplingParams(temperature=temperature, seed=7)
    whole = drive(tiny_engine, [NewRequest("whole", prompt, params, 24, ignore_eos=True)], draft_budget=4).tokens[
        "whole"
    ]
    for cut in (1, 9, 23):
        again = NewRequest(f"again{cut}", prompt, params, 24, ignore_eos=True, output_token_ids=tuple(whole[:cut]))
        rest = drive(tiny_engine, [again], draft_budget=4).tokens[again.request_id]
        assert whole[:cut] + rest == whole, cut
