"""`swarmserve`: generate, chat, info and serve from the command line.

Exit status: 0 done, 1 the server (or startup) failed -- its status code and message on
stderr as `error: CODE: message` --, 2 usage error, 130 interrupted with Ctrl-C (the
request is cancelled on the server before exiting).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import sys
from typing import Any

from clients import timeline
from clients.bench import batching as bench_batching
from clients.bench import http_overhead as bench_http
from clients.bench import overlap as bench_overlap
from clients.bench import restart as bench_restart
from clients.bench import scaleout as bench_scaleout
from clients.bench import speculation as bench_speculation
from clients.bench import swarm as bench_swarm
from clients.bench import tracing as bench_tracing
from clients.bench import vs_llama_cpp as bench_vs
from clients.cli_output import completion_to_json, format_error, format_serve_banner, format_summary
from clients.client import DEFAULT_SCHEDULER_ADDRESS
from clients.completion import Completion, collect_completion
from clients.errors import SwarmServeError
from clients.events import TokenEvent
from clients.serve import ServeConfig, ServeError, Supervisor, executor_command, scheduler_command, split_service_flags
from clients.serve_fleet import GATEWAY_POLICIES, GATEWAYS, Fleet, FleetConfig
from clients.sync_client import SwarmClient
from executor_svc.flags import build_parser as executor_parser
from executor_svc.flags import config_from_args as executor_config
from scheduler_svc.main import build_parser as scheduler_parser
from scheduler_svc.main import config_from_args as scheduler_config

EXIT_ERROR = 1  # usage errors exit with argparse's 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it

CHAT_EXIT_COMMANDS = ("/exit", "/quit")
CHAT_PROMPT = ">>> "


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _token_ids(text: str) -> list[int]:
    """`1,2,3` or `1 2 3` -> [1, 2, 3]."""
    try:
        ids = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError("token ids must be >= 0")
    return ids


def _add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=DEFAULT_SCHEDULER_ADDRESS, help="scheduler address (default %(default)s)")
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=None,
        help="deadline in seconds for the whole call (default: none)",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        help="a file whose first line is the API key, for a scheduler started with --api-key-file",
    )
    parser.add_argument("--tls-ca", default=None, help="reach the scheduler over TLS, verified against this CA (PEM)")


def _api_key(args: argparse.Namespace) -> str | None:
    if not args.api_key_file:
        return None
    with open(args.api_key_file) as f:
        return f.readline().strip() or None


def _add_request_flags(parser: argparse.ArgumentParser) -> None:
    """The sampling and stopping flags; unset ones are not sent, so the server's defaults apply."""
    _add_connection_flags(parser)
    parser.add_argument(
        "--max-new-tokens",
        type=_non_negative_int,
        default=None,
        help="most tokens to generate (default: the server's)",
    )
    parser.add_argument("--temperature", type=float, default=None, help="0 is greedy (default: the server's, 1)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--seed", type=_non_negative_int, default=None, help="sampling seed, for reproducible sampling")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="sample EOS like any token; it does not end the request",
    )
    parser.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="STR",
        help="stop string (repeatable); not included in the output",
    )
    grammar = parser.add_mutually_exclusive_group()
    grammar.add_argument("--json-schema", metavar="FILE", default=None, help="constrain the output to this JSON schema")
    grammar.add_argument("--json-object", action="store_true", help="constrain the output to a JSON object")
    grammar.add_argument(
        "--lark", metavar="FILE", default=None, help="constrain the output to this llguidance Lark grammar"
    )
    grammar.add_argument("--regex", metavar="PATTERN", default=None, help="constrain the output to this regex")
    parser.add_argument(
        "--include-special-tokens",
        action="store_true",
        help="keep special tokens (e.g. <|im_end|>) in the text",
    )
    parser.add_argument(
        "--request-id",
        default=None,
        help="request id (default: the server assigns one); lets another process abort it",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with the result at the end, and nothing else on stdout",
    )


