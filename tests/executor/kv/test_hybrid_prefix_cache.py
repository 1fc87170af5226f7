"""Prefix caching on hybrid models (Qwen3.5): an agent's next turn resumes from the recurrent-state
snapshot at the last block boundary its previous turn reached (in the prompt or in its output),
and gets the tokens it gets without the cache: greedy and seeded, alone and batched, chunked,
with speculation, after preemption. Snapshots are the bits of the state stepped to the boundary;
one whose prefix lost its KV is never used; a full snapshot pool means no hit, never an error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from executor_svc.engine.engine import Engine, EngineConfig, ScheduledRequest, StepRequest
from executor_svc.engine.request_state import NewRequest
from executor_svc.kv.recurrent_state import RecurrentStatePool
from executor_svc.kv.state_snapshots import StateSnapshots
from executor_svc.model import hybrid_model
from service_common.sampling_params import SamplingParams
from tests.support.engine_driver import ScriptedDrafter, drive
from tests.support.tiny_hybrid_gguf import TinyHybridSpec, write_tiny_hybrid_model

BLOCK = 16
BASE = [3, 80, 71, 72, 79, 79, 82, 3, 90, 82, 85, 79, 71, 1, 2, 150, 200, 260, 40, 41, 42, 7, 9, 11, 13]


def prompt(agent: int, length: int = 37) -> list[int]:
    rotated = BASE[agent % len(BASE) :] + BASE[: agent % len(BASE)]
    return [(t + 17 * agent) % 260 for t in (rotated * 4)[:length]]


def greedy(request_id: str, token_ids: list[int], num_new_tokens: int, **sampling) -> NewRequest:
    return NewRequest(request_id, token_ids, SamplingParams(**sampling), num_new_tokens, ignore_eos=True)


def last_boundary(num_computed_tokens: int) -> int:
    return num_computed_tokens // BLOCK * BLOCK


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_hybrid_model(tmp_path_factory.mktemp("models") / "qwen35.gguf", TinyHybridSpec("qwen35"))[1]


def make_engine(path, **overrides) -> Engine:
    config = dict(model=str(path), kv_cache_bytes=4 << 20, kernels="torch", num_state_slots=8)
    return Engine(EngineConfig(**{**config, **overrides}))


def two_turns(engine: Engine, agent: int, num_turn1_tokens: int, chunk_size=None, draft_budget=0, **sampling):
    """(turn 1's tokens, turn 2's tokens, turn 2's cached tokens); turn 2 = turn 1's prompt + its output + 3 tokens."""
    p1 = prompt(agent)
    t1 = drive(engine, [greedy(f"a{agent}t1", p1, num_turn1_tokens, **sampling)], chunk_size, draft_budget=draft_budget)
    p2 = p1 + t1.tokens[f"a{agent}t1"] + [5, 6, 7]
    t2 = drive(engine, [greedy(f"a{agent}t2", p2, 12, **sampling)], chunk_size, draft_budget=draft_budget)
    return t1.tokens[f"a{agent}t1"], t2.tokens[f"a{agent}t2"], t2.cached_tokens[f"a{agent}t2"]


@pytest.fixture(scope="module")
def uncached(model_path):
    return make_engine(model_path, enable_prefix_caching=False)


# ------------------------------------------------------------------ next turns


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [None, 5, 16])
@pytest.mark.parametrize("num_turn1_tokens", [3, 20])  # the last boundary in the prompt's last chunk / in the output
def test_the_next_turn_resumes_at_the_last_boundary_with_the_same_tokens(
    model_path, uncached, chunk_size, num_turn1_tokens
):
    engine = make_engine(model_path)
    out1, out2, cached = two_turns(engine, 0, num_turn1_tokens, chunk_size)
    assert (out1, out2) == two_turns(uncached, 0, num_turn1_tokens, chunk_size)[:2]
    # KV holds prompt + output but the last sampled token.
    assert cached == last_boundary(37 + num_turn1_tokens - 1) > 0
    assert engine.kv.state_pool.num_free_slots == engine.kv.state_pool.num_slots


@pytest.mark.slow
@pytest.mark.parametrize(
    "prompt_len,batch_invariant,by_window",
    [
        (37, True, True),  # the boundary (32) inside the chunk: the state before a capture window starting there
        (33, True, False),  # the boundary on the chunk's last row: replayed
        (100, False, False),  # a chunked-form prefill (96 ≥ 64 tokens): replayed in the recurrent form, so only close
    ],
)
def test_snapshots_are_the_state_stepped_to_the_boundary(
    model_path, prompt_len, batch_invariant, by_window, monkeypatch
):
    """A capture inside a prefill chunk writes the state a step ending on the boundary leaves."""
    captured, stepped = (make_engine(model_path, batch_invariant=batch_invariant) for _ in range(2))
    token_ids = prompt(1, prompt_len)
    boundary = last_boundary(prompt_len - 1)
    plans = []
    build = hybrid_model.CapturePlan.build
    monkeypatch.setattr(hybrid_model.CapturePlan, "build", lambda *a: plans.append(build(*a)) or plans[-1])
    drive(captured, [greedy("c", token_ids, 1)])  # one chunk: the capture is inside it
    assert [(bool(p.window_rows), p.replay is not None) for p in plans if p is not None] == [(by_window, not by_window)]
    drive(
        stepped, [greedy("s", token_ids[: boundary + 1], 1)], chunk_size=boundary
    )  # a step ends on it: the slot is copied
    snapshots = []
    for engine in (captured, stepped):
        block_hash = engine.kv._extend_hashes(token_ids, [], boundary // BLOCK)[-1]
        entry = engine.kv.snapshots.lookup(block_hash)
        assert entry is not None
        row = engine.kv.state_pool.snapshot_row(entry)
        snapshots.append([t[row] for t in engine.kv.state_pool.conv + engine.kv.state_pool.recurrent])
    same = torch.equal if batch_invariant else lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    assert all(same(a, b) for a, b in zip(*snapshots))
    assert all(t.abs().sum() > 0 for t in snapshots[0])


@pytest.mark.slow
def test_batched_agents_resume_with_the_same_tokens(model_path, uncached):
    """Six agents' second turns arrive while others prefill and decode, in chunks of 5."""

    def run(engine):
        first = [greedy(f"a{i}t1", prompt(i, 30 + 3 * i), 10 + i) for i in range(6)]
        t1 = drive(engine, first, chunk_size=5, arrival_steps={r.request_id: 2 * i for i, r in enumerate(first)})
        second = [
            greedy(f"a{i}t2", r.prompt_token_ids + t1.tokens[r.request_id] + [9, i], 8) for i, r in enumerate(first)
        ]
        fresh = [greedy(f"f{i}", prompt(10 + i), 8) for i in range(2)]
        t2 = drive(
            engine, second + fresh, chunk_size=5, arrival_steps={r.request_id: i for i, r in enumerate(second + fresh)}
        )
        return t1, t2

    engine = make_engine(model_path)
    (t1, t2), (u1, u2) = run(engine), run(uncached)
    assert t1.tokens == u1.tokens and t2.tokens == u2.tokens
    assert t2.max_batch_size >= 4
    for i in range(6):
        assert t2.cached_tokens[f"a{i}t2"] == last_boundary(30 + 3 * i + 10 + i - 1)
    assert t2.cached_tokens["f0"] == t2.cached_tokens["f1"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "partial", "none"])
