"""The Triton KV store against the torch `write_kv`, under the interpreter."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.kernels.kv_store import write_kv  # noqa: E402
from executor_svc.model.attention import write_kv as torch_write_kv  # noqa: E402

BLOCK_SIZE = 16


def caches(num_blocks, num_kv_heads, head_dim, dtype, gen):
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    return k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (1, 128), (2, 80)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_matches_torch_from_strided_qkv_views(dtype, num_kv_heads, head_dim, slot_dtype):
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_heads, num_blocks = 21, 2 * num_kv_heads, 6
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
    # Views into the fused QKV output, as the model passes them: row stride q_size + 2 * kv_size.
    k = qkv[:, q_size : q_size + kv_size].view(-1, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(-1, num_kv_heads, head_dim)
    # Scattered slots across blocks, crossing block boundaries, never the null block.
    slots = torch.randperm((num_blocks - 1) * BLOCK_SIZE, generator=gen)[:num_tokens] + BLOCK_SIZE
    k_cache, v_cache = caches(num_blocks, num_kv_heads, head_dim, dtype, gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv(k, v, k_cache, v_cache, slots.to(slot_dtype))
    torch_write_kv(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_writes_into_one_layer_of_a_multi_layer_cache():
    """`KVCache.layer` hands out views of a [layers, 2, blocks, ...] tensor; other layers stay untouched."""
    gen = torch.Generator().manual_seed(1)
    cache = torch.zeros(3, 2, 4, BLOCK_SIZE, 2, 64)
    k = torch.randn(5, 2, 64, generator=gen)
    v = torch.randn(5, 2, 64, generator=gen)
    slots = torch.tensor([16, 17, 31, 32, 63])
    write_kv(k, v, cache[1, 0], cache[1, 1], slots)
    expected = torch.zeros_like(cache)
    torch_write_kv(k, v, expected[1, 0], expected[1, 1], slots)
    assert torch.equal(cache, expected)


def test_no_tokens_is_a_no_op():
    k_cache, v_cache = caches(2, 2, 64, torch.float32, torch.Generator().manual_seed(0))
    before = k_cache.clone()
    empty = torch.empty(0, 2, 64)
    write_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64))
    assert torch.equal(k_cache, before)


def test_rejects_bad_arguments():
    k_cache, v_cache = caches(2, 2, 64, torch.float32, torch.Generator().manual_seed(0))
    k = torch.randn(3, 2, 64)
    slots = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="dtype"):
        write_kv(k.half(), k.half(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="fit"):
        write_kv(torch.randn(3, 1, 64), torch.randn(3, 1, 64), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping has"):
        write_kv(k, k, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match="stride"):
        write_kv(k.transpose(1, 2).contiguous().transpose(1, 2), k, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="dtype"):
        write_kv(k, k, k_cache, v_cache, slots.float())
