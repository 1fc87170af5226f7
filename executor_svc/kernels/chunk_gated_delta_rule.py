"""The gated delta rule, chunked (WY/UT) form, for the prefill rows of a ragged batch.

A request's new tokens are cut into chunks of C (starting at its first new token). Within a
chunk, with cumulative log-decays c_i (c_C at the chunk's last token) and D_ij = exp(c_i − c_j)
for j ≤ i:

    A  = strictly_lower((β k) kᵀ ∘ D)                      # [C, C]
    T  = (I + A)⁻¹                                          # forward substitution, row by row
    W  = T (β exp(c) k),  U = T (β v)                       # the WY form of the C rank-1 updates
    u  = U − W S                                            # what each token writes, given S
    o  = (exp(c) q) S + (q kᵀ ∘ D) u                        # D incl. its diagonal, zero above it
    S ← exp(c_C) S + (exp(c_C − c) k)ᵀ u

which is the recurrent form's S ← γS; S ← S + k ⊗ β(v − Sᵀk); o = Sᵀq over the chunk, equal
up to rounding (`gated_delta_net.chunked_gated_delta_rule` is the torch reference, written the
same way). Rows past the request's end are loaded as zeros with g = β = 0, which leaves A, W,
u and the state untouched by them.

Two kernels, as flash-linear-attention splits it: `_chunk_wy_kernel` computes T, W and U, which
do not depend on the state, for every chunk of every request in parallel (one program per
chunk and value head), into float32 scratch [T, H, dk] and [T, H, dv]; `_chunk_state_kernel`
then runs one program per (request, value head, tile of value columns) that holds that tile of
S [dk, BV] in registers and walks the request's chunks in order, five matmuls each. The
sequential path carries no triangular solve.

Everything is float32 whatever the inputs' dtype, the matmuls (`tl.dot`) in IEEE float32:
flash-linear-attention feeds its dots bf16 operands (T and the state rounded to bf16 too), which
is faster on tensor cores but no longer within float32 rounding of the recurrent form, and
Triton's interpreter, which tests these kernels on the CPU, cannot run bf16 dots. Every shape
is fixed by the model (dk, dv) and CHUNK, never by the batch, and a request's chunks are
aligned to its own first token: its bits depend on its own tokens and its starting state
only, so the result is batch-invariant.
It does depend on where its chunks start, i.e. on the engine's prefill chunking; see
`gated_delta_rule.py` for when the plan sends a request here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK_TOKENS = 64  # the chunk C: the torch reference's, and flash-linear-attention's
# The state kernel's software pipeline depth. Triton's default on Hopper (3) buffers three chunks of
# float32 q, k, W and U: 295 KB of shared memory for Qwen3.5-9B's heads in float32, over the H200's
# 227 KB (seen on one). Two stages: 189 KB there (123 KB in bfloat16), 64 KB on RDNA4 (its limit).
STATE_KERNEL_STAGES = 2


@triton.jit
def log_decay(alpha, dt_bias, a):
    """g = a · softplus(α + dt_bias), softplus with torch's threshold (20); float32 in, float32 out."""
    x = alpha + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return a * softplus


@triton.jit
def write_strength(beta):
    """β = sigmoid(beta)."""
    return 1.0 / (1.0 + tl.exp(-beta))


@triton.jit
def _dot(x, y):
    """x @ y in IEEE float32 (no TF32: T's entries and the state need the mantissa)."""
    return tl.dot(x, y, input_precision="ieee")


@triton.jit
def _unit_lower_inverse(a, CHUNK: tl.constexpr):
    """(I + a)⁻¹ of a strictly lower-triangular [CHUNK, CHUNK] float32 a, by forward substitution:
    row i of the inverse is e_i − Σ_{j<i} a_ij · (row j), the rows below i still zero."""
    rows = tl.arange(0, CHUNK)
    inverse = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for i in range(CHUNK):
        a_row = tl.sum(tl.where(rows[:, None] == i, a, 0.0), axis=0)  # [C]: a_ij over j
        row = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_row[:, None] * inverse, axis=0)
        inverse = tl.where(rows[:, None] == i, row[None, :], inverse)
    return inverse


@triton.jit
def _load_chunk(
    mixed_ptr,
    alpha_ptr,
    beta_ptr,
    a,
    dt_bias,
    t,
    row_mask,
    q_scale,
    stride_mixed,
    stride_alpha,
    stride_beta,
    h,
    key_head,
    ks,
    k_mask,
    KEY_HEADS: tl.constexpr,
    DK: tl.constexpr,
):
    """One chunk's q, k [C, BK] (L2-normalised, q scaled), log-decays g and strengths β [C]; rows
    past the request's end are zeros with g = β = 0."""
    rows = mixed_ptr + t[:, None] * stride_mixed
    qk_mask = row_mask[:, None] & k_mask[None, :]
    q = tl.load(rows + key_head * DK + ks[None, :], mask=qk_mask, other=0.0).to(tl.float32)
    k = tl.load(rows + (KEY_HEADS + key_head) * DK + ks[None, :], mask=qk_mask, other=0.0).to(tl.float32)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=1) + 1e-6))[:, None] * q_scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6))[:, None]
    alpha = tl.load(alpha_ptr + t * stride_alpha + h, mask=row_mask, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + t * stride_beta + h, mask=row_mask, other=0.0).to(tl.float32)
    g = tl.where(row_mask, log_decay(alpha, dt_bias, a), 0.0)
    b = tl.where(row_mask, write_strength(beta), 0.0)
    return q, k, g, b


