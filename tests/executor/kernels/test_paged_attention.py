"""The Triton paged attention against the torch reference, and its batch invariance, under the interpreter."""

from __future__ import annotations

import math
import os
import random

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.kernels.paged_attention import build_attention_metadata, paged_attention  # noqa: E402
from executor_svc.kernels.triton_ops import TritonOps  # noqa: E402
from executor_svc.model.attention import write_kv as torch_write_kv  # noqa: E402
from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice  # noqa: E402
from executor_svc.model.torch_ops import TorchOps  # noqa: E402

BLOCK_SIZE = 16
# Small tiles keep the interpreter quick and give long requests many tiles of each kind.
SMALL_TILES = dict(query_tile_tokens=4, kv_tile_keys=16)
# Half precision: the kernel rounds probabilities to the input dtype before P·V (as flash attention
# does); bfloat16 also meets the interpreter's truncating float32 → bfloat16 cast of the output.
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


class PagedKV:
    """A cache holding a few requests' full KV histories in shuffled blocks, garbage in the free ones."""

    def __init__(self, context_lens, num_heads=6, num_kv_heads=2, head_dim=64, dtype=torch.float32, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = num_heads, num_kv_heads, head_dim, dtype
        num_blocks = 1 + sum(math.ceil(n / BLOCK_SIZE) for n in context_lens) + 2
        # [num_blocks, block_size, num_kv_heads, head_dim]
        self.k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
        self.v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
        self.k_cache[0] = 0  # the null block
        self.v_cache[0] = 0
        free = list(range(1, num_blocks))
        random.Random(seed).shuffle(free)
        self.tables = []
        for n in context_lens:
            table = [free.pop() for _ in range(math.ceil(n / BLOCK_SIZE))]
            self.tables.append(table)
            history = RaggedBatch.build([RequestSlice([0] * n, 0, table, 0)], BLOCK_SIZE, torch.device("cpu"))
            k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
            torch_write_kv(k, v, self.k_cache, self.v_cache, history.slot_mapping)
        self.q = {}  # (request, position) -> [num_heads, head_dim], fixed per position
        self.gen = gen

    def query(self, r, position):
        if (r, position) not in self.q:
            self.q[r, position] = torch.randn(self.num_heads, self.head_dim, generator=self.gen).to(self.dtype)
        return self.q[r, position]

    def batch(self, parts, row_multiple=1):
        """parts: (request, first position, number of query tokens) → (batch, q)."""
        slices = [RequestSlice([0] * m, start, self.tables[r], num_logits=1) for r, start, m in parts]
        batch = RaggedBatch.build(slices, BLOCK_SIZE, torch.device("cpu"), row_multiple=row_multiple)
        # [num_padded_tokens, num_heads, head_dim]; padding rows hold garbage that must not matter
        q = torch.randn(batch.num_padded_tokens, self.num_heads, self.head_dim, generator=self.gen).to(self.dtype)
        for (r, start, m), s0 in zip(parts, batch.query_starts):
            for j in range(m):
                q[s0 + j] = self.query(r, start + j)
        return batch, q

    def run(self, ops, parts, row_multiple=1):
        batch, q = self.batch(parts, row_multiple)
        metadata = ops.prepare(batch, BLOCK_SIZE)
        out = ops.attention(q, self.k_cache, self.v_cache, metadata, self.head_dim**-0.5)
        return batch, out


def assert_matches_reference(kv, parts, ops=None, row_multiple=1):
    ops = ops or TritonOps(**SMALL_TILES)
    batch, out = kv.run(ops, parts, row_multiple)
    _, ref = kv.run(TorchOps(), parts, row_multiple)  # the same q: query() remembers each position's row
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **TOLERANCES[kv.dtype])
    assert torch.count_nonzero(out[batch.num_tokens :]) == 0, "padding rows must be zeros"


# Context lengths 1, 16 (one full block), 33, 70, 150; the parts hit every edge of the issue.
MIXED_CONTEXTS = [1, 16, 33, 70, 150]
MIXED_PARTS = [
    (0, 0, 1),  # a one-token prompt: empty KV, query length 1
    (1, 15, 1),  # decode ending exactly on a block boundary
    (2, 14, 5),  # a verify run crossing a block boundary
    (3, 0, 70),  # a whole prefill from empty KV, many query tiles
    (4, 120, 30),  # a prefill chunk on top of cached KV
    (2, 32, 1),  # request 2 again, decoding at 32: the KV is only read here, so two slices may share a table
]


