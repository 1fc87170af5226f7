"""`swarmserve-executor`: load the model and serve ExecutorService over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import signal
import time

import structlog

from executor_svc.config import EngineConfig
from executor_svc.engine.calibration_cache import calibrate, default_cache_dir
from executor_svc.engine.engine import Engine
from executor_svc.flags import build_parser
from executor_svc.observability.executor_metrics import ExecutorMetrics
from executor_svc.server import engine_thread_pool, start_server
from service_common.config_flags import config_or_usage_error
from service_common.heap import freeze_startup_heap
from service_common.observability.logs import configure_logging
from service_common.observability.service_telemetry import start_service_telemetry

log = structlog.get_logger()


async def run(args: argparse.Namespace, config: EngineConfig) -> None:
    """Listen first (health NOT_SERVING: a scheduler waiting for this executor sees it is on its
    way), then build the engine and calibrate it (or reuse the calibration cached for this setup),
    then serve."""
    t0 = time.monotonic()
    telemetry = start_service_telemetry(args, "swarmserve-executor", ExecutorMetrics, "swarmserve.executor")
    engine_thread = engine_thread_pool()  # every OpenMP-parallel call from one thread
    loop = asyncio.get_running_loop()
    starting = await start_server(
        args.listen,
        tracer=telemetry.tracer,
        metrics=telemetry.metrics,
        scheduler_token_file=args.scheduler_token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        engine_thread=engine_thread,
    )
    listen_s = time.monotonic() - t0
    log.info("executor_listening", address=args.listen, state="starting")
    engine = await loop.run_in_executor(engine_thread, Engine, config)
    engine_s = time.monotonic() - t0 - listen_s
    if args.no_calibration:
        calibration, source = [], "off"
    else:  # the one cached for this setup, or measured now (and cached)
        calibration, source = await loop.run_in_executor(
            engine_thread, calibrate, engine.model_runner, default_cache_dir(), config.reuse_calibration
        )
    calibration_s = time.monotonic() - t0 - listen_s - engine_s
    log.debug(
        "calibration_samples",
        samples=[(c.num_tokens, c.num_attention_pairs, round(c.forward_s * 1e3, 2)) for c in calibration],
    )
    await starting.ready(engine, calibration)
    freeze_startup_heap()
    log.info(
        "executor_ready",
        address=args.listen,
        model=engine.model_config.name,
        kv_blocks=engine.kv.num_usable_blocks,
        block_size=engine.kv.block_size,
        calibration=source,
        num_calibration_samples=len(calibration),
        listen_s=round(listen_s, 3),
        engine_s=round(engine_s, 3),
        calibration_s=round(calibration_s, 3),
        ready_s=round(time.monotonic() - t0, 3),
    )
    server = starting.server
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("executor_stopping")
    await server.stop(grace=2.0)
    telemetry.stop()


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_or_usage_error(parser, EngineConfig, args)
    configure_logging(args.log_format, args.log_level)
    asyncio.run(run(args, config))


if __name__ == "__main__":
    main()
