"""The C++ CPU ops (`CpuOps`): each against its TorchOps / attention.py reference, and the
attention batch-invariant bit for bit (batch, chunking, thread count)."""

from __future__ import annotations

import pytest
import torch

from executor_svc.kv.kv_cache import to_key_layout, to_value_layout
from executor_svc.model.attention import write_kv
from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice
from executor_svc.model.torch_ops import TorchOps
from tests.executor.model.test_attention import BLOCK_SIZE, Setup, dense_reference

cpu_kernels = pytest.importorskip("executor_svc.cpu_kernels")
try:
    from executor_svc.model.cpu_ops import CpuOps

    OPS = CpuOps()
except cpu_kernels.CpuKernelsUnavailable as exc:  # no compiler here
    pytest.skip(str(exc), allow_module_level=True)

REF = TorchOps()
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
BF16_DOTS = cpu_kernels.load().has_bf16_dot_products()


def attention_tol(dtype, kv_dtype):
    """Over a bfloat16 KV cache on a CPU with bfloat16 dot products, q and the probabilities are
    rounded to bfloat16 too: bfloat16's tolerance whatever the activations."""
    return TOL[torch.bfloat16 if kv_dtype == torch.bfloat16 and BF16_DOTS else dtype]


def run_attention(setup: Setup, parts, dtype=torch.float32, row_multiple=4, kv_dtype=None):
    """parts: (request, first position, query tokens). Returns each part's output rows and the full output.
    The cache holds K and V in kv_dtype (None: dtype)."""
    slices = [RequestSlice([0] * m, start, setup.tables[r], num_logits=1) for r, start, m in parts]
    batch = RaggedBatch.build(slices, BLOCK_SIZE, torch.device("cpu"), row_multiple=row_multiple)
    for r, start, m in parts:  # the whole history up to the part's end is in the cache
        hist = RaggedBatch.build(
            [RequestSlice([0] * (start + m), 0, setup.tables[r], 0)], BLOCK_SIZE, torch.device("cpu")
        )
        write_kv(setup.k[r][: start + m], setup.v[r][: start + m], setup.k_cache, setup.v_cache, hist.slot_mapping)
    q = torch.zeros(batch.num_padded_tokens, setup.num_heads, setup.head_dim)
    for (r, start, m), s0 in zip(parts, batch.query_starts):
        q[s0 : s0 + m] = setup.q[r][start : start + m]
    metadata = OPS.prepare(batch, BLOCK_SIZE)
    kv_dtype = kv_dtype or dtype
    k_cache, v_cache = setup.k_cache.to(kv_dtype), setup.v_cache.to(kv_dtype)
    out = OPS.attention(q.to(dtype), k_cache, v_cache, metadata, setup.head_dim**-0.5)
    return [out[s0 : s0 + m] for (_, _, m), s0 in zip(parts, batch.query_starts)], out, batch


