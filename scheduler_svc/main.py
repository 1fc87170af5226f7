"""`swarmserve-scheduler`: serve SchedulerService, driving the executor step by step."""

from __future__ import annotations

import argparse
import asyncio
import signal

import structlog

from scheduler_svc.config import BATCHING_MODES, DEFAULT_HTTP_LISTEN, TOOL_CALL_PARSERS, SchedulerConfig
from scheduler_svc.draft_policy import parse_draft_policy
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.server import serve
from service_common.heap import freeze_startup_heap
from service_common.observability.flags import add_observability_flags
from service_common.observability.logs import LOG_FORMATS, configure_logging
from service_common.observability.service_telemetry import start_service_telemetry

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
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=defaults.max_running_requests,
        help="batch size cap (default %(default)s)",
    )
    p.add_argument(
        "--max-queued-requests", type=int, default=defaults.max_queued_requests, help="queue cap (default %(default)s)"
    )
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
        help="speculative draft budgets: off | fixed:K | even | goodput (default %(default)s)",
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
    p.add_argument(
        "--max-decode-runs",
        type=int,
        default=defaults.max_decode_runs,
        help="a step of decodes only, with no request waiting, runs up to this many times in one call to the "
        "executor: a token per request per run, one round trip (1: a call per token; default %(default)s)",
    )
    p.add_argument(
        "--decode-runs-window-ms",
        type=float,
        default=defaults.decode_runs_window_s * 1e3,
        help="... while the cost model predicts the runs after the first within this many ms: the most "
        "they delay a request that arrives meanwhile (default %(default)s)",
    )
    http = p.add_argument_group("the OpenAI- and Anthropic-compatible HTTP API")
    http.add_argument(
        "--http-listen",
        nargs="?",
        const=DEFAULT_HTTP_LISTEN,
        default=defaults.http_listen,
        help=f"serve /v1/chat/completions, /v1/messages, ... on this address (the flag alone: {DEFAULT_HTTP_LISTEN}; "
        "default: no HTTP)",
    )
    http.add_argument(
        "--max-choices",
        type=int,
        default=defaults.max_choices,
        help="OpenAI's n: completions per request (default %(default)s)",
    )
    http.add_argument(
        "--tool-call-parser",
        default=defaults.tool_call_parser,
        choices=TOOL_CALL_PARSERS,
        help="the model's tool-call syntax: hermes (<tool_call>{json}</tool_call>), llama3 (bare JSON), "
        "none, or auto: picked from the chat template (default %(default)s)",
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
        "--max-chat-messages",
        type=int,
        default=defaults.max_chat_messages,
        help="messages per chat (default %(default)s)",
    )
    limits.add_argument(
        "--max-message-bytes",
        type=int,
        default=defaults.max_message_bytes,
        help="largest gRPC message or HTTP request body the scheduler receives (default %(default)s)",
    )
    limits.add_argument(
        "--max-grammar-bytes",
        type=int,
        default=defaults.max_grammar_bytes,
        help="a structured_output's JSON schema, Lark grammar or regex, in bytes (default %(default)s)",
    )
    limits.add_argument(
        "--max-stop-strings",
        type=int,
        default=defaults.max_stop_strings,
        help="stop strings per request (default %(default)s)",
    )
    limits.add_argument(
        "--max-stop-string-chars",
        type=int,
        default=defaults.max_stop_string_chars,
        help="characters per stop string (default %(default)s)",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=defaults.drain_timeout_s,
        help="on SIGTERM, requests in flight may finish for this long while new ones are refused (default %(default)s)",
    )
    p.add_argument(
        "--executor-reconnect-timeout-s",
        type=float,
        default=defaults.executor_reconnect_timeout_s,
        help="when the executor is lost, streams wait this long for it to come back (0: fail at once; default %(default)s)",
    )
    p.add_argument(
        "--api-key-file",
        default=defaults.api_key_file,
        help="require 'authorization: Bearer <key>' metadata with a key from this file (one per line); "
        "health checks stay open (default: no key needed)",
    )
    p.add_argument(
        "--executor-token-file",
        default=defaults.executor_token_file,
        help="the token the executor requires (the first line of its --scheduler-token-file; default: none)",
    )
    p.add_argument(
        "--tls-cert", default=defaults.tls_cert, help="serve over TLS with this certificate (PEM; with --tls-key)"
    )
    p.add_argument("--tls-key", default=defaults.tls_key, help="the private key of --tls-cert (PEM)")
    p.add_argument(
        "--executor-ca",
        default=defaults.executor_ca,
        help="reach the executor over TLS, verifying its certificate against this CA (PEM; default: in the clear)",
    )
    p.add_argument(
        "--scheduler-id",
        default=defaults.scheduler_id,
        help="how the executor knows this scheduler (default: this host and --listen, the same across restarts)",
    )
    p.add_argument(
        "--take-over",
        action="store_true",
        help="attach even if the executor serves another scheduler, which is then refused (default: refuse to)",
    )
    p.add_argument(
        "--log-format",
        default="auto",
        choices=LOG_FORMATS,
        help="auto: console on a terminal, else JSON lines (default %(default)s)",
    )
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
        executor_reconnect_timeout_s=args.executor_reconnect_timeout_s,
        drain_timeout_s=args.drain_timeout_s,
        scheduler_id=args.scheduler_id,
        api_key_file=args.api_key_file,
        executor_token_file=args.executor_token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        executor_ca=args.executor_ca,
        take_over=args.take_over,
        async_scheduling=args.async_scheduling,
        max_decode_runs=args.max_decode_runs,
        decode_runs_window_s=args.decode_runs_window_ms / 1e3,
        max_retention_s=args.max_retention_s,
        max_id_bytes=args.max_id_bytes,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_string_chars,
        max_prompt_bytes=args.max_prompt_bytes,
        max_chat_messages=args.max_chat_messages,
        max_message_bytes=args.max_message_bytes,
        http_listen=args.http_listen,
        max_choices=args.max_choices,
        tool_call_parser=args.tool_call_parser,
        max_grammar_bytes=args.max_grammar_bytes,
    )


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
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    asyncio.run(run(config_from_args(args), args))


if __name__ == "__main__":
    main()
