"""Tree attention: every row of a draft tree gets, bit for bit, what a decode of its
path gets (the torch reference and the C++ kernel), whatever else is in the step."""

from __future__ import annotations

import math
import random
from functools import partial

import pytest
import torch

from executor_svc.kv.kv_cache import to_key_layout
from executor_svc.model.attention import build_attention_plan, paged_attention, write_kv
from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice, tree_paths
from service_common.attention_pairs import attention_pairs

BLOCK_SIZE = 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 32
SCALE = HEAD_DIM**-0.5
CPU = torch.device("cpu")

#            row 0 (the last token)
#           /      \
#        1           2
#      /   \         |
#     3     4        5
#     |              |
#     6              7
PARENTS = (-1, 0, 0, 1, 1, 2, 3, 5)


def torch_attention(batch, q, k_cache, v_cache):
    return paged_attention(q, k_cache, v_cache, build_attention_plan(batch, BLOCK_SIZE), SCALE)


def cpu_attention(batch, q, k_cache, v_cache):
    cpu_kernels = pytest.importorskip("executor_svc.cpu_kernels")
    try:
        from executor_svc.model.cpu_ops import CpuOps

        ops = CpuOps()
    except cpu_kernels.CpuKernelsUnavailable as exc:
        pytest.skip(str(exc))
    return ops.attention(q, k_cache, v_cache, ops.prepare(batch, BLOCK_SIZE), SCALE)


def cpu_attention_over_d_major_keys(batch, q, k_cache, v_cache, kv_dtype=torch.float32):
    """The C++ kernel over the same keys stored d-major (KVCache's layout for it), in kv_dtype."""
    return cpu_attention(batch, q, to_key_layout(k_cache.to(kv_dtype), "d_major"), v_cache.to(kv_dtype))


BACKENDS = {
    "torch": torch_attention,
    "cpu": cpu_attention,
    "cpu_d_major": cpu_attention_over_d_major_keys,
    # bfloat16 dot products where the CPU has them (q and probabilities rounded; see layer_ops.cpp)
    "cpu_d_major_bf16": partial(cpu_attention_over_d_major_keys, kv_dtype=torch.bfloat16),
}


class Cache:
    """A paged cache whose blocks are handed out in a shuffled order, stale data in the rest."""

    def __init__(self, num_blocks=64, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.k = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=self.gen)
        self.v = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=self.gen)
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)

    def table(self, num_tokens):
        return [self.free.pop() for _ in range(math.ceil(num_tokens / BLOCK_SIZE))]

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen)

    def write(self, table, first_position, k, v):
        slots = torch.tensor(
            [
                table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                for p in range(first_position, first_position + len(k))
            ],
            dtype=torch.int64,
        )
        write_kv(k, v, self.k, self.v, slots)


def run(attend, cache, slices, queries):
    batch = RaggedBatch.build(slices, BLOCK_SIZE, CPU, row_multiple=4)
    q = torch.zeros(batch.num_padded_tokens, NUM_HEADS, HEAD_DIM)
    for q_rows, s0 in zip(queries, batch.query_starts):
        q[s0 : s0 + len(q_rows)] = q_rows
    out = attend(batch, q, cache.k, cache.v)
    return [out[s0 : s0 + n] for s0, n in zip(batch.query_starts, batch.query_lens)], batch


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("num_context_tokens", [1, 15, 16, 40, 70])
def test_each_tree_row_gets_a_decode_of_its_path_bit_for_bit(backend, num_context_tokens):
    check_tree_rows_get_their_decodes_bits(BACKENDS[backend], num_context_tokens)


