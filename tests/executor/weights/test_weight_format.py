"""The weight-format layer: GGUF weights kept packed, and the C++ matmul that reads them.

For every GGUF type the engine runs: the kernel's dequantization is bit-exact to
gguf-py's, its matmul matches dequantize-then-matmul (float64) within 1e-6 of the
output scale, and a row's result is bit-identical whatever rows share the call
(the fused path for ≤ 4 rows and the buffered path for more agree bit for bit).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from executor_svc.cpu_kernels import load
from executor_svc.errors import ModelLoadError
from executor_svc.weights.gguf_file import GGUFTensor
from executor_svc.weights.weight_format import (
    INT16_DOT_TYPES,
    Kernel,
    PackedWeight,
    bf16_panels,
    embedding,
    from_bf16_panels,
    has_int8_dot,
    has_int16_dot,
    linear,
    weight_bytes,
)
from tests.support.tiny_gguf import random_k_quant_blocks

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
ROWS = 40


def packed(qtype: Q, rows: int = ROWS, cols: int = 512, seed: int = 0) -> tuple[PackedWeight, np.ndarray]:
    """A random weight in `qtype` and gguf-py's float32 dequantization of it."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        raw = random_k_quant_blocks(rng, rows, cols, qtype).reshape(rows, -1)
    elif qtype == Q.F32:
        raw = values
    elif qtype == Q.F16:
        raw = values.astype(np.float16)
    else:
        raw = quants.quantize(values, qtype)
    tensor = GGUFTensor(f"w.{qtype.name}", (rows, cols), qtype, raw)
    return PackedWeight.from_gguf(tensor), tensor.dequantize()


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_dequantization_is_bit_exact_to_gguf_py(qtype):
    w, reference = packed(qtype)
    assert torch.equal(w.dequantize(), torch.from_numpy(reference))
    assert (
        w.nbytes
        == w.data.numel()
        == ROWS * 512 // quants.GGML_QUANT_SIZES[qtype][0] * quants.GGML_QUANT_SIZES[qtype][1]
    )


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
@pytest.mark.parametrize("num_rows", [1, 3, 4, 5, 17, 70])
def test_matmul_matches_dequantize_then_matmul(qtype, num_rows):
    w, reference = packed(qtype)
    x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(num_rows))
    y = linear(x, w)
    expected = x.double() @ torch.from_numpy(reference).double().T
    assert y.dtype == torch.float32 and y.shape == (num_rows, ROWS)
    assert (y.double() - expected).abs().max() <= 1e-6 * expected.abs().max()


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_a_rows_result_does_not_depend_on_its_batch(qtype):
    w, _ = packed(qtype)
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(1))
    assert_rows_do_not_depend_on_their_batch(
        w, x, [(0, 1), (5, 1), (3, 2), (10, 3), (20, 4), (7, 5), (30, 9), (0, 33), (64, 6)]
    )


def assert_rows_do_not_depend_on_their_batch(w, x: torch.Tensor, slices: list[tuple[int, int]]) -> torch.Tensor:
    """linear(x, w)'s rows are bit-identical computed in each slice (start, count) of x's rows, and
    on one thread; returns linear(x, w)."""
    full = linear(x, w)
    for start, count in slices:
        assert torch.equal(linear(x[start : start + count], w), full[start : start + count]), (start, count)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(linear(x, w), full)
    finally:
        torch.set_num_threads(threads)
    return full


INT16_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
needs_int16 = pytest.mark.skipif(not has_int16_dot(), reason="this CPU has no integer matmul (AVX2 + FMA)")
# The integer matmuls: int16 activations (`--matmul int16`) and int8 (`--matmul int8`), each where the CPU has it.
INTEGER_KERNELS = [
    pytest.param(Kernel.INT16, marks=needs_int16, id="int16"),
    pytest.param(
        Kernel.INT8,
        marks=pytest.mark.skipif(not has_int8_dot(), reason="this CPU has no int8 matmul (AVX512-VNNI)"),
        id="int8",
    ),
]


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 matmul sees it, in float64: per 32-value block, codes round-to-even((x − lo) ·
    (1 / dx)) in 0 .. 255 with lo = min and dx = (max − lo) / 255, all in float32, then dx · q + lo."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    dx = (hi - lo) / 255
    inverse = torch.where(dx == 0, torch.zeros_like(dx), 1 / dx)
    codes = torch.round((blocks - lo) * inverse).clamp(0, 255)
    return (codes.double() * dx.double() + lo.double()).reshape(x.shape)


