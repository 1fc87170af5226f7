"""The engine on the embedded model: greedy tokens equal transformers', and equal their
solo run whatever the batch, the prefill chunk size or who joins and leaves."""

from __future__ import annotations

import pytest
import torch

from executor_svc.engine.request_state import FinishReason, NewRequest
from executor_svc.model.cpu_ops import CpuOps
from service_common.sampling_params import SamplingParams
from tests.support.engine_driver import drive
from tests.support.prompts import CHAT_MESSAGES, PLAIN_PROMPTS

NUM_NEW_TOKENS = 64
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def prompt_ids(hf_reference):
    tokenizer, _ = hf_reference
    ids = [tokenizer.encode(text, add_special_tokens=True) for text in PLAIN_PROMPTS]
    for messages in CHAT_MESSAGES:
        ids.append(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
    assert len(ids) >= 8
    return [list(map(int, x)) for x in ids]


def greedy_requests(prompt_ids, prefix="p", num_logprobs=0):
    # EOS is an ordinary token here, so every request runs the full length.
    return [
        NewRequest(f"{prefix}{i}", ids, SamplingParams(num_logprobs=num_logprobs), NUM_NEW_TOKENS, ignore_eos=True)
        for i, ids in enumerate(prompt_ids)
    ]


def solo(engine, prompt_ids):
    """Each prompt alone, whole-prompt prefill, with top-2 logprobs to judge near-ties."""
    runs = {}
    for request in greedy_requests(prompt_ids, num_logprobs=2):
        run = drive(engine, [request])
        assert run.finish_reasons[request.request_id] == FinishReason.LENGTH
        runs[request.request_id] = (run.tokens[request.request_id], run.logprobs[request.request_id])
    return runs


@pytest.fixture(scope="module")
def solo_runs(engine_fp32, prompt_ids):
    return solo(engine_fp32, prompt_ids)


@pytest.fixture(scope="module")
def solo_runs_default(engine_default, prompt_ids):
    assert engine_default.model_runner.matmul in ("int16", "exact")
    return solo(engine_default, prompt_ids)


@torch.inference_mode()
def hf_greedy(model, ids, num_new_tokens):
    """Plain argmax decoding with transformers, returning tokens and each step's logits."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens, logits = [], []
    for _ in range(num_new_tokens):
        step_logits = out.logits[0, -1].float()
        token = int(step_logits.argmax())
        tokens.append(token)
        logits.append(step_logits)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logits


def top2(logits):
    values, indices = torch.topk(logits, 2)
    return indices.tolist(), float(values[0] - values[1])


def test_greedy_tokens_equal_transformers(hf_reference, prompt_ids, solo_runs):
    _, model = hf_reference
    near_ties = []
    for i, ids in enumerate(prompt_ids):
        ours, our_logprobs = solo_runs[f"p{i}"]
        theirs, their_logits = hf_greedy(model, ids, NUM_NEW_TOKENS)
        if ours == theirs:
            continue
        at = next(j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        their_top, their_gap = top2(their_logits[at])
        our_top = [token_id for token_id, _ in our_logprobs[at].top_logprobs]
        our_gap = our_logprobs[at].top_logprobs[0][1] - our_logprobs[at].top_logprobs[1][1]
        genuine = (
            their_gap < NEAR_TIE and our_gap < NEAR_TIE and set(their_top) == set(our_top) == {ours[at], theirs[at]}
        )
        assert genuine, (
            f"prompt {i} diverges from transformers at token {at}: ours {ours[at]} theirs {theirs[at]}; "
            f"transformers top-2 {their_top} gap {their_gap:.2e}, ours top-2 {our_top} gap {our_gap:.2e}"
        )
        near_ties.append((i, at, their_gap))
    print(
        f"\nprompts: {len(prompt_ids)}, identical to transformers: {len(prompt_ids) - len(near_ties)}, near-ties: {near_ties}"
    )
    # A genuine near-tie is allowed at most rarely; more would hide a real bug.
    assert len(near_ties) <= 1, f"too many near-tie divergences: {near_ties}"


@pytest.mark.parametrize("chunk_size", [1, 7, 64, None])
def test_batched_tokens_equal_solo_tokens(engine_fp32, prompt_ids, solo_runs, chunk_size):
    requests = greedy_requests(prompt_ids)
    # Staggered arrivals: requests join while others prefill and decode, and leave at different steps.
    arrivals = {r.request_id: 3 * i for i, r in enumerate(requests)}
    run = drive(engine_fp32, requests, chunk_size=chunk_size, arrival_steps=arrivals)
    assert run.max_batch_size >= 4
    for r in requests:
        assert run.tokens[r.request_id] == solo_runs[r.request_id][0], f"{r.request_id} chunk_size={chunk_size}"


@pytest.mark.parametrize("chunk_size", [5, None])
def test_default_settings_batched_tokens_equal_solo_tokens(engine_default, prompt_ids, solo_runs_default, chunk_size):
    """The default path (on the CPU the int16 matmul) is batch- and chunk-invariant too."""
    requests = greedy_requests(prompt_ids)
    arrivals = {r.request_id: 2 * i for i, r in enumerate(requests)}
    run = drive(engine_default, requests, chunk_size=chunk_size, arrival_steps=arrivals)
    assert run.max_batch_size >= 4
    for r in requests:
        assert run.tokens[r.request_id] == solo_runs_default[r.request_id][0], f"{r.request_id} chunk_size={chunk_size}"


@pytest.fixture(scope="module", params=["int8", "bf16"])
def engine_opt_in(request):
    """The engine with an opt-in matmul: `--matmul int8` or `--matmul bf16`, where the CPU has it."""
    from executor_svc.engine.engine import Engine, EngineConfig
    from executor_svc.weights.weight_format import has_matmul

    if not has_matmul(request.param):
        pytest.skip(f"this CPU has no {request.param} matmul (see has_matmul)")
    return Engine(EngineConfig(model="default", matmul=request.param, kv_cache_bytes=512 << 20))


@pytest.fixture(scope="module")
def solo_runs_opt_in(engine_opt_in, prompt_ids):
    return solo(engine_opt_in, prompt_ids)


@pytest.mark.parametrize("chunk_size,draft_budget", [(5, 0), (None, 3)])
def test_opt_in_matmuls_batched_chunked_and_speculative_tokens_equal_solo_tokens(
    engine_opt_in, prompt_ids, solo_runs_opt_in, chunk_size, draft_budget
):
    """`--matmul int8` and `--matmul bf16` keep greedy output independent of batching, chunking and
    speculation: one arithmetic for every row (the logits' matmul by int16, every other by int8 with
    exact integer sums, or by bf16 tiles summing each row over K in one fixed order)."""
    requests = greedy_requests(prompt_ids)
    arrivals = {r.request_id: 2 * i for i, r in enumerate(requests)}
    run = drive(engine_opt_in, requests, chunk_size=chunk_size, arrival_steps=arrivals, draft_budget=draft_budget)
    assert run.max_batch_size >= 4
    for r in requests:
        assert run.tokens[r.request_id] == solo_runs_opt_in[r.request_id][0], f"{r.request_id} chunk_size={chunk_size}"


def test_batched_with_unrelated_requests_joining_and_leaving(engine_fp32, prompt_ids, solo_runs):
    requests = greedy_requests(prompt_ids[:4])
    # Short-lived neighbours of different lengths come and go around the measured requests.
    noise = [
        NewRequest(
            f"noise{i}",
            prompt_ids[(i + 3) % len(prompt_ids)][: 5 + 9 * i],
            SamplingParams(),
            3 + 5 * i,
            ignore_eos=True,
        )
        for i in range(6)
    ]
    arrivals = {r.request_id: i for i, r in enumerate(requests)} | {
        n.request_id: 2 + 7 * i for i, n in enumerate(noise)
    }
    run = drive(engine_fp32, requests + noise, chunk_size=16, arrival_steps=arrivals)
    for r in requests:
        assert run.tokens[r.request_id] == solo_runs[r.request_id][0], r.request_id
    for n in noise:
        assert len(run.tokens[n.request_id]) == n.max_new_tokens
    assert engine_fp32.kv.num_free_blocks == engine_fp32.kv.num_usable_blocks


def all_position_logits(model, token_ids: list[int], kv_dtype) -> torch.Tensor:
    """Logits at every position of one sequence, from one forward over it (a KV cache of kv_dtype)."""
    from executor_svc.kv.kv_cache import KVCache
    from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice

    cache = KVCache(model.config, 2 + len(token_ids) // 16, 16, kv_dtype, torch.device("cpu"), model.ops.kv_layout)
    blocks: list[int] = []
    cache.grow(blocks, len(token_ids))
    batch = RaggedBatch.build([RequestSlice(token_ids, 0, blocks, len(token_ids))], 16, torch.device("cpu"))
    return model.forward(batch, cache)


@pytest.mark.parametrize(
    "dtype,matmul,kv_dtype",
    [
        ("float32", "exact", "float32"),
        ("float32", "int16", "float32"),
        ("float32", "int16", "float16"),
        ("float32", "int16", "bfloat16"),
        ("float32", "int8", "float16"),
        ("float32", "bf16", "float16"),
        ("float32", "bf16", "bfloat16"),
        ("bfloat16", "exact", "bfloat16"),
    ],
)
def test_top1_agreement_with_the_dequantized_float32_reference(
    default_model_path, prompt_ids, solo_runs, dtype, matmul, kv_dtype
):
    """Packed GGUF weights with the C++ kernels against dequantize-then-F.linear in float32
    with the plain-torch ops, teacher-forced over every reference prompt and its 64 greedy
    tokens. The exact float32 path must agree at >= 99% of positions (it measures 100%), and
    so must the CPU default (the int16 matmul) with any KV cache: float32, --kv-cache-dtype
    float16, or bfloat16 (with bfloat16 dot products in attention where the CPU has them); bfloat16
    activations, which --dtype auto does not pick on the CPU for this reason, measure ~98%
    and are held to 95%. `--matmul int8` (activations in 8 bits per block over its range; the
    logits' matmul keeps int16) is opt-in for the same reason and held to 98%: 768/778 here, and 98.3%
    over 7,594 teacher-forced positions of this repository's own text and code (int16: 99.95%;
    int8 in the logits' matmul too: 97.8%; int8 symmetric about zero instead of over the range:
    96.9%). `--matmul bf16` (the layers' matmul inputs rounded to bf16, float32 sums on the AMX
    tiles; the logits' matmul keeps int16) is opt-in too and held to 98.5%: 770/778 here, and 99.48%
    over 10,240 teacher-forced positions of this repository's text and code (int16 there: 99.98%;
    int8: 98.45%; bf16 in the logits' matmul too, emulated in torch: 99.4%)."""
    from executor_svc.weights.weight_format import MATMUL_KERNELS, has_matmul

    if not has_matmul(matmul):
        pytest.skip(f"this CPU has no {matmul} matmul (see has_matmul)")
    from executor_svc.model.transformer import Transformer
    from executor_svc.weights.gguf_file import open_gguf
    from executor_svc.weights.model_config import ModelConfig
    from executor_svc.weights.model_weights import load_weights

    gguf = open_gguf(default_model_path)
    config = ModelConfig.from_gguf(gguf)
    cpu = torch.device("cpu")
    reference = Transformer(config, load_weights(gguf, config, torch.float32, cpu, packed=False), cpu)
    torch_dtype = getattr(torch, dtype)
    ours = Transformer(
        config,
        load_weights(gguf, config, torch_dtype, cpu, matmul_kernel=MATMUL_KERNELS.get(matmul)),
        cpu,
        CpuOps(),
        torch_dtype,
    )
    agree = total = 0
    for i, ids in enumerate(prompt_ids):
        sequence = ids + solo_runs[f"p{i}"][0][:-1]
        expected = all_position_logits(reference, sequence, torch.float32).argmax(-1)
        got = all_position_logits(ours, sequence, getattr(torch, kv_dtype)).argmax(-1)
        agree += int((expected == got).sum())
        total += len(sequence)
    print(
        f"\n{dtype}/{matmul}/KV {kv_dtype}: top-1 agreement with the dequantized float32 reference {agree}/{total} = {agree / total:.4f}"
    )
    bar = {"int8": 0.98, "bf16": 0.985}.get(matmul, 0.99 if dtype == "float32" else 0.95)
    assert agree / total >= bar
