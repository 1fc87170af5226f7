"""The KV manager's verbs on a real (tiny) KV cache, without a model: what a request holds after
each verb, what a plan would need, and that the prefix cache finds what was committed."""

from __future__ import annotations

import pytest
import torch

from executor_svc.errors import OutOfKVBlocksError
from executor_svc.kv.block_allocator import root_hash
from executor_svc.kv.kv_cache import KVCache
from executor_svc.kv.kv_manager import KVManager
from tests.executor.kv.test_block_allocator import BLOCK_SIZE, NUM_BLOCKS, TINY

PROMPT = list(range(1, 10))  # 9 tokens: two full blocks of 4, and one token over


def manager(enable_prefix_caching: bool = True) -> KVManager:
    cache = KVCache(TINY, NUM_BLOCKS, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    return KVManager(cache, None, root_hash("tiny"), enable_prefix_caching)


def run_prompt(kv: KVManager, request_id: str, token_ids: list[int]) -> None:
    """What a step computing a whole prompt does with the KV."""
    kv.allocate_slots(request_id, len(token_ids))
    kv.commit(request_id, token_ids, len(token_ids))


def test_a_committed_prompt_is_found_again_up_to_its_last_full_block_before_the_last_token():
    kv = manager()
    run_prompt(kv, "a", PROMPT)
    assert len(kv.block_ids("a")) == 3
    computed = kv.computed_blocks(PROMPT)
    assert computed.block_ids == kv.block_ids("a")[:2]
    # Exactly two full blocks: the last token must still be computed, so only the first block counts.
    assert kv.computed_blocks(PROMPT[:8]).block_ids == kv.block_ids("a")[:1]
    assert kv.computed_blocks([9, *PROMPT[1:]]).block_ids == []  # another first block: another chain


def test_taking_computed_blocks_shares_them_and_free_gives_them_back_cached():
    kv = manager()
    run_prompt(kv, "a", PROMPT)
    free_before = kv.num_free_blocks
    assert kv.take_computed_blocks("b", kv.computed_blocks(PROMPT)) == 2 * BLOCK_SIZE
    assert kv.num_free_blocks == free_before  # shared, not copied
    assert kv.num_exclusive_blocks("a") == 1 and kv.num_exclusive_blocks("b") == 0
    kv.allocate_slots("b", len(PROMPT))
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2] and kv.block_ids("b")[2] != kv.block_ids("a")[2]
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert kv.block_ids("a") == [] and kv.computed_blocks(PROMPT).block_ids  # still cached after both left


def test_commit_rolls_rejected_drafts_back():
    kv = manager()
    kv.allocate_slots("a", 3 + 6)  # 3 tokens and 6 drafts: 3 blocks
    assert len(kv.block_ids("a")) == 3
    kv.commit("a", [1, 2, 3, 4, 5], 5)  # 2 drafts kept
    assert len(kv.block_ids("a")) == 2


def test_blocks_needed_count_hits_on_blocks_a_leaving_request_frees():
    kv = manager()
    run_prompt(kv, "a", PROMPT)
    computed = kv.computed_blocks(PROMPT)
    # "b" reuses a's two full blocks while "a" is released in the same plan: they count as taken
    # from the free pool the release refills, and b needs one block of its own.
    needed = kv.num_blocks_needed({"b": len(PROMPT)}, {"b": computed}, leaving=["a"])
    assert needed == 3
    assert kv.num_blocks_available(["a"]) == kv.num_free_blocks + 3
    # Without the release, the shared blocks are held: only b's own block is new.
    assert kv.num_blocks_needed({"b": len(PROMPT)}, {"b": computed}, leaving=[]) == 1
    # A running request growing past its blocks.
    assert kv.num_blocks_needed({"a": len(PROMPT) + 4}, {}, leaving=[]) == 1


def test_without_prefix_caching_nothing_is_found_and_nothing_is_registered():
    kv = manager(enable_prefix_caching=False)
    run_prompt(kv, "a", PROMPT)
    kv.free("a")
    assert kv.computed_blocks(PROMPT).block_ids == []
    assert kv.cache.allocator.num_cached_blocks == 0


def test_scratch_gives_everything_back_and_declines_what_does_not_fit():
    kv = manager()
    with kv.scratch(2, 10) as held:
        assert [len(block_ids) for block_ids, _ in held] == [3, 3]
        assert kv.num_free_blocks == kv.num_usable_blocks - 6
    assert kv.num_free_blocks == kv.num_usable_blocks
    with kv.scratch(1, NUM_BLOCKS * BLOCK_SIZE) as held:
        assert held is None


def test_allocation_beyond_the_cache_raises_and_frees_nothing_held():
    kv = manager()
    run_prompt(kv, "a", PROMPT)
    with pytest.raises(OutOfKVBlocksError):
        kv.allocate_slots("a", NUM_BLOCKS * BLOCK_SIZE)
    assert len(kv.block_ids("a")) == 3


@pytest.mark.parametrize("kv_layout", ["token_major", "d_major"])
def test_moving_tokens_copies_every_layers_keys_and_values_in_either_kv_layout(kv_layout):
    cache = KVCache(TINY, NUM_BLOCKS, BLOCK_SIZE, torch.float32, torch.device("cpu"), kv_layout)
    cache.tensor.normal_(generator=torch.Generator().manual_seed(0))
    kv = KVManager(cache, None, root_hash("tiny"), True)
    kv.allocate_slots("a", 11)
    blocks = kv.block_ids("a")
    before = [(k.clone(), v.clone()) for k, v in cache.layers]
    kv.move_tokens("a", [6, 9, 10], [5, 6, 7])  # a kept tree path, moved down (one source is also a target)
    slot = lambda p: (blocks[p // BLOCK_SIZE], p % BLOCK_SIZE)  # noqa: E731
    for (k, v), (k0, v0) in zip(cache.layers, before):
        for src, dst in ((6, 5), (9, 6), (10, 7)):
            assert torch.equal(k[slot(dst)], k0[slot(src)]) and torch.equal(v[slot(dst)], v0[slot(src)])
        assert torch.equal(k[slot(4)], k0[slot(4)]) and torch.equal(v[slot(8)], v0[slot(8)])  # the rest untouched