@pytest.mark.parametrize("kernel", INTEGER_KERNELS)
@pytest.mark.parametrize("qtype", INT16_TYPES, ids=[t.name for t in INT16_TYPES])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 17, 70])
def test_integer_matmul_matches_dequantize_then_matmul(kernel, qtype, num_rows):
    """int16 activations keep ~15 bits per 32-value block: the result is within 1e-4 of the
    exact product (relative to its largest value), with outliers in the activations too. int8
    keeps 8 bits over each block's range: the result is the exact product of the weights with
    the activations rounded that way (within 1e-5: float32 sums), and within 5e-2 of the exact one."""
    w, reference = packed(qtype, rows=37)  # odd N: a one-row tile at the end
    wq = w.for_kernel(kernel)
    assert wq.kernel == kernel and int(qtype) in INT16_DOT_TYPES
    x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(num_rows))
    x[:, 7] *= 50  # an outlier in the first block
    x[:, 100:132] += 3  # a block all on one side of zero: int8's range starts at its minimum
    y = linear(x, wq)
    weights = torch.from_numpy(reference).double().T
    expected = x.double() @ weights
    assert y.dtype == torch.float32 and y.shape == (num_rows, 37)
    if kernel == Kernel.INT16:
        assert (y.double() - expected).abs().max() <= 1e-4 * expected.abs().max()
    else:
        rounded = int8_activations(x) @ weights
        assert (y.double() - rounded).abs().max() <= 1e-5 * rounded.abs().max()
        assert (y.double() - expected).abs().max() <= 5e-2 * expected.abs().max()
    assert linear(torch.zeros(2, 512), wq).abs().max() == 0  # all-zero blocks: scale 0, no NaN
    constant = torch.full((1, 512), 0.75)  # one value per block: dx = 0, every code 0, x = lo exactly
    torch.testing.assert_close(linear(constant, wq).double(), constant.double() @ weights, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", INTEGER_KERNELS)
@pytest.mark.parametrize("qtype", INT16_TYPES, ids=[t.name for t in INT16_TYPES])
def test_an_integer_matmul_rows_result_does_not_depend_on_its_batch(kernel, qtype):
    w, _ = packed(qtype)
    wq = w.for_kernel(kernel)
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(2))
    full = linear(x, wq)
    for start, count in [(0, 1), (5, 1), (3, 2), (10, 3), (20, 4), (7, 5), (30, 9), (0, 33), (64, 6)]:
        assert torch.equal(linear(x[start : start + count], wq), full[start : start + count]), (start, count)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(linear(x, wq), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel", INTEGER_KERNELS)
@pytest.mark.parametrize("qtype", INT16_TYPES, ids=[t.name for t in INT16_TYPES])
@pytest.mark.parametrize(
    ("num_weight_rows", "num_rows"), [(37, 1), (37, 2), (16, 3), (53, 7), (20, 8), (37, 15), (53, 40), (129, 70)]
)
def test_the_integer_matmuls_register_tiles_are_bit_identical(kernel, qtype, num_weight_rows, num_rows):
    """A decode row and a prompt row take different register tiles (one row; tiles of 8 rows, or 4
    on AVX2, and one of the rest; from 32 rows a panel widened once instead of in registers), which
    compute the same integer sums and the same float operations in the same order: forced either
    way, every output is bit-identical (odd weight rows: a partial, zero-padded panel; odd row
    counts: a tile of the rest, 1 to 7 rows; an outlier and an all-zero block)."""
    kernels = load()
    multiply = kernels.qlinear_int8 if kernel == Kernel.INT8 else kernels.qlinear_int16
    w, _ = packed(qtype, rows=num_weight_rows, seed=num_rows)
    wq = w.for_kernel(kernel)
    x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(7))
    x[:, 40] *= 80
    x[0, 64:96] = 0
    by_rows = multiply(x, wq.data, wq.tensor_type, 512, num_weight_rows, path=1)
    by_panels = multiply(x, wq.data, wq.tensor_type, 512, num_weight_rows, path=2)
    assert torch.equal(by_rows, by_panels)
    assert torch.equal(linear(x, wq), by_rows)


