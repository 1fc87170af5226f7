"""The GPU path end to end: the real services on random-weight GGUFs at real models' shapes.

    python -m executor_svc.tools.gpu_check                 # the kernel sections, then these: one command
    python -m executor_svc.tools.gpu_swarm                 # these alone (and the copy bandwidth they need)
    python -m executor_svc.tools.gpu_swarm --dry-run       # tiny Q8_0 models on the CPU, Triton interpreted

For each model, Qwen3-8B Q4_K_M (dense) and Qwen3.5-9B Q4_K_M (the hybrid), written by
`random_gguf.write_random_gguf` (kept in --model-dir for the next run):

- verify   the executor's Engine on the file, in this process: a step verifying K = 0 … 8
           drafts per request at B = 1 and 8 (context 512): the speculation curve, i.e. the
           compute slack measured; K = 0 (a plain decode step, from its graph where the
           model has them) beside the weight-stream floor (weight bytes a step reads ÷ the
           measured device-to-device copy bandwidth).
- served   `swarmserve serve --device cuda` (bfloat16, the default dtype; the scheduler's
           defaults, speculation included): N = 1, 4, 8, 16 greedy streams through HTTP
           /v1/completions, decode tokens/s per N (the first tokens of each stream, where
           graphs are captured, left out) beside the floor's N / floor; the time to first
           token of a 2K-token prompt (after one such prompt to warm up); the project's swarm
           benchmark (`clients.bench.swarm`, agents taking turns over gRPC); the greedy
           tokens of the equality prompts.
- fp32     the same services in float32: the equality prompts again.
- cpu      the CPU executor on the same file (`--device cpu --dtype float32`, the exact
           reference mode; speculation off): the equality prompts with their top-20 logprobs.
           Then the equality rows, for float32 and for bfloat16.

--dry-run runs every step on the CPU on tiny Q8_0 models: the verify curve and the float32
equality run through the Triton kernels, interpreted; the bfloat16 services (streams, TTFT,
swarm) through the C++ kernels, since the interpreter takes a minute over one 450-token
prompt of the swarm benchmark.

Equality: 8 prompts of random tokens, 32 greedy tokens each, against the CPU reference. A
prompt passes when its tokens are identical, or when they first differ at a near-tie: the
reference's logprob of the GPU's token is within the tolerance of its own token's (after a
difference the two continue from different text, so the comparison of that prompt ends
there). Tolerances (NEAR_TIE_NATS): float32 1e-3 nats (both compute in float32 with
different reduction orders: ~1e-5 relative, far below a real kernel bug); bfloat16 1 nat
(the logits are rounded to bfloat16, whose steps at the random model's top logits, ~16–20,
are 0.125, and every layer's activations are too: on an H200 the 36-layer Qwen3-8B shape's
bfloat16 logprobs sat up to 0.63 from float32's where the tokens agreed, and one prompt
first differed at a gap of 0.52, while the same kernels in float32 matched the reference
on every token; the tiny dry-run model's sit up to 0.1 apart). A kernel bug shows as gaps
of nats, or a token outside the reference's top 20 (an infinite gap). A divergence beyond
the tolerance is a correctness failure and makes the command exit 1.

Everything goes through gpu_check's Report: progress to stderr, the JSON rewritten after each
measurement (a run cut short keeps what it measured), one table at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from executor_svc.tools.random_gguf import QWEN3_8B, QWEN35_9B, TINY_QWEN3, TINY_QWEN35, GgufShape, model_file_name

if TYPE_CHECKING:
    from executor_svc.tools.gpu_check import Report

NEAR_TIE_NATS = {"fp32": 1e-3, "bf16": 1.0}
NUM_REFERENCE_LOGPROBS = 20  # the most the API returns (MAX_LOGPROBS)
# What the served model needs beyond gpu_check's torch and triton, as (import name, package).
SERVICE_MODULES = (
    ("gguf", "gguf"),
    ("grpc", "grpcio"),
    ("grpc_health", "grpcio-health-checking"),
    ("fastapi", "fastapi"),
    ("uvicorn", "uvicorn"),
    ("httpx", "httpx"),
    ("structlog", "structlog"),
    ("llguidance", "llguidance"),
    ("tokenizers", "tokenizers"),
    ("swarmserve.scheduler.v1", "this package, installed (its protos are generated at install)"),
)


@dataclass(frozen=True)
class SwarmSizes:
    models: tuple[GgufShape, ...]
    served_args: tuple[str, ...]  # the bfloat16 services' executor, besides --model and --dtype
    fp32_args: tuple[str, ...]  # the GPU path's executor in float32, for the strict equality check
    engine_config: dict  # the GPU path for the in-process Engine (EngineConfig fields)
    verify_batch_sizes: tuple[int, ...]
    verify_drafts: tuple[int, ...]
    verify_context: int
    verify_reps: int
    stream_counts: tuple[int, ...]
    stream_prompt_len: int
    stream_new_tokens: int
    stream_skip_tokens: int  # each stream's first tokens, left out of its decode rate
    ttft_prompt_len: int
    num_equality_prompts: int
    equality_new_tokens: int
    swarm_agents: int
    swarm_turns: int
    swarm_system_tokens: int
    swarm_length_scale: float
    swarm_tool_pause_s: float
    kv_cache_gb: float  # the services' (a 16 GB card holds it beside either model)
    engine_kv_gb: float  # the in-process Engine's (B = 8 requests of context + 9 tokens, the hybrid's slots)
    reference_kv_gb: float  # the CPU reference's, in host memory

    @classmethod
    def full(cls) -> "SwarmSizes":
        return cls(
            models=(QWEN3_8B, QWEN35_9B),
            served_args=("--device", "cuda"),
            fp32_args=("--device", "cuda", "--no-calibration"),
            engine_config=dict(device="cuda"),
            verify_batch_sizes=(1, 8),
            verify_drafts=tuple(range(9)),
            verify_context=512,
            verify_reps=5,
            stream_counts=(1, 4, 8, 16),
            stream_prompt_len=32,
            stream_new_tokens=160,
            stream_skip_tokens=16,
            ttft_prompt_len=2048,
            num_equality_prompts=8,
            equality_new_tokens=32,
            swarm_agents=8,
            swarm_turns=2,
            swarm_system_tokens=250,  # ~1,000 tokens of the random models' byte-level vocabulary
            swarm_length_scale=0.25,
            swarm_tool_pause_s=0.5,
            kv_cache_gb=6.0,
            engine_kv_gb=2.0,
            reference_kv_gb=1.0,
        )

    @classmethod
    def dry_run(cls) -> "SwarmSizes":
        return cls(
            models=(TINY_QWEN3, TINY_QWEN35),
            # The verify curve and the strict (float32) equality run the Triton kernels, interpreted
            # (TRITON_INTERPRET=1 is inherited); the served measures run the C++ kernels in bfloat16,
            # since the interpreter spends a minute on one of the swarm benchmark's 450-token prompts.
            served_args=("--device", "cpu", "--no-calibration"),
            fp32_args=("--device", "cpu", "--kernels", "triton", "--no-calibration"),
            engine_config=dict(device="cpu", kernels="triton"),
            verify_batch_sizes=(1, 2),
            verify_drafts=(0, 2),
            verify_context=16,
            verify_reps=1,
            stream_counts=(1, 2),
            stream_prompt_len=5,
            stream_new_tokens=12,  # the C++ kernels: cheap
            stream_skip_tokens=4,
            ttft_prompt_len=40,
            num_equality_prompts=2,
            equality_new_tokens=4,
            swarm_agents=2,
            swarm_turns=1,
            swarm_system_tokens=8,
            swarm_length_scale=0.02,
            swarm_tool_pause_s=0.0,
            kv_cache_gb=0.05,
            engine_kv_gb=0.05,
            reference_kv_gb=0.05,
        )


@dataclass
class GreedyRun:
    """One prompt's greedy tokens and, per position, the top logprobs the server returned."""

    token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Comparison:
    """A GPU run against the reference, prompt by prompt (see the module docstring)."""

    num_equal: int  # prompts whose tokens are identical
    num_near_ties: int  # prompts that first differ at a near-tie
    num_mismatches: int  # prompts that first differ beyond the tolerance
    num_positions: int  # tokens compared, over all prompts, up to each one's first difference
    worst_gap: float  # the largest reference logprob gap at a first difference (inf: outside its top-k)
    max_logprob_diff: float  # the largest |Δ logprob| of the token both chose, where they agree


