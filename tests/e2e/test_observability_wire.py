"""Observability over the wire, with both services as subprocesses (a tiny model):

- traces: OTLP/gRPC export (configured only by OTEL_EXPORTER_OTLP_ENDPOINT) to a
  receiver this test runs on loopback; spans from both services arrive, and each
  step's scheduler span and executor spans share one trace;
- metrics: both Prometheus endpoints scraped over HTTP and parsed; counters move;
- logs: every line is JSON; lines carry request / step ids and the ids of the spans
  that actually arrived;
- `swarmserve timeline`: a Chrome trace JSON and a PNG from the live scheduler.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients import AsyncSwarmClient, SwarmServeError
from clients.bench.otlp_sink import OtlpSinkServer
from clients.cli import main as cli_main
from tests.support.stack import Stack, free_port
from tests.support.tiny_gguf import TinyModelSpec

REQUESTS = {
    "wire-a": ("the cat sat on the mat, the cat sat on the", 12),
    "wire-b": ("one two one two one", 7),
    "wire-c": ("hello", 3),
}


@pytest.fixture(scope="module")
def observed(tiny_gguf_path, tmp_path_factory):
    model = tiny_gguf_path(TinyModelSpec(context_length=256))
    log_dir = tmp_path_factory.mktemp("logs")
    executor_metrics, scheduler_metrics = free_port(), free_port()
    with OtlpSinkServer() as receiver:
        with pytest.MonkeyPatch.context() as env:  # the services inherit this environment
            env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)  # the only tracing configuration given
            env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s, not 5 s
            for name in ("OTEL_SERVICE_NAME", "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_TRACES_SAMPLER_ARG"):
                env.delenv(name, raising=False)
            stack = Stack(
                [
                    "--model",
                    str(model),
                    "--kv-cache-gb",
                    "0.01",
                    "--metrics-port",
                    str(executor_metrics),
                    "--log-level",
                    "debug",
                ],
                ["--metrics-port", str(scheduler_metrics), "--log-level", "debug", "--spec", "fixed:2"],
                log_dir=log_dir,
            )
            try:
                stack.start()
            except Exception:
                stack.stop()
                raise
        try:
            yield stack, receiver, log_dir, executor_metrics, scheduler_metrics
        finally:
            stack.stop()


def scrape(port: int) -> dict[str, float]:
    """Every sample as `name{label="v",...}` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


@pytest.fixture(scope="module")
def workload(observed):
    """Scrape, run the requests (and one bad one), scrape again; wait for every span."""
    stack, receiver, _, executor_port, scheduler_port = observed
    before = scrape(scheduler_port), scrape(executor_port)

    async def main():
        async with AsyncSwarmClient(stack.scheduler_address) as client:
            completions = await asyncio.gather(
                *(
                    client.complete(prompt, max_new_tokens=n, temperature=0.0, ignore_eos=True, request_id=rid)
                    for rid, (prompt, n) in REQUESTS.items()
                )
            )
            with pytest.raises(SwarmServeError) as bad:
                await client.complete("", max_new_tokens=3)
            assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
            info = await client.server_info()
        return completions, info

    completions, info = asyncio.run(main())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        names = [s.name for s in receiver.sink.spans]
        if names.count("request") == len(REQUESTS) and names.count("executor.step") >= info.num_steps:
            break
        time.sleep(0.1)
    time.sleep(0.3)  # the executor's phase spans are exported with (or just after) their step
    after = scrape(scheduler_port), scrape(executor_port)
    return completions, info, before, after