# ------------------------------------------------------------------ attention: correctness


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(4, 4, 32), (6, 2, 32), (8, 1, 32), (9, 3, 64), (4, 2, 128), (4, 2, 24)]
)
def test_attention_matches_dense_attention(num_heads, num_kv_heads, head_dim, dtype):
    lens = [1, 15, 16, 17, 40, 300, 70]
    setup = Setup(lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    # Whole prefill, chunk ending on a block boundary, decode, verify run, long chunk, another decode.
    parts = [(0, 0, 1), (1, 0, 15), (2, 8, 8), (3, 16, 1), (4, 35, 5), (5, 100, 200), (6, 69, 1)]
    outs, full, batch = run_attention(setup, parts, dtype)
    scale = head_dim**-0.5
    for (r, start, m), out in zip(parts, outs):
        q, k, v = setup.q[r][start : start + m], setup.k[r][: start + m], setup.v[r][: start + m]
        if dtype != torch.float32:  # the reference on the same rounded inputs
            q, k, v = (t.to(dtype).float() for t in (q, k, v))
        ref = dense_reference(q, k, v, scale)
        torch.testing.assert_close(out.float(), ref, **TOL[dtype])
        assert out.dtype == dtype
    assert torch.equal(full[batch.num_tokens :], torch.zeros_like(full[batch.num_tokens :]))  # padding rows


def test_attention_matches_the_torch_path_and_long_decode_contexts():
    lens = [4000, 10, 1030, 33]
    setup = Setup(lens, num_heads=9, num_kv_heads=3, head_dim=64, seed=3)
    parts = [(0, 3999, 1), (1, 9, 1), (2, 1025, 5), (3, 0, 33)]
    outs, _, batch = run_attention(setup, parts)
    ref = REF.attention(
        torch.cat(
            [setup.q[r][s : s + m] for r, s, m in parts]
            + [torch.zeros(batch.num_padded_tokens - batch.num_tokens, 9, 64)]
        ),
        setup.k_cache,
        setup.v_cache,
        REF.prepare(batch, BLOCK_SIZE),
        64**-0.5,
    )
    torch.testing.assert_close(torch.cat(outs), ref[: batch.num_tokens], rtol=1e-5, atol=1e-5)


def test_attention_rejects_a_block_table_entry_outside_the_cache():
    setup = Setup([20])
    batch = RaggedBatch.build([RequestSlice([0], 19, setup.tables[0], 1)], BLOCK_SIZE, torch.device("cpu"))
    metadata = OPS.prepare(batch, BLOCK_SIZE)
    metadata.block_tables[0, 1] = setup.k_cache.shape[0] + 5
    with pytest.raises(RuntimeError, match="block table entry"):
        OPS.attention(torch.zeros(1, 6, 32), setup.k_cache, setup.v_cache, metadata, 1.0)


# ------------------------------------------------------------------ attention: batch invariance

LAYOUTS = [
    # As part of prefill chunks of different lengths.
    [(0, 597, 4)],
    [(0, 590, 11)],
    [(0, 580, 64)],
    [(0, 500, 200)],
    [(0, 0, 601)],
    # As a verify run, with other requests of very different lengths around it.
    [(1, 49, 1), (0, 598, 5), (2, 200, 60), (3, 0, 9)],
    [(4, 512, 1), (2, 259, 1), (0, 600, 1), (1, 10, 40)],
    [(3, 8, 1), (4, 0, 513), (0, 599, 2)],
    [(r, n - 1, 1) for r, n in enumerate([1, 50, 260, 9, 513]) if r] + [(0, 600, 1)],
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (9, 3)])
def test_a_rows_result_does_not_depend_on_the_batch_or_the_threads(num_heads, num_kv_heads, dtype):
    setup = Setup([700, 50, 260, 9, 513], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64)
    position = 600  # the query row under test: request 0, position 600
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        solo = run_attention(setup, [(0, position, 1)], dtype)[0][0][0]
        for num_threads in sorted({1, 2, max(2, threads)}):
            torch.set_num_threads(num_threads)
            for parts in LAYOUTS:
                outs = run_attention(setup, parts, dtype)[0]
                index = [p[0] for p in parts].index(0)
                row = outs[index][position - parts[index][1]]
                assert torch.equal(row, solo), (
                    f"{num_threads} threads, layout {parts}: max diff {(row - solo).abs().max()}"
                )
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ fused row ops


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (13, 576), (5, 3, 64), (7, 100)])
def test_rms_norm(shape, dtype):
    x, w = randn(*shape, dtype=dtype), randn(shape[-1], dtype=dtype, seed=1)
    out = OPS.rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, REF.rms_norm(x, w, 1e-5), **TOL[dtype])


def test_rms_norm_of_a_strided_view_and_row_invariance():
    qkv = randn(9, 5 * 64)
    w = randn(64, seed=1)
    view = qkv[:, 64:192].view(9, 2, 64)  # k heads of a qkv output: strided rows
    out = OPS.rms_norm(view, w, 1e-6)
    torch.testing.assert_close(out, REF.rms_norm(view, w, 1e-6), rtol=1e-5, atol=1e-5)
    assert torch.equal(OPS.rms_norm(view[4:5], w, 1e-6), out[4:5])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_in_place(dtype):
    x, residual, w = randn(6, 576, dtype=dtype), randn(6, 576, dtype=dtype, seed=1), randn(576, dtype=dtype, seed=2)
    ref_normed, ref_residual = REF.add_rms_norm(x, residual.clone(), w, 1e-5)
    normed, new_residual = OPS.add_rms_norm(x, residual, w, 1e-5)
    assert new_residual is residual or new_residual.data_ptr() == residual.data_ptr()
    assert torch.equal(new_residual, ref_residual)  # one rounding of one add: exact
    torch.testing.assert_close(normed, ref_normed, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(dtype):
    x = randn(11, 9, 64, dtype=dtype)
    angles = randn(11, 32, seed=1) * 3
    cos, sin = angles.cos(), angles.sin()
    out = OPS.rope(x, cos, sin)
    ref = REF.rope(x, cos, sin)
    if dtype == torch.float32:
        assert torch.equal(out, ref)  # elementwise, same roundings
    else:
        torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 16, 37])