def compare_greedy(runs: list[GreedyRun], references: list[GreedyRun], tolerance: float) -> Comparison:
    """Each prompt's GPU tokens against the reference's, to the first difference."""
    num_equal = num_near_ties = num_mismatches = num_positions = 0
    worst_gap = max_diff = 0.0
    for run, ref in zip(runs, references, strict=True):
        length = min(len(run.token_ids), len(ref.token_ids))
        first = next((i for i in range(length) if run.token_ids[i] != ref.token_ids[i]), None)
        num_positions += length if first is None else first
        for i in range(length if first is None else first):
            ours, theirs = run.top_logprobs[i].get(run.token_ids[i]), ref.top_logprobs[i].get(ref.token_ids[i])
            if ours is not None and theirs is not None:
                max_diff = max(max_diff, abs(ours - theirs))
        if first is None:
            num_equal += len(run.token_ids) == len(ref.token_ids)
            num_mismatches += len(run.token_ids) != len(ref.token_ids)
            continue
        options = ref.top_logprobs[first]
        gap = options[ref.token_ids[first]] - options.get(run.token_ids[first], -math.inf)
        worst_gap = max(worst_gap, gap)
        if gap <= tolerance:
            num_near_ties += 1
        else:
            num_mismatches += 1
    return Comparison(num_equal, num_near_ties, num_mismatches, num_positions, worst_gap, max_diff)