def test_spans_from_both_services_arrive_and_share_a_trace_per_step(observed, workload):
    _, receiver, *_ = observed
    completions, info, *_ = workload
    spans = receiver.sink.spans
    by_service = {}
    for span in spans:
        by_service.setdefault(span.service_name, []).append(span)
    assert set(by_service) == {"swarmserve-scheduler", "swarmserve-executor"}
    requests = {
        s.attribute("swarmserve.request_id"): s for s in by_service["swarmserve-scheduler"] if s.name == "request"
    }
    assert set(requests) == set(REQUESTS)
    for completion in completions:
        span = requests[completion.request_id]
        assert span.attribute("swarmserve.num_completion_tokens") == REQUESTS[completion.request_id][1]
        assert span.attribute("swarmserve.finish_reason") == "length"
        assert span.attribute("swarmserve.ttft_s") == pytest.approx(completion.usage.ttft_s, abs=1e-6)
    steps = [s for s in by_service["swarmserve-scheduler"] if s.name == "step"]
    assert len(steps) == info.num_steps
    executor_spans = by_service["swarmserve-executor"]
    for step in steps:
        same_trace = [s for s in executor_spans if s.trace_id == step.trace_id]
        assert sorted(s.name for s in same_trace) == [
            "executor.forward",
            "executor.prepare",
            "executor.sample",
            "executor.step",
        ]
        executor_step = next(s for s in same_trace if s.name == "executor.step")
        assert executor_step.parent_span_id == step.span_id
        assert executor_step.attribute("swarmserve.step_id") == step.attribute("swarmserve.step_id")
        assert all(s.parent_span_id == executor_step.span_id for s in same_trace if s is not executor_step)
        linked = {link.span_id.hex() for link in step.span.links}
        assert linked and linked <= {r.span_id for r in requests.values()}


def counter_delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_metrics_endpoints_move_as_requests_run(workload):
    completions, info, (sched_before, exec_before), (sched_after, exec_after) = workload
    num_tokens = sum(n for _, n in REQUESTS.values())
    num_steps = counter_delta(sched_before, sched_after, "swarmserve_scheduler_steps_total")
    assert num_steps == info.num_steps > 0
    assert counter_delta(exec_before, exec_after, "swarmserve_executor_steps_total") == num_steps
    assert counter_delta(sched_before, sched_after, "swarmserve_scheduler_generated_tokens_total") == num_tokens
    assert counter_delta(exec_before, exec_after, "swarmserve_executor_generated_tokens_total") == num_tokens
    assert counter_delta(sched_before, sched_after, "swarmserve_scheduler_step_duration_seconds_count") == num_steps
    assert counter_delta(sched_before, sched_after, "swarmserve_scheduler_batch_size_count") == num_steps
    assert counter_delta(sched_before, sched_after, "swarmserve_scheduler_time_to_first_token_seconds_count") == len(
        REQUESTS
    )
    assert counter_delta(
        sched_before, sched_after, "swarmserve_scheduler_inter_token_latency_seconds_count"
    ) == num_tokens - len(REQUESTS)
    assert counter_delta(
        sched_before, sched_after, 'swarmserve_scheduler_requests_finished_total{finish_reason="length"}'
    ) == len(REQUESTS)
    prompt_tokens = sum(c.usage.prompt_tokens for c in completions)
    assert counter_delta(sched_before, sched_after, "swarmserve_scheduler_prefill_tokens_total") == prompt_tokens
    drafted = counter_delta(sched_before, sched_after, "swarmserve_scheduler_draft_tokens_total")
    accepted = counter_delta(sched_before, sched_after, "swarmserve_scheduler_draft_tokens_accepted_total")
    assert drafted == counter_delta(exec_before, exec_after, "swarmserve_executor_draft_tokens_total")
    assert accepted == sum(c.usage.accepted_tokens for c in completions) <= drafted
    assert counter_delta(sched_before, sched_after, "swarmserve_scheduler_draft_tokens_allocated_total") >= drafted
    errors = 'swarmserve_scheduler_rpc_errors_total{code="INVALID_ARGUMENT",method="Generate"}'
    assert sched_after.get(errors) == 1
    assert sched_after["swarmserve_scheduler_executor_connected"] == 1
    assert (
        sched_after["swarmserve_scheduler_queue_depth"] == 0
        and sched_after["swarmserve_scheduler_running_requests"] == 0
    )
    assert sched_after["swarmserve_scheduler_kv_blocks_used"] == 0 == exec_after["swarmserve_executor_kv_blocks_used"]
    assert exec_after["swarmserve_executor_kv_blocks_free"] > 0
    assert (
        counter_delta(exec_before, exec_after, 'swarmserve_executor_step_phase_duration_seconds_count{phase="forward"}')
        == num_steps
    )


def read_log(path) -> list[dict]:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    assert lines
    return [json.loads(line) for line in lines]  # every line is JSON, or this raises


