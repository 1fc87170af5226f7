"""Paged attention over the ragged batch: one kernel for prefill chunks, decode and verify runs.

The flat query vector is cut into *query tiles*: up to `query_tile_tokens`
consecutive tokens of one request (a tile never spans two requests). A program
owns one tile and one KV head; its rows are the tile's tokens times the query
heads that share that KV head (GQA packing), so a single decode token still
fills `group_size` rows of the MMA and each K/V tile is loaded once for all of
them. The tile walks its request's keys from key 0 in fixed `BLOCK_N`-key tiles,
read through the block table, with an online (flash-attention) softmax in
float32, up to its last token's position; keys after a row's own position are
masked (causal within the new tokens).

Batch invariance: a row's arithmetic depends only on its own request's KV and
the kernel's compile-time configuration, never on the batch. There is no split of
the KV range decided by batch size; tiles past a row's position are fully masked
for it and are exact no-ops (the running max does not move, so the rescale
factor is exactly 1 and the added probabilities are exactly 0), so sharing a
tile with later tokens of a prefill chunk changes nothing. One configuration
(tile sizes, warps) is used for every tile of a model, decode or prefill.

A draft tree's rows (ragged_batch) run as one-row tiles that read their
ancestors as the keys after the context: logical key `window_start + k` comes
from position `window_positions[k]` (its ancestor at depth k), every earlier key
from its own position. A one-row tile is what a decode step runs, over the very
keys in the very order a decode of the row's path reads, so the row gets that
decode's bits.

The tile list is built on the host once per step (`build_attention_metadata`)
and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from executor_svc.kernels.checks import FLOAT_DTYPES, check_same_device, check_tensor
from executor_svc.model.ragged_batch import RaggedBatch, tree_paths

LOG2_E = 1.4426950408889634
_NO_WINDOW = 2**31 - 1


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's query tiles, on the device, built once and used by every layer."""

    # Each [num_tiles] int32: the tile's request, first row of the flat q, rows, first row's position.
    tile_requests: torch.Tensor
    tile_row_starts: torch.Tensor
    tile_num_rows: torch.Tensor
    tile_first_positions: torch.Tensor
    block_tables: torch.Tensor  # [num_requests, max_blocks] int32
    block_size: int
    query_tile_tokens: int
    num_tokens: int
    num_padded_tokens: int
    # Draft trees only (else None): [num_tiles] int32, a tile's first windowed key
    # (2**31 - 1: none), and [num_tiles, W] int32, the positions its window keys are read from.
    tile_window_starts: torch.Tensor | None = None
    tile_window_positions: torch.Tensor | None = None

    @property
    def num_tiles(self) -> int:
        return self.tile_requests.shape[0]


