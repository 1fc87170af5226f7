"""`swarmserve-executor`: load the model and serve ExecutorService over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import signal

import structlog

from executor_svc.engine.calibration_cache import calibrate, default_cache_dir
from executor_svc.engine.engine import Engine
from executor_svc.flags import build_parser, config_from_args
from executor_svc.observability.executor_metrics import ExecutorMetrics
from executor_svc.server import engine_thread_pool, serve
from service_common.heap import freeze_startup_heap
from service_common.observability.logs import configure_logging
from service_common.observability.service_telemetry import start_service_telemetry

log = structlog.get_logger()


async def run(args: argparse.Namespace) -> None:
    telemetry = start_service_telemetry(args, "swarmserve-executor", ExecutorMetrics, "swarmserve.executor")
    engine_thread = engine_thread_pool()  # every OpenMP-parallel call from one thread
    loop = asyncio.get_running_loop()
    config = config_from_args(args)
    engine = await loop.run_in_executor(engine_thread, Engine, config)
    if args.no_calibration:
        calibration, source = [], "off"
    else:  # the one cached for this setup, or measured now (and cached)
        calibration, source = await loop.run_in_executor(
            engine_thread, calibrate, engine.model_runner, default_cache_dir(), config.reuse_calibration
        )
    log.info("calibrated", num_samples=len(calibration), calibration=source)
    log.debug(
        "calibration_samples",
        samples=[(c.num_tokens, c.num_kv_tokens, round(c.forward_s * 1e3, 2)) for c in calibration],
    )
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
    freeze_startup_heap()
    log.info(
        "executor_listening",
        address=args.listen,
        model=engine.model_config.name,
        kv_blocks=engine.kv.num_usable_blocks,
        block_size=engine.kv.block_size,
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
