"""`swarmserve-scheduler`: serve SchedulerService, driving the executor step by step."""

from __future__ import annotations

import argparse
import asyncio
import signal

import structlog

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.server import serve
from service_common.config_flags import add_config_flags, config_from_flags, config_or_usage_error
from service_common.heap import freeze_startup_heap
from service_common.observability.flags import add_log_flags, add_observability_flags
from service_common.observability.logs import configure_logging
from service_common.observability.service_telemetry import start_service_telemetry

log = structlog.get_logger()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swarmserve-scheduler", description=__doc__)
    add_config_flags(p, SchedulerConfig)
    add_log_flags(p)
    add_observability_flags(p)
    return p


def config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    return config_from_flags(SchedulerConfig, args)


async def run(config: SchedulerConfig, args: argparse.Namespace) -> None:
    telemetry = start_service_telemetry(args, "swarmserve-scheduler", SchedulerMetrics, "swarmserve.scheduler")
    # The HTTP API serves /metrics itself, so it gets the metrics without --metrics-port too.
    metrics = telemetry.metrics or (SchedulerMetrics() if config.http_listen else None)
    server, loop, tasks = await serve(config, tracer=telemetry.tracer, metrics=metrics)
    freeze_startup_heap()
    log.info(
        "scheduler_listening",
        address=config.listen,
        http_address=config.http_listen or None,
        executor=config.executor,
        batching=config.batching,
    )
    stop = asyncio.Event()
    event_loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        event_loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain: refuse new requests (health says NOT_SERVING), let those in flight finish up to the
    # deadline; a second signal stops at once. Whatever is left then ends with UNAVAILABLE.
    stop.clear()
    log.info("scheduler_draining", requests_in_flight=len(loop.streams), drain_timeout_s=config.drain_timeout_s)
    loop.start_draining()
    drained = asyncio.create_task(loop.wait_drained())
    interrupted = asyncio.create_task(stop.wait())
    await asyncio.wait({drained, interrupted}, timeout=config.drain_timeout_s, return_when=asyncio.FIRST_COMPLETED)
    interrupted.cancel()
    log.info("scheduler_stopping", requests_left=len(loop.streams))
    if server.http_server is not None:
        await server.http_server.stop()
    await server.stop(grace=1.0)
    for task in tasks:
        task.cancel()
    await loop.link.close()
    telemetry.stop()


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_or_usage_error(parser, SchedulerConfig, args)
    configure_logging(args.log_format, args.log_level)
    asyncio.run(run(config, args))


if __name__ == "__main__":
    main()
