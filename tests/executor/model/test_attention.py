"""The torch paged attention: correct against dense attention, and batch-invariant bit for bit."""

from __future__ import annotations

import math
import random

import pytest
import torch

from executor_svc.model.attention import build_attention_plan, paged_attention, write_kv
from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice

BLOCK_SIZE = 16


def dense_reference(q, k, v, scale):
    """q [M, H, D] at the last M positions of k/v [N, Hkv, D]; plain causal softmax attention."""
    m, num_heads, _ = q.shape
    n, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("mhd,nhd->hmn", q.double(), k) * scale
    positions = torch.arange(n - m, n)[:, None]
    scores = scores.masked_fill(torch.arange(n)[None, :] > positions, float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(scores, -1), v).float()


class Setup:
    """A cache with a few requests' full KV histories written into scattered blocks."""

    def __init__(self, context_lens, num_heads=6, num_kv_heads=2, head_dim=32, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        num_blocks = 1 + sum(math.ceil(n / BLOCK_SIZE) for n in context_lens) + 3
        self.k_cache = torch.zeros(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        self.v_cache = torch.zeros_like(self.k_cache)
        free = list(range(1, num_blocks))
        random.Random(seed).shuffle(free)
        self.tables, self.k, self.v, self.q = [], [], [], []
        for n in context_lens:
            table = [free.pop() for _ in range(math.ceil(n / BLOCK_SIZE))]
            self.tables.append(table)
            self.k.append(torch.randn(n, num_kv_heads, head_dim, generator=gen))
            self.v.append(torch.randn(n, num_kv_heads, head_dim, generator=gen))
            self.q.append(torch.randn(n, num_heads, head_dim, generator=gen))
        # Stale garbage in the free blocks must never leak into a result.
        for b in free:
            self.k_cache[b].normal_(generator=gen)
            self.v_cache[b].normal_(generator=gen)

    def run(self, parts, row_multiple=4):
        """parts: (request index, first position, number of query tokens); returns each part's output."""
        slices = []
        for r, start, m in parts:
            slices.append(RequestSlice([0] * m, start, self.tables[r], num_logits=1))
        batch = RaggedBatch.build(slices, BLOCK_SIZE, torch.device("cpu"), row_multiple=row_multiple)
        q = torch.zeros(batch.num_padded_tokens, self.num_heads, self.head_dim)
        for (r, start, m), s0 in zip(parts, batch.query_starts):
            q[s0 : s0 + m] = self.q[r][start : start + m]
            slots = batch.slot_mapping[s0 : s0 + m]
            write_kv(self.k[r][start : start + m], self.v[r][start : start + m], self.k_cache, self.v_cache, slots)
        # Earlier positions of every part were "computed in earlier steps".
        for r, start, m in parts:
            hist = (
                RaggedBatch.build([RequestSlice([0] * start, 0, self.tables[r], 0)], BLOCK_SIZE, torch.device("cpu"))
                if start
                else None
            )
            if hist is not None:
                write_kv(self.k[r][:start], self.v[r][:start], self.k_cache, self.v_cache, hist.slot_mapping)
        plan = build_attention_plan(batch, BLOCK_SIZE)
        out = paged_attention(q, self.k_cache, self.v_cache, plan, scale=self.head_dim**-0.5)
        return [out[s0 : s0 + m] for (_, _, m), s0 in zip(parts, batch.query_starts)]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_matches_dense_attention(num_heads, num_kv_heads):
    lens = [1, 15, 16, 17, 40, 300]
    setup = Setup(lens, num_heads=num_heads, num_kv_heads=num_kv_heads)
    # Mixed batch: whole prefill, a chunk ending on a block boundary, decode, verify run, long chunk.
    parts = [(0, 0, 1), (1, 0, 15), (2, 8, 8), (3, 16, 1), (4, 35, 5), (5, 100, 200)]
    outs = setup.run(parts)
    for (r, start, m), out in zip(parts, outs):
        ref = dense_reference(
            setup.q[r][start : start + m], setup.k[r][: start + m], setup.v[r][: start + m], setup.head_dim**-0.5
        )
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_the_batch_around_it():
    lens = [700, 50, 260, 9, 513]
    setup = Setup(lens)
    target = 0
    position = 600  # the query row under test: request 0, position 600
    solo = setup.run([(target, position, 1)])[0][0]
    layouts = [
        # As part of prefill chunks of different lengths.
        [(target, 597, 4)],
        [(target, 590, 11)],
        [(target, 580, 64)],
        [(target, 500, 200)],
        # As a verify run, with other requests of very different lengths around it.
        [(1, 49, 1), (target, 598, 5), (2, 200, 60), (3, 0, 9)],
        [(4, 512, 1), (2, 259, 1), (target, 600, 1), (1, 10, 40)],
        [(3, 8, 1), (4, 0, 513), (target, 599, 2)],
    ]
    for parts in layouts:
        outs = setup.run(parts)
        index = [p[0] for p in parts].index(target)
        r, start, m = parts[index]
        row = outs[index][position - start]
        assert torch.equal(row, solo), f"layout {parts}: max diff {(row - solo).abs().max()}"


def test_context_ending_exactly_on_a_block_boundary_and_a_single_token_context():
    setup = Setup([16, 1, 32])
    outs = setup.run([(0, 15, 1), (1, 0, 1), (2, 0, 32)])
    for (r, m), out in zip([(0, 1), (1, 1), (2, 32)], outs):
        n = setup.k[r].shape[0]
        ref = dense_reference(setup.q[r][n - m : n], setup.k[r], setup.v[r], setup.head_dim**-0.5)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