AMX_TILES = 3  # qlinear_int16's `path` that forces the AMX tiles (PANELS = 2, ROWS = 1)
needs_amx = pytest.mark.skipif(not load().has_amx_tiles(), reason="no AMX tiles here (CPU, kernel build or OS)")
needs_bf16 = pytest.mark.skipif(not load().has_bf16_dot_products(), reason="no bf16 matmul here (AVX512-BF16)")


@pytest.fixture(params=["amx", "vdpbf16ps"])
def bf16_kernel(request):
    """The bf16 matmul's kernel under test: the AMX tiles (AMX CPUs only), or VDPBF16PS in vector
    registers (every AVX512-BF16 CPU: Zen 4's own, and on an AMX CPU with its tiles switched off)."""
    kernels = load()
    if request.param == "amx" and not kernels.has_amx_tiles():
        pytest.skip("no AMX tiles here (CPU, kernel build or OS)")
    allowed = kernels.allow_amx_tiles(request.param == "amx")
    yield request.param
    kernels.allow_amx_tiles(allowed)


@needs_amx
@pytest.mark.parametrize("qtype", INT16_TYPES, ids=[t.name for t in INT16_TYPES])
@pytest.mark.parametrize(
    ("num_weight_rows", "num_rows", "k"),
    [(37, 1, 512), (16, 15, 512), (53, 17, 512), (20, 64, 512), (129, 70, 512), (576, 256, 512), (40, 33, 1536)],
)
def test_the_amx_tiles_give_the_vector_tiles_bits(qtype, num_weight_rows, num_rows, k):
    """On AMX CPUs a prompt's rows take the tile unit: each int16 code split in two bf16 digits,
    whose dot products with the weight codes are exact integers in float32 (Q4: both digits in one
    sum, every partial sum below 2^24; Q8_0: a sum per digit, added with one rounding), then the
    vector tiles' own epilogue.
    So every output is bit-identical to the vector tiles': at the extremes of the int16 codes (a
    row of ±1 with an outlier: codes of ±32767 and around it), a zero block, padding rows (rows
    not a multiple of 16), K in several slices, one thread or two, and on the engine's path from 16
    rows, where it takes the tiles by itself."""
    kernels = load()
    w, _ = packed(qtype, rows=num_weight_rows, cols=k, seed=num_rows)
    wq = w.for_kernel()
    generator = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, k, generator=generator)
    x[:, 40] *= 80
    x[0, 64:96] = 0
    if num_rows > 2:
        x[1] = torch.where(torch.rand(k, generator=generator) > 0.5, 1.0, -1.0)
        x[2, ::7] = 1e4
    panels = kernels.qlinear_int16(x, wq.data, wq.tensor_type, k, num_weight_rows, path=2)
    tiles = kernels.qlinear_int16(x, wq.data, wq.tensor_type, k, num_weight_rows, path=AMX_TILES)
    assert torch.equal(tiles, panels)
    assert torch.equal(linear(x, wq), panels)  # the engine's path: the tiles from 16 rows, else the vector tiles
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(
            kernels.qlinear_int16(x, wq.data, wq.tensor_type, k, num_weight_rows, path=AMX_TILES), panels
        )
    finally:
        torch.set_num_threads(threads)


def extreme_codes(qtype: Q, rows: int, cols: int) -> PackedWeight:
    """Weight rows whose every code is at its extreme (Q4: nibble 15; Q8_0: alternately −128 and 127 by
    row), with scale 1 (and Q4_1's minimum 0): the largest integer block sums a block can have."""
    blocks = cols // 32
    d = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    if qtype == Q.Q8_0:
        codes = np.where(np.arange(rows)[:, None, None] % 2 == 0, np.int8(-128), np.int8(127)).astype(np.int8)
        block = [np.broadcast_to(d, (rows, blocks, 2)), np.broadcast_to(codes.view(np.uint8), (rows, blocks, 32))]
    else:
        block = [np.broadcast_to(d, (rows, blocks, 2))]
        if qtype == Q.Q4_1:
            block.append(np.zeros((rows, blocks, 2), np.uint8))
        block.append(np.full((rows, blocks, 16), 0xFF, np.uint8))
    raw = np.concatenate(block, axis=2).reshape(rows, -1)
    return PackedWeight.from_gguf(GGUFTensor(f"extreme.{qtype.name}", (rows, cols), qtype, raw))