def build_attention_metadata(batch: RaggedBatch, block_size: int, query_tile_tokens: int) -> AttentionMetadata:
    """Cut every request's query rows into tiles of at most `query_tile_tokens` tokens.

    Example: query_lens [1, 37, 4] with 16-token tiles → tiles of 1 | 16, 16, 5 | 4 rows.
    The tiles go to the device in one copy.
    """
    if query_tile_tokens <= 0 or query_tile_tokens & (query_tile_tokens - 1):
        raise ValueError(f"query_tile_tokens must be a power of two, got {query_tile_tokens}")
    requests, row_starts, num_rows, first_positions = [], [], [], []
    window_starts: list[int] = []
    window_positions: list[list[int]] = []
    for r, (query_start, query_len, context_len) in enumerate(
        zip(batch.query_starts, batch.query_lens, batch.context_lens)
    ):
        start_position = context_len - query_len
        parents = batch.tree_parents[r] if batch.tree_parents else None
        if parents is not None:
            for row, path in enumerate(tree_paths(parents)):
                requests.append(r)
                row_starts.append(query_start + row)
                num_rows.append(1)
                first_positions.append(start_position + len(path) - 1)
                window_starts.append(start_position)
                window_positions.append([start_position + ancestor for ancestor in path])
            continue
        for offset in range(0, query_len, query_tile_tokens):
            requests.append(r)
            row_starts.append(query_start + offset)
            num_rows.append(min(query_tile_tokens, query_len - offset))
            first_positions.append(start_position + offset)
            window_starts.append(_NO_WINDOW)
            window_positions.append([])
    device = batch.block_tables.device
    # [4, num_tiles]
    tiles = torch.tensor([requests, row_starts, num_rows, first_positions], dtype=torch.int32).reshape(4, -1)
    tiles = tiles.to(device)
    tile_window_starts = tile_window_positions = None
    if batch.tree_parents:
        width = max(len(p) for p in window_positions)
        padded = [p + [0] * (width - len(p)) for p in window_positions]
        tile_window_starts = torch.tensor(window_starts, dtype=torch.int32).to(device)
        tile_window_positions = torch.tensor(padded, dtype=torch.int32).reshape(len(padded), width).to(device)
    return AttentionMetadata(
        tile_requests=tiles[0],
        tile_row_starts=tiles[1],
        tile_num_rows=tiles[2],
        tile_first_positions=tiles[3],
        block_tables=batch.block_tables,
        tile_window_starts=tile_window_starts,
        tile_window_positions=tile_window_positions,
        block_size=block_size,
        query_tile_tokens=query_tile_tokens,
        num_tokens=batch.num_tokens,
        num_padded_tokens=batch.num_padded_tokens,
    )


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [num_padded_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    out_ptr,  # [num_padded_tokens, num_heads, head_dim]
    block_tables_ptr,  # [num_requests, max_blocks] int32
    tile_requests_ptr,  # [num_tiles] int32
    tile_row_starts_ptr,
    tile_num_rows_ptr,
    tile_first_positions_ptr,
    tile_window_starts_ptr,  # [num_tiles] int32 (HAS_WINDOWS only)
    tile_window_positions_ptr,  # [num_tiles, window_width] int32 (HAS_WINDOWS only)
    window_width,
    scale_log2,  # softmax scale · log2(e): scores go through exp2
    stride_q_token,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_out_token,
    stride_out_head,
    stride_table,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two (at least 16)
    GROUP_SIZE: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP_SIZE rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # row capacity of a query tile, in tokens (>= the tile's num_rows)
    BLOCK_N: tl.constexpr,  # keys per KV tile
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    IS_FP32: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # the inputs' dtype; float32 for bfloat16 under the interpreter
    HAS_WINDOWS: tl.constexpr,  # the step verifies a draft tree
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = tl.load(tile_requests_ptr + tile).to(tl.int64)
    row_start = tl.load(tile_row_starts_ptr + tile).to(tl.int64)
    num_rows = tl.load(tile_num_rows_ptr + tile)
    first_position = tl.load(tile_first_positions_ptr + tile)

    # Row m of the tile is (token m // GROUP_PAD, query head m % GROUP_PAD of this KV head).
    m = tl.arange(0, BLOCK_Q * GROUP_PAD)  # [BLOCK_M] tile rows
    token = m // GROUP_PAD
    head = kv_head * GROUP_SIZE + m % GROUP_PAD
    is_real_row = (token < num_rows) & (m % GROUP_PAD < GROUP_SIZE)
    positions = first_position + token  # [BLOCK_M]; padding rows see every loaded key, never a NaN
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM

    q_offsets = (row_start + token)[:, None] * stride_q_token + head[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=is_real_row[:, None] & d_mask[None, :], other=0.0)
    q = q.to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]

    num_keys = first_position + num_rows  # keys 0 .. the tile's last position
    max_score = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    denominator = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)
    table = block_tables_ptr + request * stride_table
    if HAS_WINDOWS:
        window_start = tl.load(tile_window_starts_ptr + tile)
    for key_start in range(0, num_keys, BLOCK_N):
        n = key_start + tl.arange(0, BLOCK_N)
        n_mask = n < num_keys
        key_positions = n  # where logical key n is stored: itself, or a tree row's ancestor
        if HAS_WINDOWS:
            in_window = n_mask & (n >= window_start)
            window_offsets = tile * window_width + (n - window_start)
            key_positions = tl.where(
                in_window, tl.load(tile_window_positions_ptr + window_offsets, mask=in_window, other=0), n
            )
        block_ids = tl.load(table + key_positions // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = key_positions % BLOCK_SIZE
        slots_k = block_ids * stride_k_block + in_block * stride_k_slot + kv_head * stride_k_head
        slots_v = block_ids * stride_v_block + in_block * stride_v_slot + kv_head * stride_v_head
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + slots_k[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + slots_v[:, None] + d[None, :], mask=kv_mask, other=0.0)
        k = k.to(DOT_DTYPE)  # [BLOCK_N, BLOCK_D]
        v = v.to(DOT_DTYPE)  # [BLOCK_N, BLOCK_D]

        if IS_FP32:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale_log2  # [BLOCK_M, BLOCK_N]
        scores = tl.where(n[None, :] <= positions[:, None], scores, float("-inf"))
        new_max = tl.maximum(max_score, tl.max(scores, 1))
        rescale = tl.exp2(max_score - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        denominator = denominator * rescale + tl.sum(probs, 1)
        if IS_FP32:
            acc = acc * rescale[:, None] + tl.dot(probs, v, input_precision="ieee")
        else:
            # Probabilities rounded to the inputs' dtype, as flash attention does for the tensor cores.
            probs = probs.to(v_cache_ptr.dtype.element_ty).to(DOT_DTYPE)
            acc = acc * rescale[:, None] + tl.dot(probs, v)
        max_score = new_max

    out = acc / denominator[:, None]
    out_offsets = (row_start + token)[:, None] * stride_out_token + head[:, None] * stride_out_head + d[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=is_real_row[:, None] & d_mask[None, :])


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _is_interpreted(kernel) -> bool:
    """Whether triton built `kernel` for its interpreter, whose tl.dot does not support bfloat16
    (it multiplies the raw bit patterns; triton-lang/triton#11584): there the dot inputs are
    widened to float32 after the same rounding, which leaves every product unchanged."""
    return type(kernel).__name__ == "InterpretedFunction"


def default_kv_tile_keys(dtype: torch.dtype, head_dim: int) -> int:
    """Keys per online-softmax step: 64 for the tensor cores; float32 (exact FMA dots, the
    reference-accuracy mode) needs smaller tiles to stay in registers."""
    if dtype == torch.float32:
        return 32 if head_dim <= 64 else 16
    return 64


def paged_attention(
    q: torch.Tensor,  # [num_padded_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    kv_tile_keys: int | None = None,
) -> torch.Tensor:
    """Causal attention of each query row over its own request's paged KV; float32 accumulation.

    Returns [num_padded_tokens, num_heads, head_dim] in q's dtype; rows past
    `num_tokens` are zeros. `kv_tile_keys` (default: `default_kv_tile_keys`) is part
    of the reduction order: keep it fixed for a model or results change in the last bits.
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,))
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(q.dtype,))
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=metadata.block_tables)
    num_padded_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kv_head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if kv_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {kv_head_dim}")
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} > 256 is not supported")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size != metadata.block_size:
        raise ValueError(f"cache block_size {block_size} != metadata block_size {metadata.block_size}")
    if num_padded_tokens != metadata.num_padded_tokens:
        raise ValueError(f"q has {num_padded_tokens} rows but the batch has {metadata.num_padded_tokens}")
    if metadata.block_tables.dtype != torch.int32 or metadata.block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be int32 and contiguous in its last dimension")
    if kv_tile_keys is None:
        kv_tile_keys = default_kv_tile_keys(q.dtype, head_dim)
    if kv_tile_keys < 16 or kv_tile_keys & (kv_tile_keys - 1):
        raise ValueError(f"kv_tile_keys must be a power of two >= 16, got {kv_tile_keys}")

    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    out[metadata.num_tokens :].zero_()
    if metadata.num_tiles == 0:
        return out
    group_size = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group_size)
    block_d = max(16, triton.next_power_of_2(head_dim))
    # tl.dot needs 16 rows: small tiles of small groups run with extra padding rows.
    block_q = max(metadata.query_tile_tokens, 16 // group_pad)
    is_fp32 = q.dtype == torch.float32
    # Register budgets, from sm_90 builds: below these the tiles spill to local memory.
    num_warps = 8 if is_fp32 or block_d >= 128 else 4
    dot_dtype = _TL_DTYPES[q.dtype]
    if q.dtype == torch.bfloat16 and _is_interpreted(_paged_attention_kernel):
        dot_dtype = tl.float32
    has_windows = metadata.tile_window_starts is not None
    # Without a tree the window arguments are never read: any int32 tensor will do.
    window_starts = metadata.tile_window_starts if has_windows else metadata.tile_requests
    window_positions = metadata.tile_window_positions if has_windows else metadata.tile_requests
    _paged_attention_kernel[(metadata.num_tiles, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        metadata.block_tables,
        metadata.tile_requests,
        metadata.tile_row_starts,
        metadata.tile_num_rows,
        metadata.tile_first_positions,
        window_starts,
        window_positions,
        window_positions.shape[-1] if has_windows else 0,
        scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        metadata.block_tables.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        GROUP_SIZE=group_size,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_N=kv_tile_keys,
        BLOCK_SIZE=block_size,
        IS_FP32=is_fp32,
        DOT_DTYPE=dot_dtype,
        HAS_WINDOWS=has_windows,
        num_warps=num_warps,
        # float32 tiles are twice the size and its dots run on FMA units: pipelining the
        # K and V loads costs registers it does not have. Half precision keeps the default.
        **({"num_stages": 1} if is_fp32 else {}),
    )
    return out