def test_snapshots_taken_inside_verify_windows_resume_with_the_same_tokens(model_path, uncached, mode, monkeypatch):
    """Decoding with drafts crosses boundaries inside verify windows: their states are replayed from the window."""
    expected = two_turns(uncached, 2, 25)
    turns = {"a2t1": expected[0], "a2t2": expected[1]}
    engine = make_engine(model_path)
    engine.drafter = ScriptedDrafter(turns, mode, engine.model_config.vocab_size)
    saved_in_windows = []
    save_window = RecurrentStatePool.save_window
    monkeypatch.setattr(
        RecurrentStatePool, "save_window", lambda self, *a: saved_in_windows.append(a) or save_window(self, *a)
    )
    assert two_turns(engine, 2, 25, chunk_size=7, draft_budget=4) == (*expected[:2], last_boundary(37 + 25 - 1))
    if mode != "none":  # without kept drafts every step ends on its one token
        assert saved_in_windows


def test_a_request_that_stops_on_an_accepted_draft_snapshots_the_state_at_its_stop(model_path, uncached):
    """Its last step keeps drafts past the stop token: the slot is put back to the stop token's state
    before a boundary there is snapshotted (37 prompt tokens + 11 outputs = 48)."""
    agent = next(a for a in range(11, 40) if (out := two_turns(uncached, a, 16)[0])[10] not in out[:10])
    full = drive(uncached, [greedy("u", prompt(agent), 16)]).tokens["u"]
    stop = full[10]
    request = NewRequest("s1", prompt(agent), SamplingParams(), 16, ignore_eos=True, stop_token_ids=frozenset({stop}))
    engine = make_engine(model_path)
    engine.drafter = ScriptedDrafter({"s1": full}, "full", engine.model_config.vocab_size)
    run = drive(engine, [request], draft_budget=3)  # outputs 9..12 in one step: 10 is a kept draft
    assert run.tokens["s1"] == full[:11]
    second = greedy("s2", prompt(agent) + full[:11] + [5, 6, 7], 8)
    hit = drive(engine, [second])
    assert hit.cached_tokens["s2"] == 48
    assert hit.tokens["s2"] == drive(uncached, [second]).tokens["s2"]