@dataclass
class ModelRun:
    """What one model's steps hand on to the next."""

    shape: GgufShape
    path: Path | None = None
    streamed_bytes: int | None = None
    greedy: dict[str, list[GreedyRun]] = field(default_factory=dict)  # "bf16" | "fp32" | "cpu"


class Workspace:
    """Where the model files, the services' log and the prebuilt CPU kernels come from."""

    def __init__(self, model_dir: Path, log_path: Path) -> None:
        self.model_dir = model_dir
        self.log_path = log_path
        self.cpu_kernels_build: subprocess.Popen | None = None

    def start_cpu_kernels_build(self) -> None:
        """Compile the CPU reference's C++ kernels (a no-op when cached) while the model files are written."""
        with open(self.log_path, "ab") as log:
            self.cpu_kernels_build = subprocess.Popen(
                [sys.executable, "-m", "executor_svc.cpu_kernels"], stdout=log, stderr=subprocess.STDOUT
            )

    def wait_cpu_kernels_build(self, report: Report) -> None:
        """Before anything is timed: a compiler on the host's cores would slow the GPU's launches."""
        start = time.perf_counter()
        returncode = self.cpu_kernels_build.wait() if self.cpu_kernels_build is not None else 0
        seconds = time.perf_counter() - start
        if returncode != 0:
            raise RuntimeError(f"the CPU kernels' build failed (see {self.log_path}): the CPU reference cannot run")
        report.log(f"swarm: CPU kernels ready (waited {seconds:.1f}s)")


def missing_service_modules() -> list[str]:
    """The packages the services need that are not importable here (gpu_check itself needs none of them)."""
    import importlib.util

    missing = []
    for module, package in SERVICE_MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(package)
    return missing


# ----------------------------------------------------------------------------- steps


def step_write_model(report: Report, workspace: Workspace, run: ModelRun, device: torch.device) -> None:
    """The model's GGUF, drawn on the device; kept for the next run."""
    from executor_svc.tools.random_gguf import write_random_gguf

    path = workspace.model_dir / model_file_name(run.shape, seed=0)
    start = time.perf_counter()
    is_cached = path.exists()
    if not is_cached:
        write_random_gguf(path, run.shape, seed=0, device=device)
    run.path = path
    seconds = time.perf_counter() - start
    size = path.stat().st_size
    summary = f"{size / 1e9:.2f} GB " + ("cached" if is_cached else f"written in {seconds:.1f}s")
    report.add("swarm", "model_file", run.shape.name, "", str(path), bytes=size, seconds=seconds, summary=summary)