@triton.jit
def _chunk_wy_kernel(
    mixed_ptr,  # [T, 2 · KEY_HEADS · DK + HEADS · DV] rows strided: q | k | v
    alpha_ptr,  # [T, HEADS] rows strided
    beta_ptr,  # [T, HEADS] rows strided
    a_ptr,  # [HEADS]
    dt_bias_ptr,  # [HEADS]
    w_ptr,  # [T, HEADS, DK] float32: T (β exp(c) k), written for the launched requests' rows
    u_ptr,  # [T, HEADS, DV] float32: T (β v)
    table_ptr,  # [6, R] int32 (`DeltaNetPlan.kernel_table`)
    num_requests,
    first_launch,  # this launch's requests are launch order [first_launch, first_launch + grid)
    stride_mixed,
    stride_alpha,
    stride_beta,
    HEADS: tl.constexpr,
    KEY_HEADS: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,  # next power of two ≥ max(DK, 16)
    BDV: tl.constexpr,  # next power of two ≥ max(DV, 16): the whole value row
    CHUNK: tl.constexpr,
):
    """The state-independent half of a chunk, every chunk of every request in parallel: the UT
    transform T = (I + A)⁻¹ and the WY factors W, U it gives."""
    r = tl.load(table_ptr + 5 * num_requests + first_launch + tl.program_id(1) // HEADS)
    h = tl.program_id(1) % HEADS
    chunk_start = tl.program_id(0) * CHUNK
    query_len = tl.load(table_ptr + num_requests + r)
    if chunk_start < query_len:  # the grid spans the longest request's chunks
        cs = tl.arange(0, CHUNK)
        ks = tl.arange(0, BK)
        vs = tl.arange(0, BDV)
        k_mask, v_mask = ks < DK, vs < DV
        row_mask = chunk_start + cs < query_len
        t = tl.load(table_ptr + r).to(tl.int64) + chunk_start + cs  # [C]
        a = tl.load(a_ptr + h).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        _, k, g, b = _load_chunk(
            mixed_ptr,
            alpha_ptr,
            beta_ptr,
            a,
            dt_bias,
            t,
            row_mask,
            1.0,
            stride_mixed,
            stride_alpha,
            stride_beta,
            h,
            h % KEY_HEADS,
            ks,
            k_mask,
            KEY_HEADS,
            DK,
        )
        v = tl.load(
            mixed_ptr + t[:, None] * stride_mixed + 2 * KEY_HEADS * DK + h * DV + vs[None, :],
            mask=row_mask[:, None] & v_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [C, BDV]
        c = tl.cumsum(g, axis=0)  # [C]: log-decay from the chunk's start through each token
        strictly_lower = cs[:, None] > cs[None, :]
        decay = tl.exp(tl.where(strictly_lower, c[:, None] - c[None, :], float("-inf")))
        k_beta = k * b[:, None]
        inverse = _unit_lower_inverse(_dot(k_beta, tl.trans(k)) * decay, CHUNK)
        w = _dot(inverse, k_beta * tl.exp(c)[:, None])  # [C, BK]
        u = _dot(inverse, v * b[:, None])  # [C, BDV]
        tl.store(w_ptr + (t[:, None] * HEADS + h) * DK + ks[None, :], w, mask=row_mask[:, None] & k_mask[None, :])
        tl.store(u_ptr + (t[:, None] * HEADS + h) * DV + vs[None, :], u, mask=row_mask[:, None] & v_mask[None, :])


@triton.jit
def _chunk_state_kernel(
    mixed_ptr,
    alpha_ptr,
    beta_ptr,
    a_ptr,
    dt_bias_ptr,
    w_ptr,  # [T, HEADS, DK] float32, from `_chunk_wy_kernel`
    u_ptr,  # [T, HEADS, DV] float32
    states_ptr,  # [num_slots, HEADS, DK, DV] float32 contiguous
    out_ptr,  # [T, HEADS, DV] float32 contiguous
    table_ptr,  # [6, R] int32 (`DeltaNetPlan.kernel_table`)
    num_requests,
    first_launch,
    stride_mixed,
    stride_alpha,
    stride_beta,
    q_scale,  # dk^-1/2
    HEADS: tl.constexpr,
    KEY_HEADS: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The state-dependent half, chunk after chunk: one program per (request, head, value tile)
    carries S [BK, BV] in registers through its request's chunks."""
    value_tile = tl.program_id(0)
    r = tl.load(table_ptr + 5 * num_requests + first_launch + tl.program_id(1) // HEADS)
    h = tl.program_id(1) % HEADS
    query_start = tl.load(table_ptr + r).to(tl.int64)
    query_len = tl.load(table_ptr + num_requests + r)
    slot = tl.load(table_ptr + 4 * num_requests + r).to(tl.int64)

    ks = tl.arange(0, BK)
    vs = value_tile * BV + tl.arange(0, BV)
    cs = tl.arange(0, CHUNK)
    k_mask, v_mask = ks < DK, vs < DV
    tile = (h * DK + ks[:, None]) * DV + vs[None, :]
    tile_mask = k_mask[:, None] & v_mask[None, :]
    s = tl.load(states_ptr + slot * (HEADS * DK * DV) + tile, mask=tile_mask, other=0.0)  # [BK, BV]
    a = tl.load(a_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    causal = cs[:, None] >= cs[None, :]  # [C, C]: j ≤ i
    for chunk_start in range(0, query_len, CHUNK):
        row_mask = chunk_start + cs < query_len
        t = query_start + chunk_start + cs  # [C]
        q, k, g, _ = _load_chunk(
            mixed_ptr,
            alpha_ptr,
            beta_ptr,
            a,
            dt_bias,
            t,
            row_mask,
            q_scale,
            stride_mixed,
            stride_alpha,
            stride_beta,
            h,
            h % KEY_HEADS,
            ks,
            k_mask,
            KEY_HEADS,
            DK,
        )
        w = tl.load(
            w_ptr + (t[:, None] * HEADS + h) * DK + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )  # [C, BK]
        row_tile = row_mask[:, None] & v_mask[None, :]
        u = tl.load(u_ptr + (t[:, None] * HEADS + h) * DV + vs[None, :], mask=row_tile, other=0.0)  # [C, BV]
        c = tl.cumsum(g, axis=0)
        c_end = tl.sum(tl.where(cs == CHUNK - 1, c, 0.0), axis=0)
        decay = tl.exp(tl.where(causal, c[:, None] - c[None, :], float("-inf")))  # [C, C]: D, zero above the diagonal
        u = u - _dot(w, s)  # what each token writes, given the state before the chunk
        scores = _dot(q, tl.trans(k)) * decay
        o = _dot(q * tl.exp(c)[:, None], s) + _dot(scores, u)
        tl.store(out_ptr + (t[:, None] * HEADS + h) * DV + vs[None, :], o, mask=row_tile)
        s = s * tl.exp(c_end) + _dot(tl.trans(k * tl.exp(c_end - c)[:, None]), u)
    tl.store(states_ptr + slot * (HEADS * DK * DV) + tile, s, mask=tile_mask)


def launch_chunked(
    mixed: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    out: torch.Tensor,
    kernel_table: torch.Tensor,
    query_lens: list[int],
    first_launch: int,
    num_launched: int,
    key_heads: int,
    chunk_tokens: int = CHUNK_TOKENS,
) -> None:
    """The chunked form over requests [first_launch, first_launch + num_launched) of the plan's
    launch order (`query_lens`: theirs, in that order); arguments checked by
    `gated_delta_rule.gated_delta_rule`."""
    num_tokens = mixed.shape[0]
    _, heads, dk, dv = states.shape
    block_k = max(16, triton.next_power_of_2(dk))  # tl.dot's smallest tile
    w = torch.empty(num_tokens, heads, dk, dtype=torch.float32, device=mixed.device)
    u = torch.empty(num_tokens, heads, dv, dtype=torch.float32, device=mixed.device)
    num_requests = kernel_table.shape[1]
    common = (kernel_table, num_requests, first_launch, mixed.stride(0), alpha.stride(0), beta.stride(0))
    _chunk_wy_kernel[(triton.cdiv(max(query_lens), chunk_tokens), num_launched * heads)](
        mixed,
        alpha,
        beta,
        a,
        dt_bias,
        w,
        u,
        *common,
        HEADS=heads,
        KEY_HEADS=key_heads,
        DK=dk,
        DV=dv,
        BK=block_k,
        BDV=max(16, triton.next_power_of_2(dv)),
        CHUNK=chunk_tokens,
        num_warps=4,
    )
    # Untuned: 32 value columns keep S, q, k and W of a 128-wide head in registers and give a lone
    # long prompt of Qwen3.5-9B's 32 heads 128 programs.
    value_tile = max(16, min(32, triton.next_power_of_2(dv)))
    _chunk_state_kernel[(triton.cdiv(dv, value_tile), num_launched * heads)](
        mixed,
        alpha,
        beta,
        a,
        dt_bias,
        w,
        u,
        states,
        out,
        *common,
        dk**-0.5,
        HEADS=heads,
        KEY_HEADS=key_heads,
        DK=dk,
        DV=dv,
        BK=block_k,
        BV=value_tile,
        CHUNK=chunk_tokens,
        num_warps=4,
        num_stages=STATE_KERNEL_STAGES,
    )
