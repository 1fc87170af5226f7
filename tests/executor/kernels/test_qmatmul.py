"""The dequant-matmul kernel (interpreted) against dequantize-then-matmul, for every GGUF type it runs."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

from tests.support.tiny_gguf import random_k_quant_blocks  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.kernels.qmatmul import SKINNY_MAX_ROWS, Launch, dequantize, qmatmul  # noqa: E402

K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
TYPES = (*FLOAT_TYPES, T.Q4_0, T.Q4_1, T.Q8_0, *K_QUANTS)


def gguf_rows(qtype: T, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random weights as GGUF rows, uint8 [rows, row_bytes]."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        raw = random_k_quant_blocks(rng, rows, cols, qtype)
    elif qtype == T.BF16:
        values = torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32)).to(torch.bfloat16)
        return values.view(torch.uint8).reshape(rows, -1).clone()
    elif qtype == T.F32:
        raw = rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint8)
    else:
        raw = (
            quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
            .view(np.uint8)
            .reshape(rows, -1)
        )
    return torch.from_numpy(np.ascontiguousarray(raw))


def reference_weights(data: torch.Tensor, qtype: T, cols: int) -> torch.Tensor:
    """gguf-py's dequantization: float32 [rows, cols]."""
    if qtype == T.BF16:
        return data.view(torch.bfloat16).float()
    values = quants.dequantize(data.numpy(), qtype).reshape(data.shape[0], cols)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def block_cols(qtype: T, num_blocks: int) -> int:
    return num_blocks * (256 if qtype in K_QUANTS else 32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_torch_reference_dequantizes_as_gguf_does(qtype):
    cols = block_cols(qtype, 2)
    data = gguf_rows(qtype, 5, cols)
    assert torch.equal(dequantize(data, int(qtype), cols), reference_weights(data, qtype, cols))


# (rows of x, rows of w, blocks per row): M = 1 with an odd N over two column tiles and K one block
# (shorter than the kernel's K step for the 32-value types); a tiled-launch M over three row tiles
# with K several blocks (a ragged last K step for the 32-value types).
SHAPES = [(1, 33, 1), (37, 9, 3)]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m, n, num_blocks", SHAPES, ids=lambda v: str(v))
def test_kernel_matches_dequantize_then_matmul(qtype, m, n, num_blocks):
    cols = block_cols(qtype, num_blocks)
    data = gguf_rows(qtype, n, cols, seed=m + n)
    w = reference_weights(data, qtype, cols).double()
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(n))
    expected = x.double() @ w.T
    out = qmatmul(x, data, int(qtype), cols)
    assert out.shape == (m, n) and out.dtype == torch.float32
    # float32 products and sums of K values: a few ulps of the row's magnitude.
    tolerance = 1e-5 * (x.double().abs() @ w.abs().T)
    assert torch.all((out.double() - expected).abs() <= tolerance + 1e-6)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_kernel_decodes_every_value_as_gguf_does(qtype):
    """x = the identity: each output is 1 · one weight plus zeros, exact in float32, so the kernel's
    decoded values must be gguf-py's bit for bit, at every column of every block (the skinny
    launch for the first rows, the tiled one for all of them). Float rows of 70 values: the last
    32-column step is cut short inside a row."""
    cols = block_cols(qtype, 2 if qtype in K_QUANTS else 3) if qtype not in FLOAT_TYPES else 70
    data = gguf_rows(qtype, 19, cols, seed=5)
    weights_t = reference_weights(data, qtype, cols).T  # [cols, rows]
    identity = torch.eye(cols)
    assert torch.equal(qmatmul(identity, data, int(qtype), cols), weights_t)
    assert torch.equal(qmatmul(identity[:7], data, int(qtype), cols), weights_t[:7])


@pytest.mark.parametrize("qtype", (T.Q4_0, T.Q6_K), ids=lambda t: t.name)
def test_bf16_activations_round_the_weights_to_bf16(qtype):
    cols = block_cols(qtype, 2)
    data = gguf_rows(qtype, 11, cols)
    w = reference_weights(data, qtype, cols)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = qmatmul(x, data, int(qtype), cols)
    assert out.dtype == torch.bfloat16
    w = w.to(torch.bfloat16).double()
    expected = x.double() @ w.T
    # Exact products, float32 sums, one rounding (or truncation, interpreted) of the result to bfloat16.
    tolerance = 2**-7 * (x.double().abs() @ w.abs().T)
    assert torch.all((out.double() - expected).abs() <= tolerance)


@pytest.mark.parametrize("qtype", (T.Q8_0, T.Q4_K), ids=lambda t: t.name)
def test_a_rows_bits_do_not_depend_on_m_or_launch_shape(qtype):
    """Row 0 alone, among a decode batch (skinny launch) and in a prefill chunk (tiled launch)."""
    cols = block_cols(qtype, 3 if qtype == T.Q8_0 else 1)
    data = gguf_rows(qtype, 70, cols)
    x = torch.randn(SKINNY_MAX_ROWS + 9, cols, generator=torch.Generator().manual_seed(2))
    alone = qmatmul(x[:1], data, int(qtype), cols)
    for m in (3, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 9):
        assert torch.equal(qmatmul(x[:m], data, int(qtype), cols)[:1], alone), f"M={m}"
    # A row deeper in the batch: the same bits as when it leads.
    assert torch.equal(qmatmul(x, data, int(qtype), cols)[20], qmatmul(x[20:21], data, int(qtype), cols)[0])


@pytest.mark.parametrize(
    "launch",
    (
        Launch(block_n=16, group_m=1, k_steps=4, num_warps=4),
        Launch(block_n=64, group_m=2, k_steps=2, num_warps=8),
        Launch(block_n=64, group_m=8, k_steps=1, num_warps=4, block_m=64),
    ),
    ids=("narrow-4-steps", "grouped-2-steps", "64-rows"),
)
def test_the_launch_changes_no_bits(launch):
    """gpu_check sweeps launches on a card to pick SKINNY and TILED: none may change a row's bits
    here, including where K is not a whole number of the launch's steps (the last steps are
    masked). (More rows per program, block_m, keeps them under the interpreter, whose dot keeps
    each row's order; on a card the sweep checks it.)"""
    cols = block_cols(T.Q8_0, 5)
    data = gguf_rows(T.Q8_0, 70, cols)
    x = torch.randn(SKINNY_MAX_ROWS + 9, cols, generator=torch.Generator().manual_seed(3))
    for m in (1, SKINNY_MAX_ROWS + 9):
        assert torch.equal(qmatmul(x[:m], data, int(T.Q8_0), cols, launch), qmatmul(x[:m], data, int(T.Q8_0), cols))


def test_bad_arguments_are_refused_with_a_clear_error():
    data = gguf_rows(T.Q4_0, 4, 64)
    with pytest.raises(ValueError, match="x has 32 columns"):
        qmatmul(torch.zeros(1, 32), data, int(T.Q4_0), 64)
    with pytest.raises(ValueError, match="not a whole number of 32-value blocks"):
        qmatmul(torch.zeros(1, 60), data, int(T.Q4_0), 60)
    with pytest.raises(ValueError, match="no dequant-matmul kernel"):
        qmatmul(torch.zeros(1, 64), data, 10, 64)
    with pytest.raises(ValueError, match="dtype"):
        qmatmul(torch.zeros(1, 64, dtype=torch.int32), data, int(T.Q4_0), 64)
    with pytest.raises(ValueError, match="not contiguous Q4_0 rows"):
        qmatmul(torch.zeros(1, 64), data[:, :10], int(T.Q4_0), 64)