def test_seeded_sampling_gives_the_same_tokens_with_a_prefix_hit(model_path, uncached):
    engine = make_engine(model_path)
    hit = two_turns(engine, 3, 18, chunk_size=6, temperature=1.5, seed=11)
    assert hit[2] == last_boundary(37 + 18 - 1)
    assert hit[:2] == two_turns(uncached, 3, 18, chunk_size=6, temperature=1.5, seed=11)[:2]


def test_a_preempted_request_resumes_from_its_own_snapshot(model_path, uncached):
    request = greedy("p", prompt(4), 30)
    expected = drive(uncached, [request]).tokens["p"]
    engine = make_engine(model_path)
    out = engine.step(StepRequest(new_requests=[request], scheduled=[ScheduledRequest("p", 37)])).outputs[0]
    tokens = list(out.new_token_ids)
    while out.num_computed_tokens < 53:  # decoding passes boundary 48
        out = engine.step(StepRequest(scheduled=[ScheduledRequest("p", 1)])).outputs[0]
        tokens += out.new_token_ids
    num_known = 37 + len(tokens)
    out = engine.step(StepRequest(preempted=["p"], scheduled=[ScheduledRequest("p", num_known)])).outputs[0]
    assert out.num_cached_tokens == 48
    tokens += out.new_token_ids
    while out.finish_reason is None:
        out = engine.step(StepRequest(scheduled=[ScheduledRequest("p", 1)])).outputs[0]
        tokens += out.new_token_ids
    assert tokens == expected
    assert engine.kv.state_pool.num_free_slots == engine.kv.state_pool.num_slots


# ------------------------------------------------------------------ eviction and limits


def test_a_full_snapshot_pool_reuses_the_oldest_and_the_next_turn_just_misses(model_path, uncached):
    engine = make_engine(model_path, num_state_snapshots=1)
    p_a, p_b = prompt(5), prompt(6)
    out_a = drive(engine, [greedy("a1", p_a, 4)]).tokens["a1"]
    out_b = drive(engine, [greedy("b1", p_b, 4)]).tokens["b1"]  # takes the only snapshot
    a2, b2 = greedy("a2", p_a + out_a + [1], 6), greedy("b2", p_b + out_b + [1], 6)
    run_a, run_b = drive(engine, [a2]), drive(engine, [b2])
    assert run_a.cached_tokens["a2"] == 0 and run_b.cached_tokens["b2"] == 0  # a2's own prompt took the snapshot
    assert run_a.tokens["a2"] == drive(uncached, [a2]).tokens["a2"]
    assert run_b.tokens["b2"] == drive(uncached, [b2]).tokens["b2"]


def test_more_captures_in_one_step_than_snapshots_is_no_error(model_path, uncached):
    """Four prompts each capture their last boundary in the same step, with room for one snapshot:
    one is kept, the others are simply not, and every next turn gets the uncached tokens."""
    engine = make_engine(model_path, num_state_snapshots=1)
    firsts = [greedy(f"q{i}", prompt(20 + i), 2) for i in range(4)]
    run = drive(engine, firsts)
    assert run.max_batch_size == 4 and engine.kv.snapshots.num_published == 1
    assert engine.kv.snapshots.num_reserved == 0
    seconds = [greedy(f"q{i}b", r.prompt_token_ids + run.tokens[r.request_id] + [1], 4) for i, r in enumerate(firsts)]
    hits = drive(engine, seconds)
    assert sorted(hits.cached_tokens.values()) == [0, 0, 0, 32]
    assert hits.tokens == drive(uncached, seconds).tokens