def check_tree_rows_get_their_decodes_bits(attend, num_context_tokens):
    """Also run on the Triton kernel (tests/executor/kernels/test_tree_paged_attention.py)."""
    cache = Cache()
    start, m = num_context_tokens - 1, len(PARENTS)  # row 0 is the last context token, computed this step
    context_k, context_v = cache.randn(start, NUM_KV_HEADS, HEAD_DIM), cache.randn(start, NUM_KV_HEADS, HEAD_DIM)
    tree_k, tree_v = cache.randn(m, NUM_KV_HEADS, HEAD_DIM), cache.randn(m, NUM_KV_HEADS, HEAD_DIM)
    tree_q = cache.randn(m, NUM_HEADS, HEAD_DIM)

    tree_table = cache.table(start + m)
    cache.write(tree_table, 0, context_k, context_v)
    tree_slice = RequestSlice([0] * m, start, tree_table, num_logits=m, tree_parents=PARENTS)
    # Another request in the same step: a prefill chunk, whose rows are not a tree.
    other_table = cache.table(30)
    cache.write(other_table, 0, cache.randn(10, NUM_KV_HEADS, HEAD_DIM), cache.randn(10, NUM_KV_HEADS, HEAD_DIM))
    other_slice = RequestSlice([0] * 20, 10, other_table, num_logits=1)
    other_q = cache.randn(20, NUM_HEADS, HEAD_DIM)
    # The step writes its rows' K/V into their slots first, as the model does.
    cache.write(tree_table, start, tree_k, tree_v)
    cache.write(other_table, 10, cache.randn(20, NUM_KV_HEADS, HEAD_DIM), cache.randn(20, NUM_KV_HEADS, HEAD_DIM))

    (_, tree_out), batch = run(attend, cache, [other_slice, tree_slice], [other_q, tree_q])
    assert batch.positions[batch.query_starts[1] :][:m].tolist() == [start + len(p) - 1 for p in tree_paths(PARENTS)]
    alone, _ = run(attend, cache, [tree_slice], [tree_q])
    assert torch.equal(alone[0], tree_out)  # batch-invariant

    for row, path in enumerate(tree_paths(PARENTS)):
        # Decoding the path: its tokens' K/V at consecutive positions, this row's query at the last.
        decode_table = cache.table(start + len(path))
        cache.write(decode_table, 0, context_k, context_v)
        cache.write(decode_table, start, tree_k[path], tree_v[path])
        position = start + len(path) - 1
        decoded, _ = run(
            attend, cache, [RequestSlice([0], position, decode_table, num_logits=1)], [tree_q[row : row + 1]]
        )
        assert torch.equal(decoded[0][0], tree_out[row]), f"row {row}: {(decoded[0][0] - tree_out[row]).abs().max()}"


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_chain_as_a_tree_gives_the_verify_runs_bits(backend):
    check_a_chain_as_a_tree_gives_the_verify_runs_bits(BACKENDS[backend])


def check_a_chain_as_a_tree_gives_the_verify_runs_bits(attend):
    cache = Cache(seed=1)
    table = cache.table(48)
    cache.write(table, 0, cache.randn(48, NUM_KV_HEADS, HEAD_DIM), cache.randn(48, NUM_KV_HEADS, HEAD_DIM))
    q = cache.randn(6, NUM_HEADS, HEAD_DIM)
    chain = RequestSlice([0] * 6, 40, table, num_logits=6)
    as_tree = RequestSlice([0] * 6, 40, table, num_logits=6, tree_parents=(-1, 0, 1, 2, 3, 4))
    (chain_out,), _ = run(attend, cache, [chain], [q])
    (tree_out,), _ = run(attend, cache, [as_tree], [q])
    assert torch.equal(chain_out, tree_out)


def test_malformed_tree_slices_are_refused():
    with pytest.raises(ValueError, match="parent"):
        RequestSlice([0, 0], 3, [1], num_logits=2, tree_parents=(-1, 1))
    with pytest.raises(ValueError, match="every row"):
        RequestSlice([0, 0], 3, [1], num_logits=1, tree_parents=(-1, 0))
    with pytest.raises(ValueError, match="hybrid"):
        RequestSlice([0, 0], 3, [1], num_logits=2, state_slot=0, tree_parents=(-1, 0))


def test_a_batch_counts_the_keys_its_rows_attend():
    """The step's attention pairs, as the scheduler's cost model counts them: a chunk's rows attend
    the context and the rows before them, a tree row its context and its ancestors."""
    chunk = RequestSlice([0] * 4, 40, list(range(3)), num_logits=1)  # rows at 40..43: 41 + 42 + 43 + 44
    decode = RequestSlice([0], 7, [3], num_logits=1)  # 8 keys
    tree = RequestSlice([0] * 4, 16, [4, 5], num_logits=4, tree_parents=(-1, 0, 0, 1))  # depths 0, 1, 1, 2
    batch = RaggedBatch.build([chunk, decode, tree], BLOCK_SIZE, CPU)
    assert batch.num_attention_pairs == (41 + 42 + 43 + 44) + 8 + (17 + 18 + 18 + 19)
    assert batch.num_attention_pairs == attention_pairs(40, 4) + attention_pairs(7, 1) + 17 + 18 + 18 + 19
