"""Prefix caching: reused KV gives the same tokens as recomputed KV, reference counts never
free a block in use or leak one, and retained session blocks are evicted last."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from executor_svc.engine.engine import Engine, EngineConfig
from executor_svc.engine.request_state import NewRequest
from executor_svc.errors import OutOfKVBlocksError
from executor_svc.kv.block_allocator import BlockAllocator, block_hash, root_hash
from service_common.sampling_params import SamplingParams
from tests.support.engine_driver import drive
from tests.support.prompts import CODE

BLOCK = 16

# ----------------------------------------------------------- engine equivalence


@pytest.fixture(scope="module")
def engine_without_cache():
    return Engine(EngineConfig(kv_cache_bytes=256 << 20, enable_prefix_caching=False))


def test_cached_prefixes_give_the_tokens_of_recomputed_ones(engine_fp32, engine_without_cache):
    tok = engine_fp32.tokenizer.tokenizer
    # A text no other test sends to the shared engine, so nothing of it is cached yet.
    base = tok.encode("# prefix-cache test 7f3a\n" + CODE * 2, add_special_tokens=False).ids
    other = tok.encode(
        "Meanwhile, in a completely different file, the tests were failing again.", add_special_tokens=False
    ).ids
    assert len(base) >= 70 and len(other) >= 12
    cases = {
        "first": (base[:70], 0),  # nothing cached yet
        "part-of-a-block": (base[:40] + other, 32),  # shares 2.5 blocks: 2 reused
        "block-boundary": (base[:48] + other, 48),  # shares exactly 3 blocks
        "whole-prompt": (base[:70], 64),  # all 4 full blocks cached (70 = 4 blocks + 6)
        "whole-prompt-on-a-boundary": (base[:64], 48),  # the last token's block is recomputed
    }
    cached = {}
    tokens = {}
    for name, (prompt, _) in cases.items():
        request = NewRequest(name, prompt, SamplingParams(num_logprobs=0), 24, ignore_eos=True)
        run = drive(engine_fp32, [request], chunk_size=20)
        tokens[name] = run.tokens[name]
        cached[name] = run.num_cached
    for name, (prompt, expected_cached) in cases.items():
        reference = drive(engine_without_cache, [NewRequest(name, prompt, SamplingParams(), 24, ignore_eos=True)])
        assert tokens[name] == reference.tokens[name], name
        assert cached[name] == expected_cached, (name, cached[name])


@pytest.mark.slow
def test_cache_off_reuses_nothing(engine_without_cache):
    prompt = list(range(300, 340))
    for i in range(2):
        run = drive(engine_without_cache, [NewRequest(f"x{i}", prompt, SamplingParams(), 4, ignore_eos=True)])
        assert run.num_cached == 0


def test_a_preempted_request_resumes_from_its_cached_blocks(engine_fp32):
    from executor_svc.engine.engine import ScheduledRequest, StepRequest

    prompt = list(range(1000, 1050))
    engine_fp32.add_request(NewRequest("p", prompt, SamplingParams(), 30, ignore_eos=True))
    out = engine_fp32.step(StepRequest(scheduled=[ScheduledRequest("p", 50)]))
    for _ in range(20):
        out = engine_fp32.step(StepRequest(scheduled=[ScheduledRequest("p", 1)]))
    engine_fp32.step(StepRequest(preempted=["p"]))
    state = engine_fp32.get_request("p")
    out = engine_fp32.step(StepRequest(scheduled=[ScheduledRequest("p", len(state.token_ids))]))
    # 70 known tokens: 4 full blocks were cached before the preemption and come back.
    assert out.outputs[0].num_cached_tokens == 64
    engine_fp32.release("p")


# ------------------------------------------------------------- retention order


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def cached_block(allocator, parent, tokens, retain_until=None):
    (block,) = allocator.allocate(1)
    h = block_hash(parent, tokens)
    assert allocator.register(block, h)
    allocator.free([block], retain_until)
    return block, h


def test_eviction_prefers_unretained_then_expired_then_the_earliest_deadline():
    clock = FakeClock()
    allocator = BlockAllocator(6, clock)  # 5 usable
    root = root_hash("m")
    plain, _ = cached_block(allocator, root, [1])
    long_session, _ = cached_block(allocator, root, [2], retain_until=clock.now + 60)
    short_session, _ = cached_block(allocator, root, [3], retain_until=clock.now + 1)
    other_plain, _ = cached_block(allocator, root, [4])
    assert allocator.num_free_blocks == 5
    allocator.allocate(1)  # the never-used block goes first
    assert allocator.num_cached_blocks == 4
    # Unretained blocks go first, least recently used first.
    assert allocator.allocate(1) == [plain]
    assert allocator.allocate(1) == [other_plain]
    clock.now += 2  # the short session's hint expires
    assert allocator.allocate(1) == [short_session]
    assert allocator.allocate(1) == [long_session]  # only a retained one is left: it goes too
    with pytest.raises(OutOfKVBlocksError):
        allocator.allocate(1)


def test_the_retention_heap_stays_the_size_of_the_retained_blocks():
    """Issue 12, item 8: a session's blocks reused and released turn after turn left one
    stale heap entry per block per release, never popped while deadlines were far off."""
    clock = FakeClock()
    allocator = BlockAllocator(6, clock)
    block, _ = cached_block(allocator, root_hash("m"), [1], retain_until=clock.now + 600)
    for turn in range(10_000):
        allocator.share(block)  # the session's next turn takes its cached block back ...
        allocator.free([block], clock.now + 600)  # ... and retains it again when done
    assert len(allocator._retained_heap) <= 2 * 1 + 64 + 1
    # Compaction keeps eviction order: the retained block is still evicted last, by deadline.
    assert allocator.allocate(5)[-1] == block


def test_a_cached_block_reused_before_eviction_is_not_evicted():
    allocator = BlockAllocator(3)
    root = root_hash("m")
    block, h = cached_block(allocator, root, [7])
    assert allocator.lookup(h) == block
    allocator.share(block)  # a new request reuses it: off the eviction list
    other = allocator.allocate(1)
    assert other != [block]
    with pytest.raises(OutOfKVBlocksError):
        allocator.allocate(1)
    assert allocator.lookup(h) == block and allocator.ref_count(block) == 1


# ---------------------------------------------------- reference-count property


DOCS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9], [7, 7, 7, 7, 7, 7]]  # token "blocks" of 1 token each


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests made of 1-token blocks from shared documents, run against the real allocator."""

    def __init__(self):
        super().__init__()
        self.clock = FakeClock()
        self.allocator = BlockAllocator(10, self.clock)
        self.root = root_hash("m")
        self.live: dict[int, list[tuple[int, bytes]]] = {}  # request -> [(block, hash of its content)]
        self.next_id = 0

    def chain(self, tokens):
        hashes, parent = [], self.root
        for t in tokens:
            parent = block_hash(parent, [t])
            hashes.append(parent)
        return hashes

    @rule(doc=st.integers(0, len(DOCS) - 1), length=st.integers(1, 6))
    def start_request(self, doc, length):
        hashes = self.chain(DOCS[doc][:length])
        hits = []
        for h in hashes:
            block = self.allocator.lookup(h)
            if block is None:
                break
            hits.append(block)
        need = len(hashes) - len(hits) + sum(1 for b in set(hits) if self.allocator.is_evictable(b))
        if need > self.allocator.num_free_blocks:
            return
        for b in hits:
            self.allocator.share(b)
        fresh = self.allocator.allocate(len(hashes) - len(hits))
        blocks = hits + fresh
        for b, h in zip(fresh, hashes[len(hits) :]):
            self.allocator.register(b, h)  # may decline a duplicate: then b stays private
        self.live[self.next_id] = list(zip(blocks, hashes))
        self.next_id += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data(), retain=st.sampled_from([None, 1.0, 50.0]))
    def end_request(self, data, retain):
        request = data.draw(st.sampled_from(sorted(self.live)))
        blocks = [b for b, _ in self.live.pop(request)]
        self.allocator.free(blocks, None if retain is None else self.clock.now + retain)

    @rule(dt=st.floats(0.0, 10.0))
    def time_passes(self, dt):
        self.clock.now += dt

    @rule(n=st.integers(1, 4))
    def memory_pressure(self, n):
        if n <= self.allocator.num_free_blocks:
            self.allocator.free(self.allocator.allocate(n))

    @invariant()
    def blocks_in_use_are_intact_and_counted(self):
        holders = Counter(b for blocks in self.live.values() for b, _ in blocks)
        for block in range(1, 10):
            assert self.allocator.ref_count(block) == holders.get(block, 0)
        # A block in use is never evicted: its cached content is still what its holders computed.
        for blocks in self.live.values():
            for b, h in blocks:
                if self.allocator.is_cached(b):
                    assert self.allocator.lookup(h) == b
        assert self.allocator.num_free_blocks == self.allocator.num_usable_blocks - len(holders)

    def teardown(self):
        for blocks in self.live.values():
            self.allocator.free([b for b, _ in blocks])
        assert self.allocator.num_free_blocks == self.allocator.num_usable_blocks


TestPrefixCacheRefCounts = PrefixCacheMachine.TestCase
TestPrefixCacheRefCounts.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
