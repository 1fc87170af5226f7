"""Loading and the forward pass on tiny random GGUF models of every supported
architecture and tensor type, checked against transformers loading the same file."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from executor_svc.engine.engine import Engine, EngineConfig
from executor_svc.engine.request_state import FinishReason, NewRequest
from executor_svc.kv.kv_cache import KVCache
from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice
from executor_svc.model.transformer import Transformer
from executor_svc.weights.gguf_file import open_gguf
from executor_svc.weights.model_config import ModelConfig
from executor_svc.weights.model_weights import load_weights
from tests.support.engine_driver import drive
from tests.support.tiny_gguf import TinyModelSpec, k_quant_spec, qwen3_spec, write_tiny_model

CASES = {
    "llama-F32": TinyModelSpec("llama", Q.F32),
    "llama-F16": TinyModelSpec("llama", Q.F16),
    "llama-BF16": TinyModelSpec("llama", Q.BF16),
    "llama-Q8_0": TinyModelSpec("llama", Q.Q8_0),
    "llama-Q4_0": TinyModelSpec("llama", Q.Q4_0),
    "llama-Q4_1": TinyModelSpec("llama", Q.Q4_1),
    "llama-Q4_K": k_quant_spec(Q.Q4_K),
    "llama-Q5_K": k_quant_spec(Q.Q5_K),
    "llama-Q6_K": k_quant_spec(Q.Q6_K),
    "llama-untied-head": TinyModelSpec("llama", Q.F32, tie_word_embeddings=False),
    "qwen2-F32": TinyModelSpec("qwen2", Q.F32, rope_theta=1e6),
    "qwen2-Q8_0": TinyModelSpec("qwen2", Q.Q8_0),
    "qwen3-F32": qwen3_spec(),
    "qwen3-Q4_K": k_quant_spec(Q.Q4_K, "qwen3"),
}

PROMPT = [3, 80, 71, 72, 79, 79, 82, 3, 90, 82, 85, 79, 71, 1, 2, 150, 200, 260, 40, 41, 42]


def our_logits(path, prompt):
    """Logits at every prompt position from our Transformer, prefilled in two chunks."""
    gguf = open_gguf(path)
    config = ModelConfig.from_gguf(gguf)
    model = Transformer(config, load_weights(gguf, config, torch.float32, torch.device("cpu")), torch.device("cpu"))
    cache = KVCache(config, 16, 16, torch.float32, torch.device("cpu"))
    blocks: list[int] = []
    cache.grow(blocks, len(prompt))
    split = len(prompt) // 2
    first = model.forward(
        RaggedBatch.build([RequestSlice(prompt[:split], 0, blocks, split)], 16, torch.device("cpu")), cache
    )
    rest = len(prompt) - split
    second = model.forward(
        RaggedBatch.build([RequestSlice(prompt[split:], split, blocks, rest)], 16, torch.device("cpu")), cache
    )
    return config, torch.cat([first, second])


@torch.inference_mode()
def reference_logits(path, prompt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_transformers(tmp_path, case):
    spec = CASES[case]
    path = write_tiny_model(tmp_path / f"{case}.gguf", spec)
    config, ours = our_logits(path, PROMPT)
    assert config.architecture == spec.architecture
    assert config.tie_word_embeddings == spec.tie_word_embeddings
    assert config.has_qkv_bias == (spec.architecture == "qwen2")
    assert config.has_qk_norm == (spec.architecture == "qwen3")
    theirs = reference_logits(path, PROMPT)
    assert ours.shape == theirs.shape == (len(PROMPT), config.vocab_size)
    assert theirs.abs().max() > 0.1  # the check below is not vacuous
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * float(theirs.abs().max()))


def test_engine_generates_on_a_tiny_model(tmp_path):
    path = write_tiny_model(tmp_path / "tiny.gguf", qwen3_spec(Q.Q8_0))
    engine = Engine(EngineConfig(model=str(path), kv_cache_bytes=1 << 20))
    run = drive(engine, [NewRequest("a", PROMPT, max_new_tokens=12, ignore_eos=True)], chunk_size=5)
    assert len(run.tokens["a"]) == 12 and run.finish_reasons["a"] == FinishReason.LENGTH
    # Greedy continuation equals argmax of the reference model, token by token.
    tokens = list(PROMPT)
    for expected in run.tokens["a"][:4]:
        assert int(reference_logits(path, tokens)[-1].argmax()) == expected
        tokens.append(expected)


def test_bfloat16_engine_runs_and_mostly_agrees_with_float32(tmp_path):
    path = write_tiny_model(tmp_path / "tiny.gguf", TinyModelSpec("llama", Q.F32))
    runs = {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine(EngineConfig(model=str(path), dtype=dtype, kv_cache_bytes=1 << 20))
        runs[dtype] = drive(engine, [NewRequest("a", PROMPT, max_new_tokens=8, ignore_eos=True)]).tokens["a"]
    assert len(runs["bfloat16"]) == 8
    assert runs["bfloat16"][0] == runs["float32"][0]
