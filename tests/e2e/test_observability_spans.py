"""Spans from a real request through both real servers, run in this process with an
in-memory exporter: the request spans, the step spans linked to them, the executor's
step span as the child of the scheduler's (propagated over gRPC metadata) with its
prepare / forward / sample children, and attributes that match the step history."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from clients import AsyncSwarmClient
from executor_svc.engine.engine import Engine, EngineConfig
from executor_svc.observability.step_interceptor import executor_interceptors
from executor_svc.server import serve as serve_executor
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.server import serve as serve_scheduler
from scheduler_svc.telemetry import Telemetry, draft_event_attributes
from service_common.observability.tracing import TracingConfig, build_tracer_provider
from tests.support.stack import free_port
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_model

PROMPTS = {
    "obs-a": ("the cat sat on the mat, the cat sat", 6),
    "obs-b": ("in the beginning", 9),
    "obs-c": ("a b a b a b", 4),
    # Copies that differ in one token: the context "x +" was followed three ways, so trees branch.
    "obs-d": ("f(x) = x + 1; f(x) = x + 2; f(x) = x + 3; f(x) = x +", 6),
}


def _attrs(span) -> dict:
    return dict(span.attributes or {})


@pytest.fixture(scope="module", params=["chain", "tree"])
def traced_run(tmp_path_factory, request):
    """Both servers in-process, each with its own provider feeding one in-memory exporter; the
    executor drafting chains, then trees (--draft-shape)."""
    model = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny.gguf", TinyModelSpec(context_length=256))
    engine = Engine(EngineConfig(model=str(model), kv_cache_bytes=8 << 20, draft_shape=request.param))
    exporter = InMemorySpanExporter()
    providers = [
        build_tracer_provider(TracingConfig(service_name=name), SimpleSpanProcessor(exporter))
        for name in ("swarmserve-executor", "swarmserve-scheduler")
    ]

    async def main():
        executor_address = f"127.0.0.1:{free_port()}"
        executor = await serve_executor(engine, executor_address, tracer=providers[0].get_tracer("test"))
        config = SchedulerConfig(listen=f"127.0.0.1:{free_port()}", executor=executor_address, spec="fixed:4")
        scheduler, loop, tasks = await serve_scheduler(config, tracer=providers[1].get_tracer("test"))
        try:
            async with AsyncSwarmClient(config.listen) as client:
                completions = await asyncio.gather(
                    *(
                        client.complete(prompt, max_new_tokens=n, temperature=0.0, ignore_eos=True, request_id=rid)
                        for rid, (prompt, n) in PROMPTS.items()
                    )
                )
            for _ in range(100):  # the request spans end as the Generate handlers return
                if sum(s.name == "request" for s in exporter.get_finished_spans()) == len(PROMPTS):
                    break
                await asyncio.sleep(0.05)
            return completions, list(loop.history)
        finally:
            await scheduler.stop(None)
            for task in tasks:
                task.cancel()
            await loop.link.close()
            await executor.stop(None)

    completions, history = asyncio.run(main())
    spans = exporter.get_finished_spans()
    yield completions, history, spans
    for provider in providers:
        provider.shutdown()


def test_request_spans_carry_usage(traced_run):
    completions, _, spans = traced_run
    requests = {_attrs(s)["swarmserve.request_id"]: s for s in spans if s.name == "request"}
    assert set(requests) == set(PROMPTS)
    for completion in completions:
        span = requests[completion.request_id]
        a = _attrs(span)
        assert span.kind == SpanKind.SERVER
        assert span.resource.attributes["service.name"] == "swarmserve-scheduler"
        assert span.parent is None
        assert a["swarmserve.num_prompt_tokens"] == completion.usage.prompt_tokens
        assert a["swarmserve.num_completion_tokens"] == len(completion.token_ids) == PROMPTS[completion.request_id][1]
        assert a["swarmserve.num_cached_tokens"] == completion.usage.cached_tokens
        assert a["swarmserve.finish_reason"] == "length"
        assert a["swarmserve.queue_time_s"] == pytest.approx(completion.usage.queue_time_s, abs=1e-6)
        assert a["swarmserve.ttft_s"] == pytest.approx(completion.usage.ttft_s, abs=1e-6)
        assert 0 <= a["swarmserve.queue_time_s"] <= a["swarmserve.ttft_s"]
        assert a["swarmserve.draft_tokens.accepted"] == completion.usage.accepted_tokens
        assert [e.name for e in span.events] == ["scheduled", "first_token"]
        assert span.start_time <= span.events[0].timestamp <= span.events[1].timestamp <= span.end_time


def test_step_spans_match_history_and_link_their_requests(traced_run):
    _, history, spans = traced_run
    request_spans = {s.context.span_id: s for s in spans if s.name == "request"}
    steps = {_attrs(s)["swarmserve.step_id"]: s for s in spans if s.name == "step"}
    assert sorted(steps) == [r.step_id for r in history]
    linked = set()
    for record in history:
        span = steps[record.step_id]
        a = _attrs(span)
        assert span.kind == SpanKind.CLIENT and span.parent is None
        assert a["swarmserve.batch_size"] == record.num_requests == len(span.links)
        assert a["swarmserve.num_prefill_tokens"] == record.num_prefill_tokens
        assert a["swarmserve.num_decode_tokens"] == record.num_decode_tokens
        assert a["swarmserve.draft_tokens.allocated"] == record.num_draft_tokens
        assert a["swarmserve.draft_tokens.drafted"] == record.num_drafted_tokens
        assert a["swarmserve.draft_tokens.accepted"] == record.num_accepted_tokens <= record.num_drafted_tokens
        assert a["swarmserve.free_token_budget"] == record.num_free_tokens
        assert a["swarmserve.step_time.predicted_s"] == record.predicted_step_s > 0
        assert a["swarmserve.step_time.actual_s"] == record.wall_s >= a["swarmserve.step_time.executor_s"] > 0
        assert a["swarmserve.kv_blocks.free"] == record.num_free_kv_blocks
        served = {request_spans[link.context.span_id] for link in span.links}
        assert {_attrs(r)["swarmserve.request_id"] for r in served} == set(record.request_ids)
        for link in span.links:
            assert link.context.trace_id == request_spans[link.context.span_id].context.trace_id
        linked |= {r.context.span_id for r in served}
    assert linked == set(request_spans)
    assert sum(r.num_draft_tokens for r in history) > 0  # fixed:4 speculated: the draft attributes were exercised


def test_step_spans_carry_each_requests_draft_shape(traced_run, request):
    """Per step, the drafts' depth and leaves (summed) on the step span, and per request that
    drafted a `draft` event: nodes, depth, leaves and accepted length, as the timeline has them."""
    _, history, spans = traced_run
    steps = {_attrs(s)["swarmserve.step_id"]: s for s in spans if s.name == "step"}
    drafting = []
    for record in history:
        span = steps[record.step_id]
        a = _attrs(span)
        assert a["swarmserve.draft_tree.depth"] == record.draft_depth == sum(q.draft_depth for q in record.requests)
        assert a["swarmserve.draft_tree.leaves"] == record.num_draft_leaves
        drafted = [q for q in record.requests if q.num_drafted_tokens]
        events = [dict(e.attributes) for e in span.events if e.name == "draft"]
        assert events == [draft_event_attributes(q) for q in drafted]
        for q, event in zip(drafted, events):
            assert event["swarmserve.request_id"] == q.request_id
            assert event["swarmserve.draft_tree.nodes"] == q.num_drafted_tokens
            assert q.num_accepted_tokens <= q.draft_depth <= q.num_drafted_tokens
            assert 1 <= q.num_draft_leaves <= q.num_drafted_tokens
        drafting += drafted
    assert drafting, "nothing was drafted: the test tested nothing"
    if request.node.callspec.params["traced_run"] == "chain":
        assert all(q.draft_depth == q.num_drafted_tokens for q in drafting)  # a chain's depth is its length
    else:
        assert any(q.draft_depth < q.num_drafted_tokens for q in drafting), "no tree branched"


def test_executor_spans_are_children_of_the_step_rpc(traced_run):
    _, history, spans = traced_run
    steps = {s.context.span_id: s for s in spans if s.name == "step"}
    executor_steps = [s for s in spans if s.name == "executor.step"]
    assert len(executor_steps) == len(steps) == len(history)
    children: dict[int, list] = {}
    for span in spans:
        if span.name in ("executor.prepare", "executor.forward", "executor.sample"):
            children.setdefault(span.parent.span_id, []).append(span)
    for span in executor_steps:
        assert span.resource.attributes["service.name"] == "swarmserve-executor"
        assert span.kind == SpanKind.SERVER
        parent = steps[span.parent.span_id]  # the scheduler's step span, across the RPC
        assert span.parent.is_remote and span.context.trace_id == parent.context.trace_id
        a = _attrs(span)
        assert a["swarmserve.step_id"] == _attrs(parent)["swarmserve.step_id"]
        assert a["swarmserve.batch_size"] == _attrs(parent)["swarmserve.batch_size"]
        assert parent.start_time <= span.start_time <= span.end_time <= parent.end_time
        phases = sorted(children[span.context.span_id], key=lambda s: s.start_time)
        assert [p.name for p in phases] == ["executor.prepare", "executor.forward", "executor.sample"]
        assert span.start_time <= phases[0].start_time and phases[-1].end_time == span.end_time
        for before, after in zip(phases, phases[1:]):
            assert before.end_time == after.start_time
        forward_ns = phases[1].end_time - phases[1].start_time
        assert forward_ns == pytest.approx(a["swarmserve.executor.forward_s"] * 1e9, abs=2)
        assert all(p.context.trace_id == span.context.trace_id for p in phases)


def test_tracing_off_installs_nothing():
    assert executor_interceptors(None, None) == []
    telemetry = Telemetry()
    assert telemetry.client_interceptors == [] and telemetry.server_interceptors == []
    assert telemetry.request_started(object()) is None
    assert build_tracer_provider(TracingConfig()) is None
