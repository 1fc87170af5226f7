"""KV block bookkeeping (the real KVCache block-table operations): no block leaked or shared by
mistake after any sequence of append / truncate / free / preempt (property-tested with hypothesis)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from executor_svc.errors import OutOfKVBlocksError
from executor_svc.kv.block_allocator import NULL_BLOCK_ID, BlockAllocator
from executor_svc.kv.kv_cache import KVCache
from executor_svc.weights.model_config import ModelConfig

BLOCK_SIZE = 4
NUM_BLOCKS = 24


TINY = ModelConfig(
    architecture="llama",
    name="tiny",
    num_layers=1,
    hidden_size=8,
    intermediate_size=16,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    vocab_size=10,
    context_length=64,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    rope_linear_factor=1.0,
    has_qkv_bias=False,
    has_qk_norm=False,
    has_rope_freq_factors=False,
    tie_word_embeddings=True,
)


def tiny_cache() -> KVCache:
    return KVCache(TINY, NUM_BLOCKS, BLOCK_SIZE, torch.float32, torch.device("cpu"))


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tables = tiny_cache()
        self.requests: dict[int, tuple[list[int], int]] = {}  # id -> (block ids, tokens held)
        self.next_id = 0

    @rule(num_tokens=st.integers(1, 40))
    def add_and_append(self, num_tokens):
        blocks: list[int] = []
        free_before = self.tables.allocator.num_free_blocks
        try:
            self.tables.grow(blocks, num_tokens)
        except OutOfKVBlocksError:
            assert blocks == [] and self.tables.allocator.num_free_blocks == free_before
            return
        self.requests[self.next_id] = (blocks, num_tokens)
        self.next_id += 1

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), extra=st.integers(1, 20))
    def append(self, data, extra):
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        blocks, tokens = self.requests[request_id]
        before = list(blocks)
        try:
            self.tables.grow(blocks, tokens + extra)
        except OutOfKVBlocksError:
            assert blocks == before  # all or nothing
            return
        assert blocks[: len(before)] == before
        self.requests[request_id] = (blocks, tokens + extra)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def truncate(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        blocks, tokens = self.requests[request_id]
        keep = data.draw(st.integers(0, tokens))
        self.tables.truncate(blocks, keep)
        assert len(blocks) == math.ceil(keep / BLOCK_SIZE)
        self.requests[request_id] = (blocks, keep)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        # A preemption frees the KV like a release; the request may come back and regrow.
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        blocks, tokens = self.requests.pop(request_id)
        self.tables.release(blocks)
        assert blocks == []
        if preempt:
            regrown: list[int] = []
            try:
                self.tables.grow(regrown, tokens)
            except OutOfKVBlocksError:
                return
            self.requests[request_id] = (regrown, tokens)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def share_prefix(self, data):
        # A new request shares the full blocks of an existing one (prefix sharing).
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        blocks, tokens = self.requests[request_id]
        full = tokens // BLOCK_SIZE
        shared = blocks[:full]
        for block_id in shared:
            self.tables.allocator.share(block_id)
        self.requests[self.next_id] = (list(shared), full * BLOCK_SIZE)
        self.next_id += 1

    @invariant()
    def counts_match_holders(self):
        allocator = self.tables.allocator
        holders = Counter(b for blocks, _ in self.requests.values() for b in blocks)
        for block_id in range(1, NUM_BLOCKS):
            assert allocator.ref_count(block_id) == holders.get(block_id, 0)
        assert NULL_BLOCK_ID not in holders
        assert allocator.num_free_blocks == allocator.num_usable_blocks - len(holders)
        free = list(allocator._free)
        assert len(free) == len(set(free)) and not set(free) & set(holders)

    @invariant()
    def tables_fit_their_tokens(self):
        for blocks, tokens in self.requests.values():
            assert len(blocks) == math.ceil(tokens / BLOCK_SIZE)
            assert len(set(blocks)) == len(blocks)

    def teardown(self):
        for blocks, _ in self.requests.values():
            self.tables.allocator.free(blocks)
        assert self.tables.allocator.num_free_blocks == self.tables.allocator.num_usable_blocks


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_freeing_a_free_block_or_the_null_block_is_an_error():
    allocator = BlockAllocator(4)
    (block,) = allocator.allocate(1)
    allocator.free([block])
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free([block])
    with pytest.raises(ValueError, match="not an allocatable block"):
        allocator.free([NULL_BLOCK_ID])


def test_allocation_beyond_capacity_is_all_or_nothing():
    allocator = BlockAllocator(4)
    with pytest.raises(OutOfKVBlocksError, match="need 4 KV blocks, only 3 free"):
        allocator.allocate(4)
    assert allocator.num_free_blocks == 3
