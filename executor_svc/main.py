"""`swarmserve-executor`: load the model and serve ExecutorService over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import signal

import structlog

from executor_svc.engine import DTYPE_CHOICES, KERNELS, MATMULS, Engine, EngineConfig
from executor_svc.observability.executor_metrics import ExecutorMetrics
from executor_svc.server import engine_thread_pool, serve
from service_common.observability.flags import add_observability_flags
from service_common.observability.logs import LOG_FORMATS, configure_logging
from service_common.observability.service_telemetry import start_service_telemetry

log = structlog.get_logger()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swarmserve-executor", description=__doc__)
    p.add_argument("--listen", default="127.0.0.1:50052", help="address to serve on (default %(default)s)")
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M-Instruct) or a path to a .gguf")
    p.add_argument(
        "--dtype",
        default=EngineConfig.dtype,
        choices=DTYPE_CHOICES,
        help="activation and KV dtype; auto: bfloat16 on a GPU, float32 on the CPU (default %(default)s)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (ROCm's torch answers to cuda) (default %(default)s)")
    p.add_argument(
        "--kernels", default="auto", choices=KERNELS, help="auto: triton on a GPU, the C++ kernels (cpu) on the CPU; torch: the plain-torch reference (default %(default)s)"
    )
    p.add_argument(
        "--matmul",
        default=EngineConfig.matmul,
        choices=MATMULS,
        help="how quantized weights multiply on the CPU: exact (float32 math on the dequantized weights) or "
        "int16 (activations quantized to int16 per 32-value block, integer dot products with Q4_0/Q4_1/Q8_0 "
        "codes: faster, top-1 agreement with exact >= 99%%); auto: int16 on the CPU unless --dtype float32 "
        "(default %(default)s)",
    )
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="memory for the paged KV cache in GiB (default %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="most tokens one step may compute")
    p.add_argument(
        "--no-batch-invariant",
        action="store_true",
        help="let batch composition change results in the last bits (slightly faster at batch size 1)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--max-draft-tokens", type=int, default=16, help="most draft tokens one request verifies per step")
    p.add_argument(
        "--num-state-slots", type=int, default=EngineConfig.num_state_slots,
        help="hybrid models (Qwen3.5): recurrent-state slots, the most requests computed at once; "
        "their memory comes out of the KV budget (default %(default)s)",
    )
    p.add_argument("--swarm-index", action="store_true", help="also draft from other requests' outputs")
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="recompute every prompt instead of reusing cached KV blocks of equal prefixes",
    )
    p.add_argument(
        "--no-calibration",
        action="store_true",
        help="skip timing forward passes at start-up (the scheduler's cost model then starts from a prior)",
    )
    p.add_argument("--log-format", default="json", choices=LOG_FORMATS)
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--scheduler-token-file",
        default=None,
        help="serve only callers sending 'authorization: Bearer <token>' with a token from this file "
        "(the scheduler's --executor-token-file); health checks stay open (default: no token needed)",
    )
    p.add_argument("--tls-cert", default=None, help="serve over TLS with this certificate (PEM; with --tls-key)")
    p.add_argument("--tls-key", default=None, help="the private key of --tls-cert (PEM)")
    add_observability_flags(p)
    return p


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kernels=args.kernels,
        matmul=args.matmul,
        kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)),
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        batch_invariant=not args.no_batch_invariant,
        num_threads=args.threads,
        max_draft_tokens=args.max_draft_tokens,
        num_state_slots=args.num_state_slots,
        use_swarm_index=args.swarm_index,
        enable_prefix_caching=not args.no_prefix_caching,
    )


async def run(args: argparse.Namespace) -> None:
    telemetry = start_service_telemetry(args, "swarmserve-executor", ExecutorMetrics, "swarmserve.executor")
    engine_thread = engine_thread_pool()  # every OpenMP-parallel call from one thread
    loop = asyncio.get_running_loop()
    engine = await loop.run_in_executor(engine_thread, Engine, config_from_args(args))
    calibration = [] if args.no_calibration else await loop.run_in_executor(engine_thread, engine.calibrate)
    log.info("calibrated", samples=[(c.num_tokens, c.num_kv_tokens, round(c.forward_s * 1e3, 2)) for c in calibration])
    server = await serve(
        engine,
        args.listen,
        calibration,
        tracer=telemetry.tracer,
        metrics=telemetry.metrics,
        scheduler_token_file=args.scheduler_token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        engine_thread=engine_thread,
    )
    log.info(
        "executor_listening",
        address=args.listen,
        model=engine.model_config.name,
        kv_blocks=engine.kv_cache.num_usable_blocks,
        block_size=engine.kv_cache.block_size,
    )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("executor_stopping")
    await server.stop(grace=2.0)
    telemetry.stop()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