def test_a_snapshot_whose_blocks_were_evicted_is_never_used(model_path, uncached):
    probe = make_engine(model_path)
    per_row, per_block = probe.kv.state_pool.bytes_per_slot, probe.kv.cache.tensor[:, :, 0].numel() * 4
    engine = make_engine(model_path, kv_cache_bytes=16 * per_row + 8 * per_block, num_state_snapshots=8)
    assert engine.kv.num_usable_blocks == 7
    p1 = prompt(7)
    out1 = drive(engine, [greedy("a1", p1, 4)]).tokens["a1"]
    hashes = engine.kv._extend_hashes(p1 + out1, [], 2)
    assert engine.kv.snapshots.lookup(hashes[1]) is not None
    pressure = [(11 * i) % 260 for i in range(7 * BLOCK - 1)]
    drive(engine, [greedy("big", pressure, 1)])  # needs every block: the first turn's are evicted
    assert engine.kv._allocator.lookup(hashes[0]) is None and engine.kv.snapshots.lookup(hashes[1]) is not None
    a2 = greedy("a2", p1 + out1 + [1], 6)
    run = drive(engine, [a2])
    assert run.cached_tokens["a2"] == 0
    assert run.tokens["a2"] == drive(uncached, [a2]).tokens["a2"]


def test_without_snapshots_a_hybrid_caches_nothing(model_path, uncached):
    engine = make_engine(model_path, num_state_snapshots=0)
    assert not engine.kv.caches_prefixes
    assert two_turns(engine, 8, 20) == (*two_turns(uncached, 8, 20)[:2], 0)


def test_snapshots_come_out_of_the_kv_budget(model_path):
    none, some = make_engine(model_path, num_state_snapshots=0), make_engine(model_path, num_state_snapshots=32)
    per_row = none.kv.state_pool.bytes_per_slot
    per_block = none.kv.cache.tensor[:, :, 0].numel() * 4
    assert none.kv.num_usable_blocks - some.kv.num_usable_blocks == pytest.approx(32 * per_row / per_block, abs=1)
    # The default: one per slot while they fit in a quarter of what the slots leave.
    assert make_engine(model_path).kv.state_pool.num_snapshots == 8
    tight = make_engine(model_path, kv_cache_bytes=8 * per_row + 64 * per_block)
    assert tight.kv.state_pool.num_snapshots == 64 * per_block // 4 // per_row
    assert make_engine(model_path, enable_prefix_caching=False).kv.state_pool.num_snapshots == 0
    with pytest.raises(ValueError, match="snapshots"):
        make_engine(model_path, kv_cache_bytes=20 * per_row, num_state_snapshots=12)


# ------------------------------------------------------------------ the snapshot index


def test_victims_are_stale_then_superseded_then_least_recently_used():
    snapshots = StateSnapshots(3)
    entries = {h: snapshots.reserve(lambda _: False) for h in (b"a", b"b", b"c")}
    for h, e in entries.items():
        assert snapshots.lookup(h) is None  # reserved: being written
        assert snapshots.publish(e, h)
    snapshots.touch(b"a")  # LRU order: b, c, a
    assert snapshots.reserve(lambda h: h == b"c") == entries[b"c"]  # stale first
    snapshots.discard(entries[b"c"])
    assert snapshots.reserve(lambda _: True) == entries[b"c"]  # a free entry before any published one
    snapshots.supersede(b"a")
    assert snapshots.reserve(lambda _: False) == entries[b"a"]  # then superseded
    assert snapshots.lookup(b"a") is None
    assert snapshots.reserve(lambda _: False) == entries[b"b"]  # then the least recently used
    assert snapshots.reserve(lambda _: False) is None  # every entry is being written: no capture
    assert snapshots.publish(entries[b"b"], b"x")
    assert not snapshots.publish(entries[b"a"], b"x")  # the same prefix twice: the second entry is freed
    assert snapshots.num_published == 1 and snapshots.num_reserved == 1
    with pytest.raises(ValueError, match="not reserved"):
        snapshots.discard(entries[b"a"])
    assert StateSnapshots(0).reserve(lambda _: True) is None


