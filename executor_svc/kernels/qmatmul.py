"""Dequant-matmul on GGUF blocks as stored: x [M, K] · wᵀ → [M, N], w a `PackedWeight`'s bytes.

The weight is the file's rows, uint8 [N, row_bytes] (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
Q6_K blocks, or F32/F16/BF16 values). Each program steps along K by BLOCK_K = 32
columns: one block of the 32-value types, one sub-block of Q4_K/Q5_K, two scale groups
of Q6_K. So a step's scale fields are one load per weight row, its quants contiguous
bytes (K innermost, as a row's bytes lie) at offsets known per step, and no value
needs index arithmetic of its own (`_dequant_step`). The [BLOCK_N, BLOCK_K] tile is
decoded in registers with gguf-py's arithmetic (scale products in float32, exactly as
`gguf.quants` dequantizes: the identity test checks every value bit for bit), rounded
to x's dtype (float32 stays float32, multiplied in IEEE precision) and accumulated by
`tl.dot` with its transpose into float32.

Why: on an H200 (the first run on a card) the kernel as it was (64-column steps of
[BLOCK_K, BLOCK_N] tiles, N innermost, every field loaded and indexed per value) read
3-10% of the copy bandwidth at M = 1 (Q4_K 148 GB/s, F16 27%): bound by instruction
issue, not bytes. `python -m executor_svc.tools.kernel_sass` counts the main loop's
instructions for sm_90 without a card: per value a thread decodes, Q4_K went from 38
to 23, F16 from 15 to 8 (Q6_K stays at 47: its 210-byte blocks leave its fields
2-byte aligned, so its bytes are not copied ahead as Q4_K's are). gpu_check's launch
sweep (section qmatmul) times it with the launch candidates (`Launch`) on a card.

Batch invariance by construction: every output element is one program's sum over
K in BLOCK_K steps, in order (K_STEPS of them per loop iteration change nothing), each
step one `tl.dot` of a BLOCK_M × BLOCK_K slab of x rows. BLOCK_M and BLOCK_K are the
same for every M and both launch shapes, no K is split across programs, and rows never
mix, so a row's bits depend on neither how many rows share the matmul nor where it sits
among them. (`Launch.block_m` above 16 would dequantize a weight tile once for more
prompt rows; whether the card's matrix instructions then give a row the same bits is
for gpu_check's launch sweep to show, which compares them: until a card has, both
launches keep 16.) The two launch shapes differ only in which output columns a program
covers and how it is scheduled:

- skinny (M ≤ SKINNY_MAX_ROWS: decode and verify rows): narrow BLOCK_N, so a single
  row still spreads the weight stream over many programs;
- tiled (prefill chunks): wider BLOCK_N and program order grouped along M, so the
  weight tiles a group of M tiles shares are read from cache, not memory.

Plain Triton only (loads, integer ops, `tl.dot`): one source for CUDA and ROCm.
`dequantize` is the plain-torch reference the kernel is tested against (and the
GPU path's embedding lookup).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from executor_svc.kernels.checks import FLOAT_DTYPES, check_same_device, check_tensor
from executor_svc.kernels.paged_attention import _TL_DTYPES, _is_interpreted
from executor_svc.weights.gguf_types import PACKED_TYPES

# ggml type ids (see weights/gguf_types.PACKED_TYPES).
F32 = tl.constexpr(0)
F16 = tl.constexpr(1)
BF16 = tl.constexpr(30)
Q4_0 = tl.constexpr(2)
Q4_1 = tl.constexpr(3)
Q8_0 = tl.constexpr(8)
Q4_K = tl.constexpr(12)
Q5_K = tl.constexpr(13)
Q6_K = tl.constexpr(14)

# The reduction's shape: fixed, whatever M (see the module docstring).
BLOCK_M = 16  # x rows per program: tl.dot's smallest M
BLOCK_K = 32  # one block of Q4_0/Q4_1/Q8_0, one sub-block of Q4_K/Q5_K: see _dequant_step
SKINNY_MAX_ROWS = 32


@dataclass(frozen=True)
class Launch:
    """How the programs cover the output: none of it changes a row's bits (see the module
    docstring; block_m only where a card shows it)."""

    block_n: int  # output columns (weight rows) per program
    group_m: int  # M tiles that visit a column tile one after another (1: no grouping)
    k_steps: int  # BLOCK_K steps per loop iteration, their loads issued together
    num_warps: int
    block_m: int = BLOCK_M  # x rows per program


SKINNY = Launch(block_n=32, group_m=1, k_steps=1, num_warps=4)
TILED = Launch(block_n=64, group_m=8, k_steps=1, num_warps=4)

# The dtype the value pointer is viewed as: each type's float fields (scales, or the values themselves).
_VALUE_DTYPES = {0: torch.float32, 30: torch.bfloat16}


@triton.jit
def _signed_byte(b):
    """A uint8 loaded as int32, read as int8 (two's complement)."""
    b = b.to(tl.int32)
    return tl.where(b >= 128, b - 256, b)


@triton.jit
def _k_scale_min(s_ptr, sub, mask):
    """Q4_K/Q5_K: the 6-bit scale and min of 32-value sub-block `sub` (0..7) from the 12 packed bytes."""
    is_low = sub < 4
    s_a = tl.load(s_ptr + sub, mask=mask, other=0).to(tl.int32)  # scales[j]
    s_b = tl.load(s_ptr + sub + 4, mask=mask, other=0).to(tl.int32)  # scales[j + 4]
    s_c = tl.load(s_ptr + tl.where(is_low, sub, sub - 4), mask=mask, other=0).to(tl.int32)  # scales[j - 4]
    scale = tl.where(is_low, s_a & 63, (s_b & 0xF) | ((s_c >> 6) << 4))
    minimum = tl.where(is_low, s_b & 63, (s_b >> 4) | ((s_a >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _dequant_step(w_ptr, wv_ptr, row, value_row, k0, K, mask, TYPE: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns k0 … k0 + BLOCK_K of the weight rows as float32 [rows, BLOCK_K], gguf-py's arithmetic.

    row: each row's first byte [rows, 1]; value_row: its first value (float types) or its first
    byte // 2 (the quantized types' float16 fields); mask [rows, 1], K the row's values (any
    number for the float types, whole blocks for the others). k0 is a multiple of
    BLOCK_K = 32, so the step lies in one block (Q4_0, Q4_1, Q8_0), one sub-block (Q4_K, Q5_K),
    two 16-value scale groups (Q6_K): a block's fields are per-row scalars [rows, 1] and its
    quants contiguous bytes, with no per-value index arithmetic. Products of scale fields are
    formed per row, the same operands and roundings as per value. One branch is compiled per
    TYPE; each sets `w`, returned once at the end.
    """
    cols = tl.arange(0, BLOCK_K)[None, :]  # [1, 32]
    if TYPE == F32 or TYPE == F16 or TYPE == BF16:
        w = tl.load(wv_ptr + value_row + k0 + cols, mask=mask & (k0 + cols < K), other=0.0).to(tl.float32)
    elif TYPE == Q4_0 or TYPE == Q4_1:
        # Q4_0: d f16, qs[16], d · (nibble − 8); Q4_1: d f16, m f16, qs[16], d · nibble + m. Value i
        # is nibble (i // 16) of qs[i % 16].
        head = row + (k0 // 32) * (18 if TYPE == Q4_0 else 20)
        d = tl.load(wv_ptr + head // 2, mask=mask, other=0.0).to(tl.float32)
        q = tl.load(w_ptr + head + (2 if TYPE == Q4_0 else 4) + cols % 16, mask=mask, other=0).to(tl.int32)
        q = (q >> ((cols // 16) * 4)) & 0xF
        if TYPE == Q4_0:
            w = d * (q - 8).to(tl.float32)
        else:
            w = d * q.to(tl.float32) + tl.load(wv_ptr + head // 2 + 1, mask=mask, other=0.0).to(tl.float32)
    elif TYPE == Q8_0:  # d f16, qs[32] int8
        head = row + (k0 // 32) * 34
        d = tl.load(wv_ptr + head // 2, mask=mask, other=0.0).to(tl.float32)
        q = _signed_byte(tl.load(w_ptr + head + 2 + cols, mask=mask, other=0))
        w = q.to(tl.float32) * d
    elif TYPE == Q4_K or TYPE == Q5_K:
        # d f16, dmin f16, scales[12], (Q5_K: qh[32]), qs[128]. Value i of the 256: sub-block
        # j = i // 32 (its scale and min), nibble j % 2 of qs[32 · (i // 64) + i % 32]; Q5_K adds
        # bit j of qh[i % 32] as the fifth bit.
        head = row + (k0 // 256) * (144 if TYPE == Q4_K else 176)
        sub = (k0 % 256) // 32
        d = tl.load(wv_ptr + head // 2, mask=mask, other=0.0).to(tl.float32)
        dmin = tl.load(wv_ptr + head // 2 + 1, mask=mask, other=0.0).to(tl.float32)
        scale, minimum = _k_scale_min(w_ptr + head + 4, sub, mask)
        qs = head + (16 if TYPE == Q4_K else 48) + 32 * (sub // 2)
        q = (tl.load(w_ptr + qs + cols, mask=mask, other=0).to(tl.int32) >> (4 * (sub % 2))) & 0xF
        if TYPE == Q5_K:
            qh = tl.load(w_ptr + head + 16 + cols, mask=mask, other=0).to(tl.int32)
            q = q | (((qh >> sub) & 1) << 4)
        w = (d * scale) * q.to(tl.float32) - dmin * minimum
    else:  # Q6_K: ql[128], qh[64], scales[16] int8, d f16
        # Value i: half h = i // 128, j = i % 128: nibble j // 64 of ql[64h + j % 64], bits 2 (j // 32) of
        # qh[32h + j % 32] on top, minus 32; scale i // 16.
        head = row + (k0 // 256) * 210
        i0 = k0 % 256
        half = i0 // 128
        j0 = i0 % 128
        ql = tl.load(w_ptr + head + 64 * half + j0 % 64 + cols, mask=mask, other=0).to(tl.int32)
        qh = tl.load(w_ptr + head + 128 + 32 * half + cols, mask=mask, other=0).to(tl.int32)
        q = (((ql >> (4 * (j0 // 64))) & 0xF) | (((qh >> (2 * (j0 // 32))) & 3) << 4)) - 32
        d = tl.load(wv_ptr + (head + 208) // 2, mask=mask, other=0.0).to(tl.float32)
        first = _signed_byte(tl.load(w_ptr + head + 192 + i0 // 16, mask=mask, other=0)).to(tl.float32)
        second = _signed_byte(tl.load(w_ptr + head + 193 + i0 // 16, mask=mask, other=0)).to(tl.float32)
        w = tl.where(cols < 16, d * first, d * second) * q.to(tl.float32)
    return w


@triton.jit
def _qmatmul_kernel(
    x_ptr,  # [M, K], last dim contiguous
    w_ptr,  # uint8 [N, row_bytes]
    wv_ptr,  # the same bytes as the type's float scalar
    out_ptr,  # [M, N] contiguous
    M,
    N,
    K,
    stride_xm,
    row_bytes,
    row_values,  # row_bytes // the size of wv_ptr's scalar
    TYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    K_STEPS: tl.constexpr,  # BLOCK_K steps per loop iteration: their loads are in flight together
    DOT_DTYPE: tl.constexpr,  # x's dtype; float32 for bfloat16 under the interpreter
):
    # Program order: GROUP_M consecutive M tiles per column tile, so they share its weight tiles in cache.
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n_tiles)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n_tiles)) % group_size
    pid_n = (pid % (GROUP_M * num_n_tiles)) // group_size

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of w
    n = cols[:, None].to(tl.int64)  # [BLOCK_N, 1]
    row, value_row = n * row_bytes, n * row_values
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_first in range(0, K, BLOCK_K * K_STEPS):
        for step in tl.static_range(K_STEPS):
            k0 = k_first + step * BLOCK_K
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
            # [BLOCK_N, BLOCK_K] float32: a weight row's bytes run along K, so a warp's loads are contiguous.
            in_k = (k0 + tl.arange(0, 1) < K)[None, :]  # [1, 1]: the last iteration's steps may pass K
            w = _dequant_step(w_ptr, wv_ptr, row, value_row, k0, K, (n < N) & in_k, TYPE, BLOCK_K)
            w = tl.trans(w.to(dtype).to(DOT_DTYPE))
            if DOT_DTYPE == tl.float32:
                acc = tl.dot(x.to(DOT_DTYPE), w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
    out = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def qmatmul(
    x: torch.Tensor, data: torch.Tensor, tensor_type: int, cols: int, launch: Launch | None = None
) -> torch.Tensor:
    """x [M, cols] · wᵀ → [M, rows] in x's dtype; w is GGUF rows, uint8 data [rows, row_bytes].

    `launch` overrides SKINNY / TILED (gpu_check's launch sweep); the bits are the same for any."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("data", data, ndim=2, dtypes=(torch.uint8,))
    check_same_device(x=x, data=data)
    row_bytes = _row_bytes(tensor_type, cols)
    if x.shape[1] != cols:
        raise ValueError(f"x has {x.shape[1]} columns; the weight has {cols}")
    if data.shape[1] != row_bytes or not data.is_contiguous():
        raise ValueError(
            f"data {tuple(data.shape)} is not contiguous {PACKED_TYPES[tensor_type][0]} rows of {cols} values"
        )
    num_rows, num_out = x.shape[0], data.shape[0]
    out = torch.empty(num_rows, num_out, dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_out == 0:
        return out
    if launch is None:
        launch = SKINNY if num_rows <= SKINNY_MAX_ROWS else TILED
    grid = (triton.cdiv(num_rows, launch.block_m) * triton.cdiv(num_out, launch.block_n),)
    values = data.view(_VALUE_DTYPES.get(tensor_type, torch.float16))
    _qmatmul_kernel[grid](
        x,
        data,
        values,
        out,
        num_rows,
        num_out,
        cols,
        x.stride(0),
        row_bytes,
        row_bytes // values.element_size(),
        **kernel_constexprs(tensor_type, launch, _dot_dtype(x.dtype)),
        num_warps=launch.num_warps,
    )
    return out


def kernel_constexprs(tensor_type: int, launch: Launch, dot_dtype) -> dict:
    """The kernel's compile-time arguments for a launch: what `qmatmul` passes, and what the
    ahead-of-time builds (kernel_sass, the build test) must pass to build the same kernel."""
    return dict(
        TYPE=tensor_type,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BLOCK_K=BLOCK_K,
        GROUP_M=launch.group_m,
        K_STEPS=launch.k_steps,
        DOT_DTYPE=dot_dtype,
    )


def _dot_dtype(dtype: torch.dtype):
    """x's dtype as tl.dot takes it; the interpreter multiplies bfloat16 as float32."""
    return tl.float32 if dtype == torch.bfloat16 and _is_interpreted(_qmatmul_kernel) else _TL_DTYPES[dtype]


def _row_bytes(tensor_type: int, cols: int) -> int:
    if tensor_type not in PACKED_TYPES:
        raise ValueError(f"GGML tensor type {tensor_type} has no dequant-matmul kernel")
    name, block_elems, block_bytes = PACKED_TYPES[tensor_type]
    if cols <= 0 or cols % block_elems:
        raise ValueError(f"a {name} row of {cols} values is not a whole number of {block_elems}-value blocks")
    return cols // block_elems * block_bytes


# ----------------------------------------------------------------------------- the torch reference


def dequantize(data: torch.Tensor, tensor_type: int, cols: int) -> torch.Tensor:
    """GGUF rows uint8 [rows, row_bytes] → float32 [rows, cols], with gguf-py's arithmetic, on data's device."""
    row_bytes = _row_bytes(tensor_type, cols)
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row_bytes:
        raise ValueError(f"data {tuple(data.shape)} {data.dtype} is not uint8 rows of {row_bytes} bytes")
    rows = data.shape[0]
    name, block_elems, block_bytes = PACKED_TYPES[tensor_type]
    if block_elems == 1:
        values_dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
        return data.contiguous().view(values_dtype).float()
    blocks = data.reshape(rows, -1, block_bytes)  # [rows, blocks, block_bytes]

    def f16(offset: int) -> torch.Tensor:  # [rows, blocks, 1] float32
        return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()

    def nibbles(qs: torch.Tensor) -> torch.Tensor:  # [..., n] bytes → [..., 2, n]: low nibbles, then high
        qs = qs.long()
        return torch.stack([qs & 0xF, qs >> 4], dim=-2)

    if name in ("Q4_0", "Q4_1"):
        qs_offset = 2 if name == "Q4_0" else 4
        q = nibbles(blocks[..., qs_offset:]).reshape(rows, -1, 32).float()
        values = f16(0) * (q - 8) if name == "Q4_0" else f16(0) * q + f16(2)
    elif name == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        values = q * f16(0)
    elif name in ("Q4_K", "Q5_K"):
        scale, minimum = _k_scales_mins(blocks[..., 4:16].long())  # [rows, blocks, 8]
        qs_offset = 16 if name == "Q4_K" else 48
        q = nibbles(blocks[..., qs_offset:].reshape(rows, -1, 4, 32)).reshape(rows, -1, 8, 32)
        if name == "Q5_K":
            bits = torch.arange(8, device=data.device).view(1, 1, 8, 1)
            q = q | (((blocks[..., 16:48].long()[:, :, None, :] >> bits) & 1) << 4)
        d = (f16(0) * scale.float())[..., None]
        dm = (f16(2) * minimum.float())[..., None]
        values = d * q.float() - dm
    else:  # Q6_K
        ql = nibbles(blocks[..., :128].reshape(rows, -1, 2, 64)).reshape(rows, -1, 2, 4, 32)
        shifts = torch.arange(0, 8, 2, device=data.device).view(1, 1, 1, 4, 1)  # an arange: capture-safe in a graph
        qh = (blocks[..., 128:192].reshape(rows, -1, 2, 1, 32).long() >> shifts) & 3
        q = ((ql | (qh << 4)) - 32).reshape(rows, -1, 16, 16).float()
        scale = blocks[..., 192:208].contiguous().view(torch.int8).float()
        values = (f16(208) * scale)[..., None] * q
    return values.reshape(rows, cols)


def _k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 packed bytes [..., 12] → 6-bit (scale, min) of the 8 sub-blocks, each [..., 8]."""
    low = scales[..., 0:4] & 63, scales[..., 4:8] & 63
    high_scale = (scales[..., 8:12] & 0xF) | ((scales[..., 0:4] >> 6) << 4)
    high_min = (scales[..., 8:12] >> 4) | ((scales[..., 4:8] >> 6) << 4)
    return torch.cat([low[0], high_scale], dim=-1), torch.cat([low[1], high_min], dim=-1)