@pytest.mark.parametrize("width", [1536, 100])  # 100: a tail of 4 lanes after whole vectors
def test_silu_mul(rows, width, dtype):
    gate_up = randn(rows, 2 * width, dtype=dtype) * 4
    out = OPS.silu_mul(gate_up)
    assert out.shape == (rows, width) and out.dtype == dtype
    torch.testing.assert_close(out, REF.silu_mul(gate_up), **TOL[dtype])
    assert torch.equal(OPS.silu_mul(gate_up[rows - 1 :]), out[rows - 1 :])


# (activations, KV cache): --kv-cache-dtype float16 under float32 or bfloat16 activations, and bfloat16 KV under float32.
MIXED_KV = [(torch.float32, torch.float16), (torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("dtype,kv_dtype", MIXED_KV, ids=lambda t: str(t).removeprefix("torch."))
def test_attention_over_a_16_bit_kv_cache_matches_dense_attention_on_the_rounded_kv(dtype, kv_dtype):
    """K and V rounded once when stored, read back exactly: the dense reference on the rounded K/V."""
    setup = Setup([1, 17, 300], num_heads=9, num_kv_heads=3, head_dim=64)
    parts = [(0, 0, 1), (1, 8, 9), (2, 100, 200)]
    outs, _, _ = run_attention(setup, parts, dtype, kv_dtype=kv_dtype)
    for (r, start, m), out in zip(parts, outs):
        q = setup.q[r][start : start + m].to(dtype).float()
        k, v = (t[r][: start + m].to(kv_dtype).float() for t in (setup.k, setup.v))
        torch.testing.assert_close(
            out.float(), dense_reference(q, k, v, setup.head_dim**-0.5), **attention_tol(dtype, kv_dtype)
        )
        assert out.dtype == dtype


@pytest.mark.parametrize("dtype,kv_dtype", MIXED_KV, ids=lambda t: str(t).removeprefix("torch."))
def test_a_rows_attention_over_a_16_bit_kv_cache_does_not_depend_on_its_batch(dtype, kv_dtype):
    setup = Setup([40, 40], num_heads=6, num_kv_heads=2, head_dim=64)
    solo = run_attention(setup, [(0, 30, 1)], dtype, kv_dtype=kv_dtype)[0][0]
    for parts in ([(1, 0, 40), (0, 30, 1)], [(0, 0, 31)], [(0, 20, 11), (1, 39, 1)]):
        outs = run_attention(setup, parts, dtype, kv_dtype=kv_dtype)[0]
        row = next(out[30 - start] for (r, start, m), out in zip(parts, outs) if r == 0)
        assert torch.equal(row, solo[0]), parts


# ------------------------------------------------------------------ attention in bfloat16 products
# (the AMX tiles, or VDPBF16PS: both take softmax_block's reference max, which moves late)

needs_bf16_attention = pytest.mark.skipif(not BF16_DOTS, reason="no bfloat16 dot products here (AVX512-BF16)")


def spiked_setup(context_lens, num_heads, num_kv_heads, head_dim, spike_at):
    """Queries that share a direction and, at key `spike_at`, a key along it: that key's score is
    ~30 (log2 units) above the rest, so every row that reaches it moves its reference max there
    (the tiles rescale its accumulators) long after its first block set it."""
    setup = Setup(context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seed=5)
    common = torch.randn(head_dim, generator=torch.Generator().manual_seed(6))
    for r, n in enumerate(context_lens):
        setup.q[r] = 2 * setup.q[r] + 2 * common
        if n > spike_at:
            setup.k[r][spike_at] = 1.5 * common
    return setup


@needs_bf16_attention
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 64)])
def test_bfloat16_attention_matches_float64_and_the_tiles_the_vector_kernels(num_heads, num_kv_heads, head_dim):
    """A bfloat16 cache (the AMX tiles where the CPU has them, else VDPBF16PS): prompt chunks at 2.5k
    tokens of context, a decode there and short rows, with a max that moves late; against float64 on
    the same bf16-rounded q, K, V and, on an AMX CPU, against the vector kernels (tiles=False)."""
    kernels = cpu_kernels.load()
    setup = spiked_setup([2500, 40, 3], num_heads, num_kv_heads, head_dim, spike_at=1000)
    parts = [(0, 2400, 100), (1, 0, 40), (0, 999, 1), (2, 0, 3), (0, 2499, 1)]
    outs, full, batch = run_attention(setup, parts, torch.float32, kv_dtype=torch.bfloat16)
    if kernels.attention_on_tiles(head_dim):  # without tiles, tiles=False runs the same VDPBF16PS kernel
        meta = OPS.prepare(batch, BLOCK_SIZE)
        q = torch.zeros(batch.num_padded_tokens, num_heads, head_dim)
        for (r, start, count), s0 in zip(parts, batch.query_starts):
            q[s0 : s0 + count] = setup.q[r][start : start + count]
        k_cache, v_cache = (c.to(torch.bfloat16) for c in (setup.k_cache, setup.v_cache))  # as run_attention wrote them
        vector = kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.query_starts,
            meta.query_lens,
            meta.context_lens,
            meta.block_tables,
            head_dim**-0.5,
            tiles=False,
        )
        torch.testing.assert_close(full, vector, **TOL[torch.bfloat16])
    for (r, start, count), out in zip(parts, outs):
        q_r = setup.q[r][start : start + count].to(torch.bfloat16).double()
        k, v = (t[r][: start + count].to(torch.bfloat16).double() for t in (setup.k, setup.v))
        ref = dense_reference(q_r, k, v, head_dim**-0.5).float()
        torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])