def step_verify_curve(report: Report, run: ModelRun, sizes: SwarmSizes) -> None:
    """The Engine on the file: step time verifying K drafts per request against K = 0, and the floor."""
    from executor_svc.config import EngineConfig
    from executor_svc.engine.engine import Engine

    config = EngineConfig(
        model=str(run.path),
        dtype="bfloat16",
        kv_cache_bytes=int(sizes.engine_kv_gb * (1 << 30)),
        max_draft_tokens=max(sizes.verify_drafts),
        **sizes.engine_config,
    )
    engine = Engine(config)
    try:
        run.streamed_bytes = engine.model_runner.model.weights.streamed_bytes
        copy_gbps = report.yardsticks.get("copy_gbps")
        floor_ms = run.streamed_bytes / copy_gbps / 1e6 if copy_gbps else None
        for b in sizes.verify_batch_sizes:
            base_ms = None
            for k in sizes.verify_drafts:
                if report.over_budget():
                    return
                sample = engine.model_runner.time_step(sizes.verify_context, 1 + k, 1 + k, b, sizes.verify_reps)
                if sample is None:
                    raise RuntimeError(f"B={b} K={k} does not fit the in-process KV cache")
                ms = 1e3 * sample.step_s
                base_ms = base_ms or ms
                summary = f"{ms:.2f} ms = {ms / base_ms:.2f}x K=0"
                if k == 0 and floor_ms:
                    summary += f" (floor {floor_ms:.2f} ms = {ms / floor_ms:.2f}x)"
                report.add(
                    "swarm",
                    f"verify_B{b}",
                    run.shape.name,
                    "bf16",
                    f"B={b} K={k} ctx={sizes.verify_context}",
                    batch=b,
                    drafts=k,
                    ms=ms,
                    ratio=ms / base_ms,
                    floor_ms=floor_ms,
                    weight_bytes=run.streamed_bytes,
                    summary=summary,
                )
                report.save()
    finally:
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def step_served(report: Report, workspace: Workspace, run: ModelRun, sizes: SwarmSizes) -> None:
    """The services in bfloat16: streams, TTFT, the swarm benchmark, the equality prompts."""
    measures = [
        ("streams", _measure_streams),
        ("ttft", _measure_ttft),
        ("bench_swarm", _measure_swarm),
        ("greedy_bf16", _greedy_into("bf16")),
    ]
    setup = ServiceSetup("bfloat16", sizes.served_args, sizes.kv_cache_gb)
    asyncio.run(_with_services(report, workspace, run, sizes, setup, measures))


def step_served_fp32(report: Report, workspace: Workspace, run: ModelRun, sizes: SwarmSizes) -> None:
    measures = [("greedy_fp32", _greedy_into("fp32"))]
    setup = ServiceSetup("float32", sizes.fp32_args, sizes.kv_cache_gb)
    asyncio.run(_with_services(report, workspace, run, sizes, setup, measures))


def step_cpu_reference(report: Report, workspace: Workspace, run: ModelRun, sizes: SwarmSizes) -> None:
    """The CPU executor's greedy tokens (with logprobs), then the equality rows."""
    setup = ServiceSetup("float32", ("--device", "cpu", "--no-calibration"), sizes.reference_kv_gb, ("--spec", "off"))
    asyncio.run(_with_services(report, workspace, run, sizes, setup, [("greedy_cpu", _greedy_into("cpu"))]))
    reference = run.greedy.get("cpu")
    if reference is None:
        raise RuntimeError("the CPU reference produced no tokens")
    for dtype_name, tolerance in NEAR_TIE_NATS.items():
        runs = run.greedy.get(dtype_name)
        if runs is None:
            report.errors.append(
                dict(section="swarm", name=f"equality {run.shape.name} {dtype_name}", error="no GPU tokens to compare")
            )
            continue
        add_equality(report, run.shape.name, dtype_name, runs, reference, tolerance)
    report.save()