@pytest.mark.slow
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (8, 1)], ids=["gqa1", "gqa3", "gqa8"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch_matches_torch_float32(num_heads, num_kv_heads, head_dim):
    kv = PagedKV(MIXED_CONTEXTS, num_heads, num_kv_heads, head_dim, torch.float32)
    assert_matches_reference(kv, MIXED_PARTS, row_multiple=8)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_matches_torch(dtype):
    kv = PagedKV(MIXED_CONTEXTS, 6, 2, 64, dtype)
    assert_matches_reference(kv, MIXED_PARTS, row_multiple=4)


def test_default_tile_sizes_match_torch():
    """The configuration the GPU runs (16-token query tiles, 64-key KV tiles)."""
    kv = PagedKV([200, 40, 17], 6, 2, 64)
    assert_matches_reference(kv, [(0, 150, 50), (1, 39, 1), (2, 12, 5)], ops=TritonOps(), row_multiple=8)


def test_head_dim_not_a_power_of_two():
    kv = PagedKV([40, 9], 4, 2, 80)
    assert_matches_reference(kv, [(0, 30, 10), (1, 8, 1)])


def test_many_requests_of_very_different_lengths():
    contexts = [1, 2, 5, 16, 17, 31, 32, 48, 64, 100, 129, 3]
    kv = PagedKV(contexts, 3, 1, 64, seed=3)
    parts = [(r, n - m, m) for r, (n, m) in enumerate(zip(contexts, [1, 2, 5, 1, 17, 3, 32, 1, 4, 60, 1, 3]))]
    assert_matches_reference(kv, parts, row_multiple=16)


def test_only_padding_beyond_the_real_rows_is_zeroed():
    kv = PagedKV([20], 4, 4, 64)
    batch, out = kv.run(TritonOps(**SMALL_TILES), [(0, 17, 3)], row_multiple=16)
    assert batch.num_padded_tokens == 16
    assert torch.count_nonzero(out[3:]) == 0
    assert torch.all(out[:3].abs().sum(-1) > 0)


@pytest.mark.slow
def test_a_rows_result_does_not_depend_on_the_batch_around_it():
    """Bit for bit: the row at position 100 of request 0, alone and in very different batches."""
    kv = PagedKV([130, 50, 70, 9, 120], 6, 2, 64, seed=1)
    ops = TritonOps(**SMALL_TILES)
    target, position = 0, 100

    def row_of(parts):
        batch, out = kv.run(ops, parts, row_multiple=8)
        index = [p[0] for p in parts].index(target)
        _, start, _ = parts[index]
        return out[batch.query_starts[index] + position - start]

    solo = row_of([(target, position, 1)])
    layouts = [
        [(target, 97, 4)],  # the last row of a verify run
        [(target, 90, 11)],  # mid prefill chunk, several query tiles
        [(target, 64, 40)],  # a chunk starting on a tile boundary
        [(target, 0, 130)],  # the whole prompt at once
        [(1, 49, 1), (target, 98, 5), (2, 40, 30), (3, 0, 9)],
        [(4, 119, 1), (2, 69, 1), (target, 100, 1), (1, 10, 40)],
        [(3, 8, 1), (4, 0, 120), (target, 99, 2)],
    ]
    for parts in layouts:
        row = row_of(parts)
        assert torch.equal(row, solo), f"layout {parts}: max diff {(row - solo).abs().max()}"


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 80), st.integers(1, 24)),  # (context length, query length)
        min_size=1,
        max_size=5,
    ),
    st.sampled_from([(4, 4), (6, 2), (8, 1)]),
)
def test_random_ragged_batches_match_torch(requests, heads):
    contexts = [n for n, _ in requests]
    kv = PagedKV(contexts, *heads, head_dim=64, seed=len(requests))
    parts = [(r, n - min(m, n), min(m, n)) for r, (n, m) in enumerate(requests)]
    assert_matches_reference(kv, parts, row_multiple=4)


def test_metadata_cuts_requests_into_tiles():
    slices = [
        RequestSlice([0] * 1, 10, [1], 1),
        RequestSlice([0] * 37, 0, [2, 3, 4], 1),
        RequestSlice([0] * 4, 30, [5, 6, 7], 1),
    ]
    batch = RaggedBatch.build(slices, BLOCK_SIZE, torch.device("cpu"), row_multiple=8)
    metadata = build_attention_metadata(batch, BLOCK_SIZE, query_tile_tokens=16)
    assert metadata.tile_requests.tolist() == [0, 1, 1, 1, 2]
    assert metadata.tile_row_starts.tolist() == [0, 1, 17, 33, 38]
    assert metadata.tile_num_rows.tolist() == [1, 16, 16, 5, 4]
    assert metadata.tile_first_positions.tolist() == [10, 0, 16, 32, 30]
    assert (metadata.num_tokens, metadata.num_padded_tokens) == (42, 48)


def test_wrapper_rejects_bad_arguments():
    kv = PagedKV([20], 4, 2, 64)
    batch, q = kv.batch([(0, 19, 1)])
    metadata = TritonOps().prepare(batch, BLOCK_SIZE)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(q.half(), kv.k_cache, kv.v_cache, metadata, 0.125)
    with pytest.raises(ValueError, match="stride"):
        paged_attention(q.transpose(1, 2).contiguous().transpose(1, 2), kv.k_cache, kv.v_cache, metadata, 0.125)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q[:, :3], kv.k_cache, kv.v_cache, metadata, 0.125)
    with pytest.raises(ValueError, match="rows"):
        paged_attention(torch.cat([q, q]), kv.k_cache, kv.v_cache, metadata, 0.125)
    with pytest.raises(ValueError, match="power of two"):
        TritonOps(kv_tile_keys=24)