@needs_bf16_attention
def test_a_rows_bits_over_a_bfloat16_cache_do_not_depend_on_its_tile_or_batch():
    """A row's tile (AMX) or work item (VDPBF16PS) may run on past its position (later rows of its
    chunk) and share blocks with rows whose max moves: the row's bits stay its decode's, whatever
    the chunk, batch or threads."""
    setup = spiked_setup([1200, 300], 9, 3, 64, spike_at=700)
    position = 1000
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        solo = run_attention(setup, [(0, position, 1)], kv_dtype=torch.bfloat16)[0][0][0]
        torch.set_num_threads(max(2, threads))
        for parts in ([(0, 990, 64)], [(0, 0, 1200)], [(1, 299, 1), (0, 1000, 5)], [(0, 690, 311), (1, 0, 300)]):
            outs = run_attention(setup, parts, kv_dtype=torch.bfloat16)[0]
            index = [p[0] for p in parts].index(0)
            row = outs[index][position - parts[index][1]]
            assert torch.equal(row, solo), f"layout {parts}: max diff {(row - solo).abs().max()}"
    finally:
        torch.set_num_threads(threads)


def rope_write_four_tokens(ops, qkv, num_heads, num_kv_heads, k_cache, v_cache):
    """qkv_rope_write of qkv's 4 rows at positions 5, 6, 7, 0 into slots 21, 22, 23, 9 (random angles)."""
    angles = torch.arange(64, dtype=torch.float32)[:, None] * torch.rand(32, generator=torch.Generator().manual_seed(3))
    positions, slots = torch.tensor([5, 6, 7, 0]), torch.tensor([21, 22, 23, 9])
    return ops.qkv_rope_write(
        qkv, num_heads, num_kv_heads, None, None, 1e-6, angles.cos(), angles.sin(), positions, slots, k_cache, v_cache
    )