@needs_amx
@pytest.mark.parametrize("qtype", INT16_TYPES, ids=[t.name for t in INT16_TYPES])
def test_the_amx_tiles_are_exact_at_the_largest_block_sums(qtype):
    """Q4 blocks take both digits into one float32 sum tile, exact only while every partial sum
    stays below 2^24: at the bound (codes of ±32767 against nibbles of 15, 32 · 32767 · 15 =
    15,728,160) the tiles still give the vector tiles' bits and the float64 product's value. Q8_0's
    sums reach 2^27, past float32's integers, and keep a sum tile per digit (the ISA defines
    TDPBF16PS as rounding after every product; the developers' Xeon rounds fewer times, so one
    tile would pass here too, and this test cannot tell the two apart)."""
    kernels = load()
    w = extreme_codes(qtype, 32, 512).for_kernel()
    x = torch.ones(80, 512)
    x[1::2] = -1.0  # codes of +32767 and −32767
    x[2, ::2] = 0.999  # codes around them
    panels = kernels.qlinear_int16(x, w.data, w.tensor_type, 512, 32, path=2)
    tiles = kernels.qlinear_int16(x, w.data, w.tensor_type, 512, 32, path=AMX_TILES)
    assert torch.equal(tiles, panels)
    expected = x.double() @ w.dequantize().double().T  # within the int16 codes' rounding (2^-16 of a block's max)
    assert (tiles.double() - expected).abs().max() <= 2e-5 * expected.abs().max()


@needs_amx
def test_a_benchmark_can_turn_the_amx_tiles_off_and_on():
    """allow_amx_tiles switches the engine's path for benchmarks to compare, without changing a bit."""
    kernels = load()
    w, _ = packed(Q.Q4_1, rows=64, cols=512)
    wq = w.for_kernel()
    x = torch.randn(128, 512, generator=torch.Generator().manual_seed(3))
    on = linear(x, wq)
    assert kernels.allow_amx_tiles(False) is True
    try:
        assert torch.equal(linear(x, wq), on)
    finally:
        assert kernels.allow_amx_tiles(True) is False


@pytest.mark.skipif(load().has_amx_tiles(), reason="this machine has AMX tiles")
def test_forcing_the_amx_tiles_without_them_is_refused_by_name():
    w, _ = packed(Q.Q8_0, rows=16)
    wq = w.for_kernel()
    with pytest.raises(RuntimeError, match="the AMX tiles need an AMX-BF16 CPU"):
        load().qlinear_int16(torch.randn(32, 512), wq.data, wq.tensor_type, 512, 16, path=AMX_TILES)


def test_bf16_panels_hold_the_bf16_values_in_the_tiles_layout():
    """bf16_panels rounds each value to bf16 once and lays it out as the AMX B tiles read it (block b of
    panel p: 16 pairs of columns × 16 rows, the rows padded to an even number of panels);
    from_bf16_panels reads it back. A weight for `--matmul bf16` keeps its shape and type, holds 2
    bytes a value and looks up rows as the bf16 values."""
    w, reference = packed(Q.Q4_1, rows=37)
    panels = bf16_panels(torch.from_numpy(reference))
    assert panels.shape == (4, 16, 16, 32) and panels.dtype == torch.bfloat16
    assert panels[1, 3, 5, 2 * 7 + 1] == torch.tensor(reference[16 + 7, 32 * 3 + 2 * 5 + 1]).bfloat16()
    assert torch.equal(from_bf16_panels(panels, torch.arange(37)), torch.from_numpy(reference).bfloat16().float())
    assert not from_bf16_panels(panels, torch.arange(37, 64)).any()  # padding rows: zeros
    wb = w.for_kernel(Kernel.BF16)
    assert wb.kernel == Kernel.BF16 and wb.shape == w.shape and wb.tensor_type == w.tensor_type
    assert wb.nbytes == 4 * 16 * 512 * 2 and wb.for_kernel(Kernel.BF16) is wb
    assert torch.equal(
        embedding(torch.tensor([36, 0]), wb, torch.float32), from_bf16_panels(panels, torch.tensor([36, 0]))
    )


