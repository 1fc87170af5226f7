"""`swarmserve bench tracing`: what tracing costs per step, on vs off, in one run.

Two measurements, both printed:

1. **End to end.** The same greedy workload (`--requests` at once, `--max-new-tokens`
   each, EOS ignored) on a fresh pair of services per round, tracing off and on
   alternately (`--rounds` each; on = every trace sampled and exported over OTLP/gRPC
   to a receiver this process runs on loopback). From GetTimeline, per step: the
   cycle (plan sent to the next plan sent) minus the executor's own compute is the
   time spent outside the model: planning, the RPC, streaming, and whatever tracing
   adds. The medians of that per mode, and their difference, are the per-step cost.
2. **In process.** The per-step tracing calls themselves, timed over many steps with
   the real SDK and the batching OTLP exporter, until every span is exported (the CPU
   the export thread spends counts): the scheduler's begin/end of a step span (links to
   its requests, attributes, metadata injection) and the executor's Step interceptor
   (extract, span, three phase spans). Both with tracing off too, which must be ~0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

from clients.bench.otlp_sink import OtlpSinkServer
from clients.client import AsyncSwarmClient
from clients.serve import ServeConfig, Supervisor, flag_args, free_port
from clients.timeline import fetch_timeline


async def run_round(mode: str, args: argparse.Namespace, endpoint: str, log_file) -> dict:
    tracing = [("--log-format", "json"), ("--otlp-endpoint", endpoint if mode == "on" else None)]
    tracing.append(("--trace-sample-ratio", 1.0 if mode == "on" else None))
    config = ServeConfig(
        executor_listen=f"127.0.0.1:{free_port()}",
        scheduler_listen=f"127.0.0.1:{free_port()}",
        http_listen="",
        executor_args=tuple(
            flag_args(
                [("--model", args.model), ("--kv-cache-gb", args.kv_cache_gb), ("--threads", args.threads), *tracing]
            )
        ),
        scheduler_args=tuple(flag_args([("--max-running-requests", max(1, args.requests)), *tracing])),
    )
    supervisor = Supervisor(config, log_file=log_file)
    try:
        ready = await supervisor.start()
        async with AsyncSwarmClient(ready.scheduler_address) as client:
            await client.complete("warm up", max_new_tokens=4, ignore_eos=True)
            first_step = (await client.server_info()).num_steps + 1
            t0 = time.monotonic()
            await asyncio.gather(
                *(
                    client.complete(
                        f"Agent {i}: summarise the failing test and propose a fix.",
                        max_new_tokens=args.max_new_tokens,
                        temperature=0.0,
                        ignore_eos=True,
                    )
                    for i in range(args.requests)
                )
            )
            wall = time.monotonic() - t0
        timeline = await asyncio.to_thread(fetch_timeline, ready.scheduler_address)
    finally:
        await supervisor.stop()
    steps = [s for s in timeline.steps if s.step_id >= first_step]
    outside, rpc = [], []
    for step, following in zip(steps, steps[1:]):
        compute = step.executor_prepare_s + step.executor_forward_s + step.executor_sample_s
        outside.append(following.start_time_s - step.start_time_s - compute)
        rpc.append(step.duration_s - compute)
    return {
        "mode": mode,
        "steps": len(steps),
        "wall_s": wall,
        "outside_model_median_ms": statistics.median(outside) * 1e3,
        "rpc_overhead_median_ms": statistics.median(rpc) * 1e3,
        "step_cycle_mean_ms": (steps[-1].start_time_s - steps[0].start_time_s) / max(1, len(steps) - 1) * 1e3,
    }


# ------------------------------------------------------------------ in process


async def _time_per_call(make_call, iterations: int, flush) -> float:
    """Seconds per call, including exporting what the calls produced (`flush` waits for it)."""
    await make_call()  # warm
    flush()
    t0 = time.perf_counter()
    for _ in range(iterations):
        await make_call()
    flush()
    return (time.perf_counter() - t0) / iterations


async def in_process_costs(endpoint: str, batch_size: int, iterations: int) -> dict:
    """Microseconds per step for the scheduler's and the executor's tracing work, off and on."""
    from executor_svc.observability.step_interceptor import StepInterceptor
    from scheduler_svc.telemetry import Telemetry
    from service_common.observability.trace_context import TraceContextClientInterceptor
    from service_common.observability.tracing import TracingConfig, build_tracer_provider
    from swarmserve.executor.v1 import executor_pb2 as epb

    provider = build_tracer_provider(TracingConfig(otlp_endpoint=endpoint, sample_ratio=1.0, service_name="bench"))
    tracer = provider.get_tracer("bench")
    request_ids = [f"r{i}" for i in range(batch_size)]
    plan = SimpleNamespace(step_id=1, scheduled=[SimpleNamespace(request_id=r) for r in request_ids])
    record = SimpleNamespace(
        step_id=1, num_requests=batch_size, num_new_requests=0, num_preempted=0, num_prefill_tokens=0,
        num_decode_tokens=batch_size, num_draft_tokens=8, num_drafted_tokens=8, num_accepted_tokens=5,
        num_free_tokens=24, predicted_step_s=0.02, wall_s=0.021, executor_total_s=0.019, num_free_kv_blocks=900,
        request_ids=tuple(request_ids),
    )  # fmt: skip
    step_request = epb.StepRequest(
        step_id=1, scheduled=[epb.ScheduledRequest(request_id=r, num_tokens=1) for r in request_ids]
    )
    step_response = epb.StepResponse(
        step_id=1,
        results=[epb.RequestResult(request_id=r, new_token_ids=[1]) for r in request_ids],
        timings=epb.StepTimings(prepare_s=0.001, forward_s=0.015, sample_s=0.001),
    )
    call_details = SimpleNamespace(method="/x", timeout=None, metadata=None, credentials=None, wait_for_ready=None)

    async def rpc(details, request):
        return step_response

    def scheduler_step(telemetry: Telemetry, interceptors: list):
        async def step():
            scope = telemetry.begin_step(plan)
            with scope:  # the step loop makes the RPC here; only the interceptor's share is timed
                for interceptor in interceptors:
                    await interceptor.intercept_unary_unary(rpc, call_details, step_request)
            telemetry.end_step(scope, record, [])

        return step

    async def measure_scheduler(telemetry: Telemetry) -> float:
        for r in request_ids:  # the live requests' spans the step links to
            if telemetry.tracer is not None:
                telemetry._request_spans[r] = tracer.start_span("request")
        interceptors = [TraceContextClientInterceptor()] if telemetry.tracer is not None else []
        return await _time_per_call(scheduler_step(telemetry, interceptors), iterations, provider.force_flush)

    metadata = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)
    context = SimpleNamespace(code=lambda: None, details=lambda: "")

    async def behavior(request, ctx):
        return step_response

    async def measure_executor(interceptor) -> float:
        if interceptor is None:  # no interceptor is installed when tracing is off
            return await _time_per_call(lambda: behavior(step_request, context), iterations, provider.force_flush)
        observe = interceptor._observe
        return await _time_per_call(
            lambda: observe(behavior, metadata, step_request, context), iterations, provider.force_flush
        )

    try:
        return {
            "batch_size": batch_size,
            "scheduler_off_us": await measure_scheduler(Telemetry()) * 1e6,
            "scheduler_on_us": await measure_scheduler(Telemetry(tracer)) * 1e6,
            "executor_off_us": await measure_executor(None) * 1e6,
            "executor_on_us": await measure_executor(StepInterceptor(tracer)) * 1e6,
        }
    finally:
        provider.shutdown()


# ------------------------------------------------------------------ report


def print_report(rounds: list[dict], micro: dict) -> None:
    print(
        f"{'mode':>5} | {'steps':>5} | {'wall s':>6} | {'cycle ms':>8} | {'outside model ms (median)':>25} | {'RPC overhead ms':>15}"
    )
    for r in rounds:
        print(
            f"{r['mode']:>5} | {r['steps']:5d} | {r['wall_s']:6.2f} | {r['step_cycle_mean_ms']:8.2f} | "
            f"{r['outside_model_median_ms']:25.3f} | {r['rpc_overhead_median_ms']:15.3f}"
        )
    by_mode = {mode: [r for r in rounds if r["mode"] == mode] for mode in ("off", "on")}
    if all(by_mode.values()):
        off = statistics.median(r["outside_model_median_ms"] for r in by_mode["off"])
        on = statistics.median(r["outside_model_median_ms"] for r in by_mode["on"])
        cycle_off = statistics.median(r["step_cycle_mean_ms"] for r in by_mode["off"])
        print(f"\nend to end: time outside the model per step {off:.3f} ms off, {on:.3f} ms on: "
              f"{(on - off) * 1e3:+.0f} us per step ({(on - off) / cycle_off:+.1%} of a {cycle_off:.1f} ms step)")  # fmt: skip
    b = micro["batch_size"]
    print(f"in process (batch of {b}): scheduler {micro['scheduler_off_us']:.1f} us off, {micro['scheduler_on_us']:.1f} us on; "
          f"executor {micro['executor_off_us']:.1f} us off, {micro['executor_on_us']:.1f} us on "
          f"(tracing adds {micro['scheduler_on_us'] - micro['scheduler_off_us'] + micro['executor_on_us'] - micro['executor_off_us']:.0f} us per step)")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--kv-cache-gb", type=float, default=0.25)
    parser.add_argument("--threads", type=int, default=None, help="executor torch threads")
    parser.add_argument("--requests", type=int, default=8, help="requests at once (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens each (default %(default)s)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds per mode, alternating off/on (default %(default)s)"
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=400,
        help="in-process steps timed (default %(default)s; their spans fit the export queue)",
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--log", default="bench_tracing.log", help="where the services' logs go (default %(default)s)")


async def _main(args: argparse.Namespace, endpoint: str) -> list[dict]:
    rounds = []
    with open(args.log, "ab") as log_file:
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                rounds.append(await run_round(mode, args, endpoint, log_file))
    return rounds


def run(args: argparse.Namespace) -> int:
    from service_common.observability.logs import configure_logging

    configure_logging("json", "info")  # as the services log: their debug lines are no-ops here too
    with OtlpSinkServer() as receiver:
        rounds = asyncio.run(_main(args, receiver.endpoint))
        micro = asyncio.run(in_process_costs(receiver.endpoint, args.requests, args.iterations))
        num_spans = len(receiver.sink.spans)
    print_report(rounds, micro)
    print(f"spans received by the OTLP receiver: {num_spans}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rounds": rounds, "in_process": micro, "spans_received": num_spans}, indent=2)
        )
    return 0
