"""Writing each new token's K and V rows into its slot of the paged cache.

One program per token copies its [num_kv_heads, head_dim] K and V rows to slot
`slot_mapping[t]`, i.e. block `slot // block_size`, offset `slot % block_size`.
K and V may be strided views (slices of the fused QKV output); only the last
dimension must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.kernels.checks import FLOAT_DTYPES, check_same_device, check_tensor


@triton.jit
def _kv_store_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens]
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    # [BLOCK_H, BLOCK_D]
    k = tl.load(k_ptr + token * stride_k_token + h[:, None] * stride_k_head + d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + h[:, None] * stride_v_head + d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot + h[:, None] * stride_kc_head + d[None, :]
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot + h[:, None] * stride_vc_head + d[None, :]
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64 or int32
) -> None:
    """Store each token's K and V in its slot of the paged cache (the caches are written in place)."""
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("v", v, ndim=3, dtypes=(k.dtype,))
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(k.dtype,))
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(k.dtype,))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32))
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k rows [{num_kv_heads}, {head_dim}] do not fit cache rows {tuple(k_cache.shape[2:])}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    _kv_store_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=4,
    )
