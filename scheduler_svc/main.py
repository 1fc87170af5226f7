"""`swarmserve-scheduler`: serve SchedulerService, driving the executor step by step."""

from __future__ import annotations

import argparse
import asyncio
import signal

import structlog

from executor_svc.observability.flags import add_observability_flags
from executor_svc.observability.logs import LOG_FORMATS, configure_logging
from executor_svc.observability.service_telemetry import start_service_telemetry
from scheduler_svc.config import BATCHING_MODES, SchedulerConfig
from scheduler_svc.draft_policy import parse_draft_policy
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.server import serve

log = structlog.get_logger()


def _draft_policy_text(text: str) -> str:
    try:
        parse_draft_policy(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    defaults = SchedulerConfig()
    p = argparse.ArgumentParser(prog="swarmserve-scheduler", description=__doc__)
    p.add_argument("--listen", default=defaults.listen, help="address to serve on (default %(default)s)")
    p.add_argument("--executor", default=defaults.executor, help="the executor's address (default %(default)s)")
    p.add_argument("--max-running-requests", type=int, default=defaults.max_running_requests, help="batch size cap (default %(default)s)")
    p.add_argument("--max-queued-requests", type=int, default=defaults.max_queued_requests, help="queue cap (default %(default)s)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults.max_num_batched_tokens,
        help="tokens computed per step, decodes first then prefill chunks (default %(default)s)",
    )
    p.add_argument("--batching", default=defaults.batching, choices=BATCHING_MODES)
    p.add_argument("--default-max-new-tokens", type=int, default=defaults.default_max_new_tokens)
    p.add_argument(
        "--spec",
        type=_draft_policy_text,
        default=defaults.spec,
        help="speculative draft budgets: off | fixed:K | seed | goodput (default %(default)s)",
    )
    p.add_argument(
        "--decode-latency-target-ms",
        type=float,
        default=None,
        help="cap prefill chunks so the cost model predicts each step within this many ms",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=defaults.async_scheduling,
        help="overlapped scheduling: plan and send step N+1 while the executor runs step N (default %(default)s)",
    )
    limits = p.add_argument_group("limits on what clients control")
    limits.add_argument(
        "--max-retention-s",
        type=float,
        default=defaults.max_retention_s,
        help="a session's retention_s is clamped to this many seconds (default %(default)s)",
    )
    limits.add_argument(
        "--max-id-bytes",
        type=int,
        default=defaults.max_id_bytes,
        help="longest request_id / session_id in bytes (default %(default)s)",
    )
    limits.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=defaults.max_prompt_bytes,
        help="a text prompt, or all chat messages together, in UTF-8 bytes (default %(default)s)",
    )
    limits.add_argument(
        "--max-chat-messages", type=int, default=defaults.max_chat_messages, help="messages per chat (default %(default)s)"
    )
    limits.add_argument(
        "--max-message-bytes",
        type=int,
        default=defaults.max_message_bytes,
        help="largest gRPC message the scheduler receives (default %(default)s)",
    )
    limits.add_argument(
        "--max-stop-strings", type=int, default=defaults.max_stop_strings, help="stop strings per request (default %(default)s)"
    )
    limits.add_argument(
        "--max-stop-string-chars",
        type=int,
        default=defaults.max_stop_string_chars,
        help="characters per stop string (default %(default)s)",
    )
    p.add_argument("--log-format", default="json", choices=LOG_FORMATS)
    p.add_argument("--log-level", default="info")
    add_observability_flags(p)
    return p


def config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        listen=args.listen,
        executor=args.executor,
        max_running_requests=args.max_running_requests,
        max_queued_requests=args.max_queued_requests,
        max_num_batched_tokens=args.max_num_batched_tokens,
        batching=args.batching,
        default_max_new_tokens=args.default_max_new_tokens,
        spec=args.spec,
        decode_latency_target_s=None if args.decode_latency_target_ms is None else args.decode_latency_target_ms / 1e3,
        async_scheduling=args.async_scheduling,
        max_retention_s=args.max_retention_s,
        max_id_bytes=args.max_id_bytes,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_string_chars,
        max_prompt_bytes=args.max_prompt_bytes,
        max_chat_messages=args.max_chat_messages,
        max_message_bytes=args.max_message_bytes,
    )


async def run(config: SchedulerConfig, args: argparse.Namespace) -> None:
    telemetry = start_service_telemetry(args, "swarmserve-scheduler", SchedulerMetrics, "swarmserve.scheduler")
    server, loop, tasks = await serve(config, tracer=telemetry.tracer, metrics=telemetry.metrics)
    log.info("scheduler_listening", address=config.listen, executor=config.executor, batching=config.batching)
    stop = asyncio.Event()
    event_loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        event_loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("scheduler_stopping")
    await server.stop(grace=1.0)
    for task in tasks:
        task.cancel()
    await loop.link.close()
    telemetry.stop()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    asyncio.run(run(config_from_args(args), args))


if __name__ == "__main__":
    main()