def test_log_lines_are_json_with_ids_and_trace_ids(observed, workload):
    _, receiver, log_dir, *_ = observed
    spans = receiver.sink.spans
    scheduler_log, executor_log = read_log(log_dir / "scheduler.log"), read_log(log_dir / "executor.log")
    request_spans = {s.attribute("swarmserve.request_id"): s for s in spans if s.name == "request"}
    finished = {line["request_id"]: line for line in scheduler_log if line["event"] == "request_finished"}
    assert set(REQUESTS) <= set(finished)
    for request_id in REQUESTS:
        assert (finished[request_id]["trace_id"], finished[request_id]["span_id"]) == (
            request_spans[request_id].trace_id,
            request_spans[request_id].span_id,
        )
    step_spans = {s.attribute("swarmserve.step_id"): s for s in spans if s.name == "step"}
    step_lines = [line for line in scheduler_log if line["event"] == "step_done"]
    assert len(step_lines) == len(step_spans)
    for line in step_lines:
        assert (line["trace_id"], line["span_id"]) == (
            step_spans[line["step_id"]].trace_id,
            step_spans[line["step_id"]].span_id,
        )
    executor_steps = {s.attribute("swarmserve.step_id"): s for s in spans if s.name == "executor.step"}
    executed = [line for line in executor_log if line["event"] == "step_executed"]
    assert len(executed) == len(executor_steps)
    for line in executed:
        span = executor_steps[line["step_id"]]
        assert (line["trace_id"], line["span_id"]) == (span.trace_id, span.span_id)
        assert line["trace_id"] == step_spans[line["step_id"]].trace_id


def test_timeline_command_writes_a_chrome_trace_and_a_png(observed, workload, tmp_path, capsys):
    stack, *_ = observed
    _, info, *_ = workload
    prefix = tmp_path / "out" / "timeline"
    assert cli_main(["timeline", "--server", stack.scheduler_address, "--out", str(prefix)]) == 0
    trace = json.loads((tmp_path / "out" / "timeline.json").read_text())
    events = trace["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    request_tracks = {
        name.removeprefix("request "): pid_tid for pid_tid, name in threads.items() if name.startswith("request ")
    }
    assert set(REQUESTS) <= set(request_tracks)
    assert {processes[pid] for pid, _ in request_tracks.values()} == {"requests"}
    executor_track = next(pid_tid for pid_tid, name in threads.items() if name == "executor")
    assert processes[executor_track[0]] == "executor"
    slices = [e for e in events if e["ph"] == "X"]
    for e in slices:
        assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0
    executor_slices = [e for e in slices if (e["pid"], e["tid"]) == executor_track]
    assert len(executor_slices) == 3 * trace["otherData"]["num_steps"]
    assert trace["otherData"]["num_steps"] == info.num_steps  # every step of this fresh scheduler
    for request_id, (_, n) in REQUESTS.items():
        track = [e for e in slices if (e["pid"], e["tid"]) == request_tracks[request_id]]
        assert sum(e["args"]["new_tokens"] for e in track) == n
    png = (tmp_path / "out" / "timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(tmp_path / "out" / "timeline.png").shape
    assert width >= 800 and height >= 800
    out = capsys.readouterr().out
    assert "timeline.json" in out
    assert "cost model |predicted - executor| / executor" in out and "scheduler overhead:" in out


def test_exemplars_link_step_durations_and_ttft_to_their_traces(observed, workload):
    """Scraped as OpenMetrics (as Prometheus does), histogram buckets carry trace ids."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

    _, receiver, _, _, scheduler_port = observed
    request = urllib.request.Request(
        f"http://127.0.0.1:{scheduler_port}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        text = response.read().decode()
    exemplars: dict[str, set[str]] = {}
    for family in openmetrics_families(text):
        for sample in family.samples:
            if sample.exemplar is not None:
                exemplars.setdefault(family.name, set()).add(sample.exemplar.labels["trace_id"])
    spans = receiver.sink.spans
    step_traces = {s.trace_id for s in spans if s.name == "step"}
    request_traces = {s.trace_id for s in spans if s.name == "request"}
    assert (
        exemplars["swarmserve_scheduler_step_duration_seconds"]
        and exemplars["swarmserve_scheduler_step_duration_seconds"] <= step_traces
    )
    assert (
        exemplars["swarmserve_scheduler_time_to_first_token_seconds"]
        and exemplars["swarmserve_scheduler_time_to_first_token_seconds"] <= request_traces
    )


def test_health_probe_answers_for_both_services(observed):
    from clients.health_probe import main as health_probe

    stack, *_ = observed
    assert health_probe([stack.executor_address]) == 0
    assert health_probe([stack.scheduler_address]) == 0