class SnapshotIndexMachine(RuleBasedStateMachine):
    """Random reserve / publish / discard / touch / supersede: entries are never lost or doubled."""

    def __init__(self):
        super().__init__()
        self.snapshots = StateSnapshots(4)
        self.reserved: set[int] = set()
        self.published: dict[bytes, int] = {}

    @rule(stale=st.sets(st.sampled_from([b"p", b"q", b"r", b"s", b"t"])))
    def reserve(self, stale):
        entry = self.snapshots.reserve(lambda h: h in stale)
        if entry is None:
            assert len(self.reserved) == 4
            return
        assert entry not in self.reserved
        self.reserved.add(entry)
        evicted = [h for h, e in self.published.items() if e == entry]
        for h in evicted:
            del self.published[h]

    @rule(h=st.sampled_from([b"p", b"q", b"r", b"s", b"t"]), data=st.data())
    def publish_or_discard(self, h, data):
        if not self.reserved:
            return
        entry = data.draw(st.sampled_from(sorted(self.reserved)))
        self.reserved.remove(entry)
        if data.draw(st.booleans()):
            if self.snapshots.publish(entry, h):
                self.published[h] = entry
            else:
                assert h in self.published
        else:
            self.snapshots.discard(entry)

    @rule(h=st.sampled_from([b"p", b"q", b"r", b"s", b"t"]), supersede=st.booleans())
    def touch(self, h, supersede):
        (self.snapshots.supersede if supersede else self.snapshots.touch)(h)

    @invariant()
    def entries_are_accounted_for(self):
        for h in (b"p", b"q", b"r", b"s", b"t"):
            assert self.snapshots.lookup(h) == self.published.get(h)
        entries = list(self.published.values()) + list(self.reserved)
        assert len(set(entries)) == len(entries) <= 4
        assert self.snapshots.num_reserved == len(self.reserved)


SnapshotIndexMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_the_snapshot_index_never_loses_or_doubles_an_entry = SnapshotIndexMachine.TestCase


# ------------------------------------------------------------------ services


@pytest.mark.e2e
def test_an_agent_session_over_the_real_services_resumes_its_next_turns_from_cache(model_path, uncached):
    """Three turns of one agent through the scheduler and executor on loopback gRPC, with the SDK
    client: each next turn is counted as cached up to the last boundary of the turn before, and
    its tokens are those an executor without a prefix cache gives. GetInfo reports the snapshots."""
    import asyncio

    import grpc

    from clients import AsyncSwarmClient
    from executor_svc.server import serve as serve_executor
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.server import serve as serve_scheduler
    from swarmserve.executor.v1 import executor_pb2, executor_pb2_grpc
    from tests.support.stack import free_port, stop_scheduler

    engine = make_engine(model_path)

    async def main():
        executor_address = f"127.0.0.1:{free_port()}"
        executor = await serve_executor(engine, executor_address)
        try:
            async with grpc.aio.insecure_channel(executor_address) as channel:
                info = await executor_pb2_grpc.ExecutorServiceStub(channel).GetInfo(
                    executor_pb2.GetInfoRequest(), timeout=10
                )
            config = SchedulerConfig(listen=f"127.0.0.1:{free_port()}", executor=executor_address)
            server, loop, tasks = await serve_scheduler(config)
            try:
                await loop.wait_connected(5)
                turns, token_ids = [], prompt(9, 40)
                async with AsyncSwarmClient(config.listen) as client:
                    for turn in range(3):
                        completion = await client.complete(
                            token_ids=token_ids,
                            max_new_tokens=10 + 4 * turn,
                            ignore_eos=True,
                            temperature=0.0,
                            session_id="agent",
                            retention_s=30.0,
                        )
                        turns.append((list(token_ids), list(completion.token_ids), completion.usage.cached_tokens))
                        token_ids = token_ids + list(completion.token_ids) + [20 + turn, 21]
            finally:
                await stop_scheduler(server, loop, tasks)
            return info, turns
        finally:
            await executor.stop(None)

    info, turns = asyncio.run(main())
    assert info.num_state_snapshots == engine.kv.state_pool.num_snapshots > 0
    previous_computed = 0
    for i, (token_ids, output, cached) in enumerate(turns):
        expected = drive(uncached, [greedy(f"e{i}", token_ids, len(output))]).tokens[f"e{i}"]
        assert output == expected, i
        assert cached == last_boundary(previous_computed), i
        previous_computed = len(token_ids) + len(output) - 1
    assert turns[1][2] > 0 and turns[2][2] > turns[1][2]