def add_equality(
    report: Report,
    model_name: str,
    dtype_name: str,
    runs: list[GreedyRun],
    reference: list[GreedyRun],
    tolerance: float,
) -> None:
    """The equality row of one GPU run: ok (else the command exits 1) when no prompt mismatches."""
    c = compare_greedy(runs, reference, tolerance)
    ok = c.num_mismatches == 0
    summary = (
        f"{c.num_equal}/{len(runs)} identical, {c.num_near_ties} near-ties (gap <= {tolerance:g}), "
        f"{c.num_mismatches} mismatches; {c.num_positions} tokens compared; worst gap {c.worst_gap:.2g}, "
        f"max |dlogprob| {c.max_logprob_diff:.2g}" + ("" if ok else " FAIL")
    )
    size = f"{len(runs)} prompts x {max((len(r.token_ids) for r in reference), default=0)} tokens"
    report.add(
        "swarm",
        "equality_vs_cpu",
        model_name,
        dtype_name,
        size,
        num_equal=c.num_equal,
        num_near_ties=c.num_near_ties,
        num_mismatches=c.num_mismatches,
        num_positions=c.num_positions,
        worst_gap=c.worst_gap,
        max_logprob_diff=c.max_logprob_diff,
        tolerance=tolerance,
        ok=ok,
        summary=summary,
    )


# ----------------------------------------------------------------------------- services


@dataclass(frozen=True)
class ServiceSetup:
    """How one set of services runs the model: the executor's dtype and flags, the scheduler's."""

    dtype: str
    executor_args: tuple[str, ...]
    kv_cache_gb: float
    scheduler_args: tuple[str, ...] = ()


async def _with_services(
    report: Report, workspace: Workspace, run: ModelRun, sizes: SwarmSizes, setup: ServiceSetup, measures: list
) -> None:
    """Start the services on the model, run each measure guarded and within the budget, stop them."""
    from clients.bench.services import start_services

    max_streams = max(max(sizes.stream_counts), sizes.swarm_agents, sizes.num_equality_prompts)
    with open(workspace.log_path, "ab") as log:
        async with start_services(
            log,
            model=str(run.path),
            dtype=setup.dtype,
            kv_cache_gb=setup.kv_cache_gb,
            executor_args=setup.executor_args,
            scheduler_args=setup.scheduler_args,
            max_running_requests=max_streams,
            http=True,
        ) as services:
            report.log(f"swarm {run.shape.name}: services up ({setup.dtype}, {' '.join(setup.executor_args)})")
            for label, measure in measures:
                remaining = report.budget_s - report.elapsed()
                if remaining <= 0:
                    error = "skipped: time budget spent"
                    report.errors.append(dict(section="swarm", name=f"{label} {run.shape.name}", error=error))
                    continue
                try:
                    await asyncio.wait_for(measure(report, services, run, sizes), remaining)
                except TimeoutError:
                    error = f"cut short after {remaining:.0f}s: time budget spent"
                    report.errors.append(dict(section="swarm", name=f"{label} {run.shape.name}", error=error))
                    report.log(f"swarm {label} {run.shape.name}: {error}")
                except Exception as exc:  # noqa: BLE001 - one measure's failure keeps the others
                    error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
                    report.errors.append(dict(section="swarm", name=f"{label} {run.shape.name}", error=error))
                    report.log(f"swarm {label} {run.shape.name}: FAILED {error}")
                report.save()


def _random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts of random token ids past the control tokens: no two share a prefix block."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(count)]