BENCHES = (
    ("batching", bench_batching, "8 agents, 40…900 output tokens each: static vs continuous batching"),
    ("spec", bench_speculation, "draft policies x live batch size x workload: accepted tokens/s"),
    ("swarm", bench_swarm, "agents x turns with a shared system prompt, tool pauses and copy-heavy turns"),
    ("overlap", bench_overlap, "scheduler + RPC share of each step, sync vs overlapped scheduling; cost-model error"),
    ("tracing", bench_tracing, "per-step overhead of tracing on vs off"),
    (
        "restart",
        bench_restart,
        "executor restart: time to listen and serve, kill to first resumed token, idle or loaded",
    ),
    ("http", bench_http, "the HTTP front's overhead per token against gRPC, at 1 and 16 streams"),
    ("vs", bench_vs, "swarmserve vs llama.cpp's llama-server on the same GGUF: tok/s and resident memory"),
    (
        "scaleout",
        bench_scaleout,
        "1 pair vs 2 pairs vs 2 pairs behind SMG (cache_aware, round_robin): req/s, prefix hits, gateway latency",
    ),
)


def _add_request_commands(commands) -> None:
    """generate and chat: one request (or a chat) against a running scheduler."""
    generate = commands.add_parser("generate", help="complete a raw-text prompt, streaming the text")
    generate.add_argument(
        "prompt",
        nargs="?",
        default=None,
        metavar="PROMPT",
        help="raw text, tokenized as is; '-' reads it from stdin",
    )
    generate.add_argument(
        "--token-ids",
        type=_token_ids,
        default=None,
        metavar="IDS",
        help="an already tokenized prompt instead of PROMPT: 1,2,3",
    )
    _add_request_flags(generate)
    generate.set_defaults(run=_run_generate)

    chat = commands.add_parser("chat", help="chat with the model: a REPL on stdin, or one turn with --message")
    chat.add_argument("--system", default=None, metavar="TEXT", help="system message")
    chat.add_argument(
        "--message",
        default=None,
        metavar="TEXT",
        help="one user message; answer it and exit instead of reading stdin",
    )
    _add_request_flags(chat)
    chat.set_defaults(run=_run_chat)


def _add_inspection_commands(commands) -> None:
    """info and timeline: what a running scheduler reports."""
    info = commands.add_parser("info", help="print the scheduler's GetServerInfo as JSON")
    _add_connection_flags(info)
    info.set_defaults(run=_run_info)

    timeline_command = commands.add_parser(
        "timeline", help="write the scheduler's recent steps as a Chrome trace (JSON) and a PNG"
    )
    timeline.add_arguments(timeline_command)
    timeline_command.set_defaults(run=timeline.run)


def _add_bench_commands(commands) -> None:
    """bench <name>: benchmarks that start their own services."""
    bench = commands.add_parser("bench", help="benchmarks that start their own services")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, module, help_text in BENCHES:
        command = benches.add_parser(name, help=help_text)
        module.add_arguments(command)
        command.set_defaults(run=module.run)


