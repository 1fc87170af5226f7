"""The Triton paged attention on draft trees, under the interpreter: each tree row gets
the bits a decode of its path gets from the same kernel, whatever else is in the step."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.kernels.triton_ops import TritonOps  # noqa: E402
from tests.executor.model.test_tree_attention import (  # noqa: E402
    BLOCK_SIZE,
    SCALE,
    check_a_chain_as_a_tree_gives_the_verify_runs_bits,
    check_tree_rows_get_their_decodes_bits,
)

# Small tiles: long verify runs span several query tiles, contexts several KV tiles.
OPS = TritonOps(query_tile_tokens=4, kv_tile_keys=16)


def triton_attention(batch, q, k_cache, v_cache):
    return OPS.attention(q, k_cache, v_cache, OPS.prepare(batch, BLOCK_SIZE), SCALE)


@pytest.mark.parametrize("num_context_tokens", [1, 16, 40])
def test_each_tree_row_gets_a_decode_of_its_path_bit_for_bit(num_context_tokens):
    check_tree_rows_get_their_decodes_bits(triton_attention, num_context_tokens)


def test_a_chain_as_a_tree_gives_the_verify_runs_bits():
    check_a_chain_as_a_tree_gives_the_verify_runs_bits(triton_attention)


def test_no_tree_no_window_arguments():
    from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice

    batch = RaggedBatch.build([RequestSlice([0, 0], 3, [1], num_logits=1)], BLOCK_SIZE, torch.device("cpu"))
    metadata = OPS.prepare(batch, BLOCK_SIZE)
    assert metadata.tile_window_starts is None and metadata.tile_window_positions is None