async def _stream_completion(http, base_url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """(the time the request was sent, each output token's arrival time), greedy, EOS ignored."""
    from clients.bench.swarm import parse_sse_line

    body = {
        "model": "swarmserve",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    sent, times = time.perf_counter(), []
    async with http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            chunk = parse_sse_line(line)
            for choice in (chunk or {}).get("choices", []):
                now = time.perf_counter()
                times.extend([now] * len(choice.get("token_ids") or ()))
    if len(times) != max_tokens:
        raise RuntimeError(f"a stream returned {len(times)} tokens, not {max_tokens}")
    return sent, times


async def _measure_streams(report: Report, services, run: ModelRun, sizes: SwarmSizes) -> None:
    import httpx

    copy_gbps = report.yardsticks.get("copy_gbps")
    floor_ms = run.streamed_bytes / copy_gbps / 1e6 if copy_gbps and run.streamed_bytes else None
    base_url = f"http://{services.http_address}"
    async with httpx.AsyncClient(timeout=None) as http:
        for n in sizes.stream_counts:
            prompts = _random_prompts(n, sizes.stream_prompt_len, run.shape.vocab_size, seed=1000 + n)
            results = await asyncio.gather(
                *(_stream_completion(http, base_url, p, sizes.stream_new_tokens) for p in prompts)
            )
            rates = [_decode_rate(times, sizes.stream_skip_tokens) for _, times in results]
            tokens_per_s = sum(rates)
            summary = f"{tokens_per_s:.0f} tok/s ({tokens_per_s / n:.0f} per stream)"
            floor_tokens_per_s = None
            if floor_ms:
                floor_tokens_per_s = n * 1e3 / floor_ms
                summary += f", floor {floor_tokens_per_s:.0f} tok/s = {tokens_per_s / floor_tokens_per_s:.0%}"
            report.add(
                "swarm",
                "decode_streams",
                run.shape.name,
                "bf16",
                f"N={n} {sizes.stream_new_tokens} tokens",
                streams=n,
                tokens_per_s=tokens_per_s,
                per_stream_tokens_per_s=tokens_per_s / n,
                floor_tokens_per_s=floor_tokens_per_s,
                summary=summary,
            )
            report.save()


def _decode_rate(times: list[float], skip: int) -> float:
    """Tokens/s of one stream after its first `skip` + 1 tokens: those that arrived after token `skip`
    over the time they took (tokens come in bursts of up to --max-decode-runs, so count by arrival)."""
    start = times[skip]
    num_later = sum(1 for t in times if t > start)
    if not num_later:
        raise RuntimeError(f"every token after the first {skip + 1} came in one burst with it: stream more tokens")
    return num_later / (times[-1] - start)


async def _measure_ttft(report: Report, services, run: ModelRun, sizes: SwarmSizes) -> None:
    """The first token of a fresh 2K-token prompt, after another one has run (kernels compiled)."""
    import httpx

    base_url = f"http://{services.http_address}"
    warmup, prompt = _random_prompts(2, sizes.ttft_prompt_len, run.shape.vocab_size, seed=7)
    async with httpx.AsyncClient(timeout=None) as http:
        await _stream_completion(http, base_url, warmup, 1)
        sent, times = await _stream_completion(http, base_url, prompt, 1)
    ttft_ms = 1e3 * (times[0] - sent)
    summary = f"{ttft_ms:.0f} ms = {sizes.ttft_prompt_len / (times[0] - sent):.0f} prompt tok/s"
    report.add(
        "swarm",
        "ttft",
        run.shape.name,
        "bf16",
        f"{sizes.ttft_prompt_len}-token prompt",
        ttft_ms=ttft_ms,
        summary=summary,
    )


async def _measure_swarm(report: Report, services, run: ModelRun, sizes: SwarmSizes) -> None:
    from clients.bench.swarm import GrpcTarget, SwarmConfig, run_swarm

    config = SwarmConfig(
        num_agents=sizes.swarm_agents,
        num_turns=sizes.swarm_turns,
        system_tokens=sizes.swarm_system_tokens,
        length_scale=sizes.swarm_length_scale,
        mean_tool_pause_s=sizes.swarm_tool_pause_s,
    )
    target = GrpcTarget(services.scheduler_address)
    try:
        result = await run_swarm(target, config)
    finally:
        await target.close()
    s = result["summary"]
    acceptance = s["draft_acceptance"]
    summary = (
        f"{s['useful_tokens_per_s']:.0f} useful tok/s, TTFT p50 {1e3 * (s['ttft_p50_s'] or 0):.0f} ms, "
        f"ITL p50 {1e3 * (s['itl_p50_s'] or 0):.1f} ms, prefix hits {s['prefix_hit_rate'] or 0:.0%}, "
        f"acceptance {'-' if acceptance is None else f'{acceptance:.0%}'}"
    )
    size = f"{config.num_agents} agents x {config.num_turns} turns"
    report.add("swarm", "bench_swarm", run.shape.name, "bf16", size, **s, summary=summary)


def _greedy_into(key: str):
    """A measure storing the equality prompts' greedy runs under run.greedy[key]."""

    async def measure(report: Report, services, run: ModelRun, sizes: SwarmSizes) -> None:
        from clients.client import AsyncSwarmClient

        prompts = [
            _random_prompts(1, 5 + 3 * i, run.shape.vocab_size, seed=100 + i)[0]
            for i in range(sizes.num_equality_prompts)
        ]
        async with AsyncSwarmClient(services.scheduler_address) as client:
            runs = await asyncio.gather(*(_greedy(client, p, sizes.equality_new_tokens) for p in prompts))
        run.greedy[key] = list(runs)
        report.log(f"swarm {run.shape.name}: {key} greedy tokens of {len(runs)} prompts")

    return measure


async def _greedy(client, prompt: list[int], max_new_tokens: int) -> GreedyRun:
    from clients.events import TokenEvent

    run = GreedyRun()
    async with client.generate(
        token_ids=prompt,
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        ignore_eos=True,
        num_logprobs=NUM_REFERENCE_LOGPROBS,
    ) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                run.token_ids.extend(event.token_ids)
                run.top_logprobs.extend({t.token_id: t.logprob for t in lp.top_logprobs} for lp in event.logprobs)
    return run


# ----------------------------------------------------------------------------- plan and main


def swarm_plan(report: Report, device: torch.device, model_dir: Path | None, log_dir: Path | None) -> list[tuple]:
    """The end-to-end steps, model by model, as gpu_check's plan entries (section "swarm")."""
    dry_run = device.type == "cpu"
    sizes = SwarmSizes.dry_run() if dry_run else SwarmSizes.full()
    missing = missing_service_modules()
    if missing:

        def refuse() -> None:
            raise RuntimeError(f"the services need {', '.join(missing)}: install this package (pip install -e .)")

        return [("swarm", "services' packages", refuse, ())]
    if model_dir is None:
        model_dir = Path(tempfile.mkdtemp(prefix="gpu_swarm-")) if dry_run else default_model_dir()
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="gpu_swarm-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    workspace = Workspace(model_dir, log_dir / "services.log")
    plan: list[tuple] = [("swarm", "CPU kernels' build", workspace.start_cpu_kernels_build, ())]
    runs = [ModelRun(shape) for shape in sizes.models]
    plan += [("swarm", f"model file {r.shape.name}", step_write_model, (report, workspace, r, device)) for r in runs]
    plan.append(("swarm", "CPU kernels' build", workspace.wait_cpu_kernels_build, (report,)))
    for r in runs:
        name = r.shape.name
        plan += [
            ("swarm", f"verify curve {name}", step_verify_curve, (report, r, sizes)),
            ("swarm", f"served {name}", step_served, (report, workspace, r, sizes)),
            ("swarm", f"served fp32 {name}", step_served_fp32, (report, workspace, r, sizes)),
            ("swarm", f"cpu reference {name}", step_cpu_reference, (report, workspace, r, sizes)),
        ]
    report.log(f"swarm: models in {model_dir}, services' log {workspace.log_path}")
    return plan


def default_model_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return Path(cache) / "swarmserve" / "gpu_swarm"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny models on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--budget-s", type=float, default=300.0, help="skip what is left after this many seconds")
    parser.add_argument("--model-dir", type=Path, default=None, help=f"model files (default {default_model_dir()})")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="where gpu_swarm.json/.txt go (default $OUT)")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported, here and in the executors
    from executor_svc.tools.gpu_check import Bench, Report, Sizes, finish, run_entries, section_env, section_roofline

    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        sys.stderr.write("without a GPU the Triton kernels run only under TRITON_INTERPRET=1 (or pass --dry-run)\n")
        return 2
    sizes = Sizes.dry_run() if device.type == "cpu" else Sizes.full()
    report = Report(args.budget_s, args.out, name="gpu_swarm")
    report.log(f"gpu_swarm on {device}, {'dry-run' if device.type == 'cpu' else 'full'} sizes")
    plan = [
        ("env", "env", section_env, (report, device)),
        ("roofline", "copy and matmul", section_roofline, (report, Bench(device, sizes), sizes, device)),
    ]
    plan += swarm_plan(report, device, args.model_dir, Path(args.out) if args.out else None)
    run_entries(report, plan, device)
    return finish(report)


if __name__ == "__main__":
    sys.exit(main())