@needs_bf16
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.F16], ids=lambda t: t.name)
@pytest.mark.parametrize(("num_weight_rows", "k"), [(37, 512), (64, 768), (100, 1536)])
def test_the_bf16_matmul_sums_bf16_products_and_a_rows_bits_do_not_depend_on_its_batch(
    bf16_kernel, qtype, num_weight_rows, k
):
    """`--matmul bf16`: the product of the bf16-rounded activations and weights, float32 sums over all
    of K (within float32's rounding of the float64 product), and each row one fixed sequence of products
    over K (tile products, or VDPBF16PS in register tiles of 8 rows and a tail): bit-identical alone,
    in any slice of rows, padded (rows not a multiple of 8, 16 or 32, weight rows not of 32) or not,
    on one thread or two."""
    w, reference = packed(qtype, rows=num_weight_rows, cols=k, seed=k)
    wb = w.for_kernel(Kernel.BF16)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(num_weight_rows))
    x[:, 40] *= 80
    y = assert_rows_do_not_depend_on_their_batch(wb, x, [(0, 1), (69, 1), (3, 2), (10, 16), (20, 17), (1, 33), (5, 64)])
    expected = x.bfloat16().double() @ torch.from_numpy(reference).bfloat16().double().T
    assert y.shape == (70, num_weight_rows)
    assert ((y.double() - expected).abs() <= 1e-5 * expected.abs().max()).all()


@needs_bf16
@pytest.mark.parametrize(("intermediate", "num_rows"), [(64, 1), (64, 17), (96, 70), (256, 300)])
def test_the_bf16_swiglu_gives_the_three_calls_bits(bf16_kernel, intermediate, num_rows):
    """qlinear_bf16_swiglu (the C++ layer stack's FFN under `--matmul bf16`) computes gate and up for 32
    rows × 32 columns at a time (VDPBF16PS: 6 rows, so register tiles that straddle two 16-row A
    tiles) and writes the down matmul's input tiles from them: its output is
    bit-identical to qlinear_bf16 → silu_mul → qlinear_bf16, for padded row counts, gates large enough
    to saturate exp, several tasks' worth of rows and columns, on one thread or two."""
    kernels = load()
    gate_up, _ = packed(Q.Q4_1, rows=2 * intermediate, cols=512, seed=intermediate)
    down, _ = packed(Q.Q8_0, rows=40, cols=intermediate, seed=num_rows)
    gu, dn = gate_up.for_kernel(Kernel.BF16).data, down.for_kernel(Kernel.BF16).data
    x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(num_rows))
    x[:, 7] *= 200  # gates far past exp's range both ways
    three_calls = kernels.qlinear_bf16(kernels.silu_mul(kernels.qlinear_bf16(x, gu, 2 * intermediate)), dn, 40)
    assert torch.equal(kernels.qlinear_bf16_swiglu(x, gu, dn, 40), three_calls)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(kernels.qlinear_bf16_swiglu(x, gu, dn, 40), three_calls)
    finally:
        torch.set_num_threads(threads)


@needs_bf16
def test_a_bf16_swiglu_whose_gate_up_does_not_fit_its_down_is_refused():
    kernels = load()
    gate_up, _ = packed(Q.Q4_1, rows=96, cols=512)
    down, _ = packed(Q.Q4_1, rows=40, cols=64)
    with pytest.raises(RuntimeError, match=r"gate_up_wb must hold 2 × 64 rows \(gate, then up\)"):
        kernels.qlinear_bf16_swiglu(
            torch.randn(4, 512), gate_up.for_kernel(Kernel.BF16).data, down.for_kernel(Kernel.BF16).data, 40
        )


@pytest.mark.skipif(load().has_bf16_dot_products(), reason="this machine has the bf16 matmul")
def test_the_bf16_matmul_without_avx512_bf16_is_refused_by_name():
    w, reference = packed(Q.Q4_1, rows=32)
    with pytest.raises(RuntimeError, match="the bf16 matmul needs AVX512-BF16"):
        load().qlinear_bf16(torch.randn(4, 512), bf16_panels(torch.from_numpy(reference)), 32)