@pytest.mark.parametrize("dtype,kv_dtype", MIXED_KV, ids=lambda t: str(t).removeprefix("torch."))
def test_a_16_bit_kv_cache_stores_what_torch_rounds(dtype, kv_dtype):
    """write_kv and qkv_rope_write round K and V to the cache's dtype exactly as `.to(kv_dtype)` does."""
    k, v = randn(5, 2, 32, dtype=dtype), randn(5, 2, 32, dtype=dtype, seed=1)
    slots = torch.tensor([17, 3, 40, 41, 8])
    caches = [torch.zeros(6, 8, 2, 32, dtype=kv_dtype) for _ in range(4)]
    OPS.write_kv(k, v, caches[0], caches[1], slots)
    REF.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    qkv = randn(4, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=2)
    results = []
    for ops in (OPS, REF):
        k_cache, v_cache = (torch.zeros(6, 8, num_kv_heads, head_dim, dtype=kv_dtype) for _ in range(2))
        q = rope_write_four_tokens(ops, qkv, num_heads, num_kv_heads, k_cache, v_cache)
        results.append((q, k_cache, v_cache))
    (q, kc, vc), (q_ref, kc_ref, vc_ref) = results
    assert kc.dtype == kv_dtype and torch.equal(vc, vc_ref)  # V: one rounding, the same one
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(kc.float(), kc_ref.float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv(dtype):
    k, v = randn(12, 5 * 32, dtype=dtype)[:, :64].view(12, 2, 32), randn(5, 2, 32, dtype=dtype, seed=1)
    k = k[:5]
    slots = torch.tensor([17, 3, 40, 41, 8])
    caches = [torch.zeros(6, 8, 2, 32, dtype=dtype) for _ in range(4)]
    OPS.write_kv(k, v, caches[0], caches[1], slots)
    REF.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_rope_write_matches_the_composed_reference(dtype, qk_norm):
    num_heads, num_kv_heads, head_dim, num_tokens, padded = 9, 3, 64, 7, 8
    qkv = randn(padded, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q_norm = randn(head_dim, dtype=dtype, seed=1) if qk_norm else None
    k_norm = randn(head_dim, dtype=dtype, seed=2) if qk_norm else None
    angles = torch.arange(64, dtype=torch.float32)[:, None] * torch.rand(32, generator=torch.Generator().manual_seed(3))
    cos_table, sin_table = angles.cos(), angles.sin()
    positions = torch.tensor([5, 6, 7, 0, 1, 2, 40, 0])
    slots = torch.tensor([21, 22, 23, 9, 10, 11, 33])  # the first num_tokens rows write K/V; the padded row does not
    assert len(slots) == num_tokens
    results = []
    for ops in (OPS, REF):
        k_cache, v_cache = (
            torch.zeros(6, 8, num_kv_heads, head_dim, dtype=dtype),
            torch.zeros(6, 8, num_kv_heads, head_dim, dtype=dtype),
        )
        q = ops.qkv_rope_write(
            qkv, num_heads, num_kv_heads, q_norm, k_norm, 1e-6, cos_table, sin_table, positions, slots, k_cache, v_cache
        )
        results.append((q, k_cache, v_cache))
    (q, kc, vc), (q_ref, kc_ref, vc_ref) = results
    assert q.shape == (padded, num_heads, head_dim) and q.dtype == dtype
    exact = dtype == torch.float32 and not qk_norm  # RoPE alone is elementwise: same roundings
    check = torch.equal if exact else lambda a, b: torch.testing.assert_close(a, b, **TOL[dtype]) or True
    assert check(q, q_ref) and check(kc, kc_ref)
    assert torch.equal(vc, vc_ref)  # V is copied as is


# ------------------------------------------------------------------ attention: the KV layouts


def d_major(k_cache: torch.Tensor) -> torch.Tensor:
    """The same keys stored d-major (each block [Hkv, D, block_size]), seen in the common shape."""
    return to_key_layout(k_cache, "d_major")


def head_major(v_cache: torch.Tensor) -> torch.Tensor:
    """The same values stored head-major (each block [Hkv, block_size, D]), seen in the common shape."""
    return to_value_layout(v_cache, "d_major")


@pytest.mark.parametrize("block_size", [4, 8, 16, 32, 64])
@pytest.mark.parametrize(
    "dtype,kv_dtype",
    [(torch.float32, None), (torch.bfloat16, None)] + MIXED_KV,
    ids=lambda t: str(t).removeprefix("torch."),
)
def test_d_major_keys_and_head_major_values_give_the_token_major_bits(block_size, dtype, kv_dtype):
    """Where a key group is one d-major run the kernel loads it in place, elsewhere it gathers it;
    a value row is found by the layout's strides: the same values, so the same bits, at every
    block size (in place from 16 keys a block)."""
    gen = torch.Generator().manual_seed(block_size)
    num_heads, num_kv_heads, head_dim, lens = 9, 3, 64, [1, 70, 300, 129]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    kv_dtype = kv_dtype or dtype
    k_cache, v_cache = (
        torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(kv_dtype) for _ in range(2)
    )
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    # A decode, a prefill chunk ending mid-block, a whole prompt, a verify run.
    parts = [(0, 0, 1), (1, 40, 30), (2, 0, 300), (3, 124, 5)]
    slices = [RequestSlice([0] * m, start, tables[r], num_logits=1) for r, start, m in parts]
    batch = RaggedBatch.build(slices, block_size, torch.device("cpu"), row_multiple=4)
    q = torch.randn(batch.num_padded_tokens, num_heads, head_dim, generator=gen).to(dtype)
    metadata = OPS.prepare(batch, block_size)
    token_major = OPS.attention(q, k_cache, v_cache, metadata, head_dim**-0.5)
    assert torch.equal(OPS.attention(q, d_major(k_cache), v_cache, metadata, head_dim**-0.5), token_major)
    assert torch.equal(OPS.attention(q, d_major(k_cache), head_major(v_cache), metadata, head_dim**-0.5), token_major)
    for (r, start, m), s0 in zip(parts, batch.query_starts):  # and it is attention
        slots = [tables[r][p // block_size] * block_size + p % block_size for p in range(start + m)]
        k, v = (c.view(-1, num_kv_heads, head_dim)[slots].float() for c in (k_cache, v_cache))
        ref = dense_reference(q[s0 : s0 + m].float(), k, v, head_dim**-0.5)
        torch.testing.assert_close(token_major[s0 : s0 + m].float(), ref, **attention_tol(dtype, kv_dtype))


def test_a_key_cache_in_neither_layout_is_refused():
    setup = Setup([20])
    batch = RaggedBatch.build([RequestSlice([0], 19, setup.tables[0], 1)], BLOCK_SIZE, torch.device("cpu"))
    transposed = setup.k_cache.transpose(2, 3).contiguous().transpose(2, 3)  # [.., D, Hkv] storage
    with pytest.raises(RuntimeError, match="d-major"):
        OPS.attention(torch.zeros(1, 6, 32), transposed, setup.v_cache, OPS.prepare(batch, BLOCK_SIZE), 1.0)
    with pytest.raises(RuntimeError, match="head-major"):
        OPS.attention(torch.zeros(1, 6, 32), setup.k_cache, transposed, OPS.prepare(batch, BLOCK_SIZE), 1.0)


@pytest.mark.parametrize(
    "dtype,kv_dtype", [(torch.float32, torch.float32)] + MIXED_KV, ids=lambda t: str(t).removeprefix("torch.")
)
def test_the_kv_writes_store_the_same_keys_and_values_in_either_layout(dtype, kv_dtype):
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    k, v = randn(5, num_kv_heads, head_dim, dtype=dtype), randn(5, num_kv_heads, head_dim, dtype=dtype, seed=1)
    slots = torch.tensor([17, 3, 40, 41, 8])
    qkv = randn(4, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=2)
    stored = []
    for key_layout, value_layout in ((lambda c: c, lambda c: c), (d_major, head_major)):
        k_cache, v_cache = (
            key_layout(torch.zeros(6, 16, num_kv_heads, head_dim, dtype=kv_dtype)),
            value_layout(torch.zeros(6, 16, num_kv_heads, head_dim, dtype=kv_dtype)),
        )
        OPS.write_kv(k, v, k_cache, v_cache, slots)
        q = rope_write_four_tokens(OPS, qkv, num_heads, num_kv_heads, k_cache, v_cache)
        stored.append((q, k_cache.contiguous(), v_cache.contiguous()))
    for a, b in zip(*stored):
        assert torch.equal(a, b)
    assert stored[0][1].abs().sum() > 0 and stored[0][2].abs().sum() > 0


# ------------------------------------------------------------------ the whole model


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_the_model_on_cpu_ops_matches_torch_ops(tmp_path, architecture, dtype):
    from executor_svc.kv.kv_cache import KVCache
    from executor_svc.model.transformer import Transformer
    from executor_svc.weights.gguf_file import open_gguf
    from executor_svc.weights.model_config import ModelConfig
    from executor_svc.weights.model_weights import load_weights
    from tests.support.tiny_gguf import TinyModelSpec, qwen3_spec, write_tiny_model

    spec = qwen3_spec() if architecture == "qwen3" else TinyModelSpec("llama")
    gguf = open_gguf(write_tiny_model(tmp_path / "tiny.gguf", spec))
    config = ModelConfig.from_gguf(gguf)
    weights = load_weights(gguf, config, dtype, torch.device("cpu"))
    prompts = [[3, 80, 71, 72, 79, 79, 82, 3, 90, 82, 85, 79, 71, 1, 2, 150, 200, 260, 40], [5, 6, 7], [9] * 37]
    logits = []
    for ops in (REF, OPS):
        model = Transformer(config, weights, torch.device("cpu"), ops=ops, dtype=dtype)
        cache = KVCache(config, 16, 16, dtype, torch.device("cpu"), ops.kv_layout)
        tables = [[] for _ in prompts]
        for table, prompt in zip(tables, prompts):
            cache.grow(table, len(prompt) + 1)
        # A prefill step of every prompt, then one batched decode step.
        step1 = [RequestSlice(p, 0, t, 1) for p, t in zip(prompts, tables)]
        step2 = [RequestSlice([11 + i], len(p), t, 1) for i, (p, t) in enumerate(zip(prompts, tables))]
        out = [
            model.forward(RaggedBatch.build(s, 16, torch.device("cpu"), row_multiple=4), cache) for s in (step1, step2)
        ]
        logits.append(torch.cat(out))
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.1, atol=0.1)
    torch.testing.assert_close(logits[1], logits[0], **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "architecture,tensor_type,matmul",
    [
        ("llama", "Q4_1", "int16"),
        ("llama", "Q4_1", "int8"),
        ("llama", "Q8_0", "exact"),
        ("qwen2", "Q4_0", "int16"),
        ("qwen2", "Q4_0", "int8"),
        ("qwen3", "Q8_0", "int16"),
        ("qwen3", "Q8_0", "int8"),
        ("llama", "Q4_1", "bf16"),
        ("qwen2", "Q4_0", "bf16"),
        ("qwen3", "F16", "bf16"),
        ("qwen3", "F16", "exact"),
    ],
)
def test_the_one_call_layer_stack_gives_the_layer_loops_bits(tmp_path, architecture, tensor_type, matmul, dtype):
    """`CpuLayerStack` (decoder.cpp) runs the layer loop's kernels in C++: its logits and the KV it
    writes are bit-identical to transformer.py's loop, for each matmul kernel, with qwen2's QKV bias and
    qwen3's q/k norms, over a ragged prefill step, a batched decode step, and a step whose last layer
    the stack runs on the logits rows alone: a chunk mid-prompt (no logits), a prompt's last chunk, a
    verify window and a draft tree side by side — and over a step that needs no logits at all."""
    from gguf import GGMLQuantizationType

    from executor_svc.kv.kv_cache import KVCache
    from executor_svc.model.transformer import Transformer
    from executor_svc.weights.gguf_file import open_gguf
    from executor_svc.weights.model_config import ModelConfig
    from executor_svc.weights.model_weights import load_weights
    from executor_svc.weights.weight_format import MATMUL_KERNELS, has_matmul
    from tests.support.tiny_gguf import TinyModelSpec, write_tiny_model

    if not has_matmul(matmul):
        pytest.skip(f"this CPU has no {matmul} matmul")
    spec = TinyModelSpec(
        architecture,
        GGMLQuantizationType[tensor_type],
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=256,
        num_layers=3,
    )
    gguf = open_gguf(write_tiny_model(tmp_path / "tiny.gguf", spec))
    config = ModelConfig.from_gguf(gguf)
    weights = load_weights(gguf, config, dtype, torch.device("cpu"), matmul_kernel=MATMUL_KERNELS.get(matmul))
    model = Transformer(config, weights, torch.device("cpu"), ops=OPS, dtype=dtype)
    stack = model.layer_stack
    assert stack is not None
    prompts = [[3, 80, 71, 72, 79, 79, 82, 3, 90, 82, 85, 79, 71, 1, 2, 150, 200, 40], [5, 6, 7], [9] * 37]
    results = []
    for layer_stack in (None, stack):
        model.layer_stack = layer_stack
        cache = KVCache(config, 16, 16, dtype, torch.device("cpu"), OPS.kv_layout)
        tables = [[] for _ in prompts]
        for table, prompt in zip(tables, prompts):
            cache.grow(table, len(prompt) + 1)
        more = [[] for _ in range(4)]
        for table, n in zip(more, (40, 30, 25, 25)):
            cache.grow(table, n)
        step1 = [RequestSlice(p, 0, t, 1) for p, t in zip(prompts, tables)]
        step2 = [RequestSlice([11 + i], len(p), t, 1) for i, (p, t) in enumerate(zip(prompts, tables))]
        step3 = [  # the first chunk of one prompt and the last of another, a verify of 3 drafts, a tree
            RequestSlice(list(range(20, 36)), 0, more[0], 0),
            RequestSlice(list(range(40, 52)), 12, more[1], 1),
            RequestSlice([7, 8, 9, 10], len(prompts[0]) + 1, tables[0], 4),
            RequestSlice([5, 6, 7, 8, 9], 16, more[2], 5, tree_parents=(-1, 0, 0, 1, 2)),
        ]
        step4 = [RequestSlice(list(range(60, 80)), 0, more[3], 0)]  # no logits: the last layer's K/V only
        batches = [RaggedBatch.build(s, 16, torch.device("cpu")) for s in (step1, step2, step3, step4)]
        if layer_stack is not None:  # the stack's last layer gets the logits rows' attention alone
            trims = [OPS.prepare(b, 16).logits_only for b in batches]
            assert trims[1] is None  # decodes: every row needs logits
            assert [t.query_lens.tolist() for t in (trims[0], trims[2], trims[3])] == [
                [1, 1, 1],  # each prompt's last token
                [1, 4, 1, 1, 1, 1, 1],  # the last chunk's last token, the verify's 4 rows, each tree row
                [],
            ]
            assert trims[2].query_starts.tolist() == [0, 1, 5, 6, 7, 8, 9]
            assert trims[2].context_lens.tolist() == [24, len(prompts[0]) + 5, 17, 18, 18, 19, 19]
        out = [model.forward(b, cache) for b in batches[:3]]
        assert model.forward(batches[3], cache).shape[0] == 0
        results.append((torch.cat(out), cache.tensor.clone()))
    (loop_logits, loop_kv), (stack_logits, stack_kv) = results
    assert torch.equal(stack_logits, loop_logits)
    assert torch.equal(stack_kv, loop_kv)


def test_models_the_layer_stack_does_not_run_keep_the_layer_loop(tmp_path):
    """MoE experts are not in the C++ stack: a qwen3moe model keeps the layer loop, as every
    model does on TorchOps; a dense one on CpuOps gets the stack."""
    from executor_svc.model.transformer import Transformer
    from executor_svc.weights.gguf_file import open_gguf
    from executor_svc.weights.model_config import ModelConfig
    from executor_svc.weights.model_weights import load_weights
    from tests.support.tiny_gguf import TinyModelSpec, write_tiny_model
    from tests.support.tiny_hybrid_gguf import TinyHybridSpec, write_tiny_hybrid_model

    def model(path, ops):
        gguf = open_gguf(path)
        config = ModelConfig.from_gguf(gguf)
        return Transformer(
            config, load_weights(gguf, config, torch.float32, torch.device("cpu")), torch.device("cpu"), ops=ops
        )

    dense = write_tiny_model(tmp_path / "dense.gguf", TinyModelSpec("llama"))
    _, moe = write_tiny_hybrid_model(tmp_path / "moe.gguf", TinyHybridSpec("qwen3moe"))
    assert model(dense, OPS).layer_stack is not None
    assert model(dense, REF).layer_stack is None
    assert model(moe, OPS).layer_stack is None