def _add_serve_command(commands) -> None:
    serve = commands.add_parser(
        "serve",
        allow_abbrev=False,  # --executor (the scheduler's flag) must not pass for --executor-listen
        help="start the executor and the scheduler and supervise them until Ctrl-C",
        description="Start the executor and the scheduler and supervise them until Ctrl-C.",
        epilog="Any other flag of swarmserve-executor or swarmserve-scheduler (see their --help) is passed "
        "to the service that defines it, or to both when both do (e.g. --log-format, --max-num-batched-tokens); "
        "e.g. swarmserve serve --model m.gguf --kv-cache-gb 2 --spec off.",
    )
    defaults = ServeConfig()
    serve.add_argument(
        "--executor-listen",
        default=defaults.executor_listen,
        metavar="ADDR",
        help="(default %(default)s)",
    )
    serve.add_argument(
        "--scheduler-listen",
        default=defaults.scheduler_listen,
        metavar="ADDR",
        help="(default %(default)s)",
    )
    serve.add_argument(
        "--http-listen",
        default=defaults.http_listen,
        metavar="ADDR",
        help="the scheduler's OpenAI/Anthropic-compatible HTTP API; '' turns it off (default %(default)s)",
    )
    serve.add_argument(
        "--metrics-port",
        type=_positive_int,
        default=defaults.metrics_port,
        metavar="PORT",
        help="Prometheus metrics: the scheduler on PORT, the executor on PORT+1 (default: off)",
    )
    serve.add_argument(
        "--startup-timeout",
        type=_positive_float,
        default=defaults.startup_timeout_s,
        metavar="S",
        help="seconds each server may take to become ready (default %(default)g)",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=defaults.shutdown_grace_s,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL (default %(default)g)",
    )
    fleet = FleetConfig(ServeConfig())
    serve.add_argument(
        "--replicas",
        type=_positive_int,
        default=1,
        metavar="N",
        help="executor+scheduler pairs, each on its own ports, behind --gateway (default %(default)s)",
    )
    serve.add_argument(
        "--gateway",
        choices=GATEWAYS,
        default=None,
        help="start this gateway on --http-listen in front of the pairs' HTTP APIs "
        "(smg: the Shepherd Model Gateway, `pip install smg`); needed with --replicas above 1",
    )
    serve.add_argument(
        "--gateway-policy",
        choices=GATEWAY_POLICIES,
        default=fleet.gateway_policy,
        help="the gateway's routing policy (default %(default)s: an agent's turns go to the pair holding its prefix)",
    )
    serve.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more `smg launch` argument, repeatable, e.g. --gateway-arg=--routing-key-headers --gateway-arg=x-session-id",
    )
    serve.set_defaults(run=_run_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmserve", description="swarmserve: serve a model, or generate from a running server."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_request_commands(commands)
    _add_inspection_commands(commands)
    _add_bench_commands(commands)
    _add_serve_command(commands)
    return parser


def serve_config(args: argparse.Namespace, service_flags: list[str]) -> ServeConfig | FleetConfig:
    """serve's own flags and the services' flags (`service_flags`, routed to their service);
    a FleetConfig with a gateway in front when there is one."""
    executor_args, scheduler_args = split_service_flags(service_flags)
    config = ServeConfig(
        executor_listen=args.executor_listen,
        scheduler_listen=args.scheduler_listen,
        http_listen=args.http_listen,
        executor_args=tuple(executor_args),
        scheduler_args=tuple(scheduler_args),
        metrics_port=args.metrics_port,
        startup_timeout_s=args.startup_timeout,
        shutdown_grace_s=args.shutdown_grace,
    )
    if args.gateway is None:
        if args.replicas > 1:
            raise ValueError("--replicas above 1 needs a gateway in front: add --gateway smg")
        return config
    return FleetConfig(config, args.replicas, args.gateway, args.gateway_policy, gateway_args=tuple(args.gateway_arg))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line; a usage error exits with status 2."""
    parser = build_parser()
    args, service_flags = parser.parse_known_args(argv)
    if service_flags and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(service_flags)}")
    if args.command in ("generate", "chat"):
        args.stop = args.stop or []
        try:
            args.structured_output = structured_output(args)
        except OSError as error:
            parser.error(f"{args.command}: cannot read the grammar file: {error}")
    if args.command == "generate" and (args.prompt is None) == (args.token_ids is None):
        parser.error("generate: give exactly one of PROMPT or --token-ids")
    if args.command == "serve":
        try:
            args.config = serve_config(args, service_flags)
        except ValueError as error:
            parser.error(f"serve: {error}")
        # Each service checks its own flags and config now, not after the other has started.
        pair = args.config.base if isinstance(args.config, FleetConfig) else args.config
        for name, service_parser, config_from_args, command in (
            ("executor", executor_parser(), executor_config, executor_command(pair)),
            ("scheduler", scheduler_parser(), scheduler_config, scheduler_command(pair)),
        ):
            try:
                config_from_args(service_parser.parse_args(command[3:]))
            except ValueError as error:
                parser.error(f"serve: the {name}: {error}")
    return args


def structured_output(args: argparse.Namespace) -> dict[str, Any] | None:
    """The grammar flag given, read from its file where it names one (None: no constraint)."""
    if args.json_schema:
        with open(args.json_schema) as f:
            return {"json_schema": f.read()}
    if args.lark:
        with open(args.lark) as f:
            return {"lark": f.read()}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.json_object:
        return {"json_object": True}
    return None


def request_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The client keyword arguments the request flags stand for (None: not given)."""
    return {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
        "stop": list(args.stop),
        "ignore_eos": args.ignore_eos,
        "include_special_tokens": args.include_special_tokens,
        "request_id": args.request_id,
        "structured_output": args.structured_output,
    }


def _stream_turn(client: SwarmClient, args: argparse.Namespace, *, is_chat: bool, **prompt: Any) -> Completion:
    """Run one request: stream its text to stdout (or keep quiet for --json), then report it."""
    events = []
    with client.generate(**prompt, **request_kwargs(args)) as stream:
        for event in stream:
            events.append(event)
            if isinstance(event, TokenEvent) and event.text and not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
    completion = collect_completion(stream.request_id or "", events)
    if args.json:
        print(json.dumps(completion_to_json(completion)), flush=True)
    else:
        # End the line for the terminal (and between chat turns); a pipe gets the text exactly.
        if (is_chat or sys.stdout.isatty()) and not completion.text.endswith("\n"):
            sys.stdout.write("\n")
            sys.stdout.flush()
        print(format_summary(completion), file=sys.stderr, flush=True)
    return completion


def _run_generate(args: argparse.Namespace) -> int:
    if args.token_ids is not None:
        prompt: dict[str, Any] = {"token_ids": args.token_ids}
    else:
        prompt = {"prompt": sys.stdin.read() if args.prompt == "-" else args.prompt}
    with SwarmClient(args.server, timeout=args.timeout, api_key=_api_key(args), tls_ca=args.tls_ca) as client:
        _stream_turn(client, args, is_chat=False, **prompt)
    return 0


def _run_chat(args: argparse.Namespace) -> int:
    """A conversation: each user line is a turn, the reply joins the history.

    Interactively, a failed turn is reported and dropped and the REPL goes on; with
    piped input the script stops there, since later lines assumed that reply.
    """
    history = [{"role": "system", "content": args.system}] if args.system is not None else []
    with SwarmClient(args.server, timeout=args.timeout, api_key=_api_key(args), tls_ca=args.tls_ca) as client:
        if args.message is not None:
            _stream_turn(client, args, is_chat=True, messages=[*history, {"role": "user", "content": args.message}])
            return 0
        is_interactive = sys.stdin.isatty()
        num_failed_turns = 0
        while True:
            if is_interactive:
                sys.stderr.write(CHAT_PROMPT)
                sys.stderr.flush()
            line = sys.stdin.readline()
            if not line:  # EOF / Ctrl-D
                if is_interactive:
                    sys.stderr.write("\n")
                break
            text = line.rstrip("\r\n")
            if text.strip() in CHAT_EXIT_COMMANDS:
                break
            if not text.strip():
                continue
            turn = [*history, {"role": "user", "content": text}]
            try:
                completion = _stream_turn(client, args, is_chat=True, messages=turn)
            except SwarmServeError as error:
                print(format_error(error), file=sys.stderr, flush=True)
                if not is_interactive:
                    return EXIT_ERROR
                num_failed_turns += 1
                continue
            history = [*turn, {"role": "assistant", "content": completion.text}]
    return EXIT_ERROR if num_failed_turns else 0


def _run_info(args: argparse.Namespace) -> int:
    with SwarmClient(args.server, timeout=args.timeout, api_key=_api_key(args), tls_ca=args.tls_ca) as client:
        info = client.server_info()
    print(json.dumps(dataclasses.asdict(info), indent=2), flush=True)
    return 0


async def _serve(config: ServeConfig | FleetConfig) -> int:
    supervisor = Fleet(config) if isinstance(config, FleetConfig) else Supervisor(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, supervisor.request_stop)
    try:
        ready = await supervisor.start()
        child_exit = None
        if ready is not None:
            print(format_serve_banner(ready.model_name, ready.addresses(supervisor.config)), flush=True)
            child_exit = await supervisor.wait()
        if child_exit is None:
            print("swarmserve: stopping", file=sys.stderr, flush=True)
    except ServeError as error:
        print(format_error(error), file=sys.stderr, flush=True)
        return EXIT_ERROR
    finally:
        await supervisor.stop()
    if child_exit is not None:
        print(f"error: the {child_exit.describe()}; stopped the other servers", file=sys.stderr, flush=True)
        return EXIT_ERROR
    print("swarmserve: stopped", file=sys.stderr, flush=True)
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    return asyncio.run(_serve(args.config))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return args.run(args)
    except SwarmServeError as error:
        print(format_error(error), file=sys.stderr, flush=True)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("\ncancelled", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`| head`): the request was cancelled on the way out;
        # point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except (TimeoutError, ValueError) as error:
        print(format_error(error), file=sys.stderr, flush=True)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