@needs_int16
@pytest.mark.parametrize("qtype", INT16_TYPES, ids=[t.name for t in INT16_TYPES])
def test_the_integer_matmuls_panel_layout_holds_the_same_values(qtype):
    """for_kernel repacks rows in panels of 16 (37 rows: a zero-padded last panel) without
    changing a value or growing the memory beyond the padding: dequantizing and embedding
    lookups read the panels' bytes back exactly."""
    w, _ = packed(qtype, rows=37)
    w16 = w.for_kernel()
    assert w16.data.shape == (3, 16 * w.data.shape[1]) and w16.for_kernel() is w16
    assert w16.nbytes == w.nbytes + 11 * w.data.shape[1]
    w8 = w16.for_kernel(Kernel.INT8)  # the int8 matmul reads the same panels: re-tagged, not copied
    assert w8.kernel == Kernel.INT8 and w8.data is w16.data and torch.equal(w8.dequantize(), w.dequantize())
    assert torch.equal(w.for_kernel(Kernel.INT8).data, w16.data)
    with pytest.raises(ValueError, match="TRITON is not an integer matmul"):
        w.for_kernel(Kernel.TRITON)
    assert torch.equal(w16.dequantize(), w.dequantize())
    ids = torch.tensor([36, 0, 5, 5, 33])
    assert torch.equal(embedding(ids, w16, torch.float32), embedding(ids, w, torch.float32))
    with pytest.raises(ValueError, match="before repacking"):
        PackedWeight.concat([w16, w16])


def test_the_integer_matmul_leaves_other_types_exact():
    for qtype in (Q.Q4_K, Q.F16):
        w, _ = packed(qtype)
        assert w.for_kernel() is w
    w, _ = packed(Q.Q6_K)
    with pytest.raises(ModelLoadError, match="integer matmul does not run Q6_K"):
        PackedWeight(w.data, w.tensor_type, w.shape, Kernel.INT16)


def test_odd_row_lengths_of_unquantized_types_take_the_masked_tail():
    rng = np.random.default_rng(3)
    values = rng.standard_normal((9, 50)).astype(np.float32)
    w = PackedWeight.from_gguf(GGUFTensor("odd", (9, 50), Q.F32, values))
    x = torch.randn(6, 50)
    expected = x.double() @ torch.from_numpy(values).double().T
    assert (linear(x, w).double() - expected).abs().max() < 1e-5
    assert torch.equal(linear(x[2:3], w), linear(x, w)[2:3])


def test_bfloat16_activations_come_back_as_bfloat16():
    w, reference = packed(Q.Q4_1)
    x = torch.randn(3, 512).bfloat16()
    y = linear(x, w)
    assert y.dtype == torch.bfloat16
    expected = x.double() @ torch.from_numpy(reference).double().T
    assert (y.double() - expected).abs().max() <= 1e-2 * expected.abs().max()


def test_embedding_rows_and_concatenated_weights():
    w, reference = packed(Q.Q8_0)
    ids = torch.tensor([0, 7, 7, 39])
    assert torch.equal(embedding(ids, w, torch.float32), torch.from_numpy(reference)[ids])
    other, other_reference = packed(Q.Q8_0, rows=8, seed=5)
    fused = PackedWeight.concat([w, other])
    assert isinstance(fused, PackedWeight) and fused.shape == (48, 512)
    assert torch.equal(fused.dequantize(), torch.from_numpy(np.concatenate([reference, other_reference])))
    # Parts of different types cannot share one matmul: they stay apart and their outputs are joined.
    mixed_part, mixed_reference = packed(Q.Q6_K, rows=8)
    mixed = PackedWeight.concat([w, mixed_part])
    assert isinstance(mixed, tuple) and weight_bytes(mixed) == w.nbytes + mixed_part.nbytes
    x = torch.randn(2, 512)
    assert torch.equal(linear(x, mixed), torch.cat([linear(x, w), linear(x, mixed_part)], dim=-1))
    assert torch.allclose(
        linear(x, mixed), x @ torch.from_numpy(np.concatenate([reference, mixed_reference])).T, atol=1e-3
    )


def test_a_type_without_a_kernel_is_refused_by_name():
    raw = quants.quantize(np.zeros((4, 64), dtype=np.float32), Q.Q5_0)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up\.weight.*Q5_0"):
        PackedWeight.from_gguf(GGUFTensor("blk.0.ffn_up.weight", (4, 64), Q.Q5_0, raw))


@pytest.mark.slow
def test_packed_model_weights_stay_at_the_gguf_size(default_model_path):
    from executor_svc.weights.gguf_file import open_gguf
    from executor_svc.weights.model_config import ModelConfig
    from executor_svc.weights.model_weights import load_weights

    gguf = open_gguf(default_model_path)
    config = ModelConfig.from_gguf(gguf)
    weights = load_weights(gguf, config, torch.float32, torch.device("cpu"))
    file_size = default_model_path.stat().st_size
    assert weights.is_packed
    assert 0.9 * file_size <= weights.num_bytes <= 1.1 * file_size
