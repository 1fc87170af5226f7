"""The scheduler's configuration, built from CLI flags and validated once.

Each field that is a flag carries it (its name, help, and unit where the flag counts in
others): `swarmserve-scheduler`'s flags are these, in this order (service_common/config_flags.py).
A field without one (kv_watermark, the executor timeouts, min_prefill_chunk) only code sets.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from scheduler_svc.draft_policy import parse_draft_policy
from service_common.config_flags import MS, TLS_CERT, TLS_KEY, flag

BATCHING_MODES = ("continuous", "static")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3", "none")  # auto: picked from the chat template
DEFAULT_HTTP_LISTEN = "127.0.0.1:8000"  # what `--http-listen` alone and `swarmserve serve` use
MAX_DECODE_RUNS = 64  # the executor's limit on a plan's runs in one call (StepRequest.max_runs)
HTTP_GROUP = "the OpenAI- and Anthropic-compatible HTTP API"
LIMITS_GROUP = "limits on what clients control"


def _draft_policy_text(text: str) -> str:
    """--spec's text, refused at parse time when it names no draft policy."""
    try:
        parse_draft_policy(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


@dataclass(frozen=True)
class SchedulerConfig:
    listen: str = field(
        default="127.0.0.1:50051", metadata=flag("--listen", help="address to serve on (default %(default)s)")
    )
    executor: str = field(
        default="127.0.0.1:50052", metadata=flag("--executor", help="the executor's address (default %(default)s)")
    )
    # Requests in the batch at once.
    max_running_requests: int = field(
        default=16, metadata=flag("--max-running-requests", help="batch size cap (default %(default)s)")
    )
    # Beyond this many requests waiting past the batch's free places, Generate answers RESOURCE_EXHAUSTED.
    max_queued_requests: int = field(
        default=256, metadata=flag("--max-queued-requests", help="queue cap (default %(default)s)")
    )
    # None: the executor's preferred step size (GetInfoResponse.preferred_step_tokens).
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=flag(
            "--max-num-batched-tokens",
            help="tokens computed per step, decodes first then prefill chunks (default: the executor's preference, "
            "1024 under --matmul bf16, else 256)",
        ),
    )
    # static: fixed membership until every member finishes.
    batching: str = field(default="continuous", metadata=flag("--batching", choices=BATCHING_MODES))
    # When a request names none (capped by the context).
    default_max_new_tokens: int = field(default=1024, metadata=flag("--default-max-new-tokens"))
    kv_watermark: float = 0.01  # fraction of KV blocks admission keeps free for running decodes
    spec: str = field(
        default="goodput",
        metadata=flag(
            "--spec",
            type=_draft_policy_text,
            help="speculative draft budgets: off | fixed:K | even | goodput (default %(default)s)",
        ),
    )
    # The cost model's prediction.
    # Off by default: measured with 4 agents streaming while a 2,000-token prompt arrived (2-core Zen 4,
    # load ~5), a 150 ms target cut the agents' longest gap from ~530 to ~300 ms but made the
    # newcomer's time to first token 1.6-2.2x longer; a swarm's turns are mostly prompt.
    decode_latency_target_s: float | None = field(
        default=None,
        metadata=flag(
            "--decode-latency-target-ms",
            unit=MS,
            help=(
                "while requests decode, cap prefill chunks so the cost model predicts each step within this "
                "many ms, but give a prefill at least half of each step (default: no cap; 0 also means none)"
            ),
        ),
    )
    # ... but never below this, so prefills always progress, and at a size the prompt kernel runs well: with
    # 16, a busy machine (its calibration slow) cut a 3,000-token prompt into 16-token steps, 3.7x its TTFT.
    min_prefill_chunk: int = 64
    # Overlapped scheduling: build and send step N+1 while the executor runs step N (two steps in flight).
    # Off by default: on a CPU-only box the scheduler's overlapped work takes the executor's cores (README).
    async_scheduling: bool = field(
        default=False,
        metadata=flag(
            "--async-scheduling",
            both_ways=True,
            help="overlapped scheduling: plan and send step N+1 while the executor runs step N (default %(default)s)",
        ),
    )
    # A plan of decodes only, with no request waiting, runs up to this many times in one Step RPC
    # (a token per request per run; 1: an RPC per token), while the cost model predicts the runs
    # after the first within `decode_runs_window_s`: the most they delay a request that arrives.
    max_decode_runs: int = field(
        default=4,
        metadata=flag(
            "--max-decode-runs",
            help="a step of decodes only, with no request waiting, runs up to this many times in one call to the "
            "executor: a token per request per run, one round trip (1: a call per token; default %(default)s)",
        ),
    )
    decode_runs_window_s: float = field(
        default=0.1,
        metadata=flag(
            "--decode-runs-window-ms",
            unit=MS,
            help="... while the cost model predicts the runs after the first within this many ms: the most "
            "they delay a request that arrives meanwhile (default %(default)s)",
        ),
    )
    # The OpenAI- and Anthropic-compatible HTTP API (scheduler_svc/http_api), in this process. Empty: off.
    http_listen: str = field(
        default="",
        metadata=flag(
            "--http-listen",
            nargs="?",
            const=DEFAULT_HTTP_LISTEN,
            group=HTTP_GROUP,
            help=f"serve /v1/chat/completions, /v1/messages, ... on this address (the flag alone: "
            f"{DEFAULT_HTTP_LISTEN}; default: no HTTP)",
        ),
    )
    max_choices: int = field(
        default=8,
        metadata=flag(
            "--max-choices", group=HTTP_GROUP, help="OpenAI's n: completions per request (default %(default)s)"
        ),
    )
    tool_call_parser: str = field(
        default="auto",
        metadata=flag(
            "--tool-call-parser",
            choices=TOOL_CALL_PARSERS,
            group=HTTP_GROUP,
            help="the model's tool-call syntax: hermes (<tool_call>{json}</tool_call>), llama3 (bare JSON), "
            "none, or auto: picked from the chat template (default %(default)s)",
        ),
    )
    # /v1/messages always clamps (Claude Code asks for 64000 whatever the model); OpenAI clients that
    # do the same (agent frameworks' fixed defaults) need this.
    clamp_max_tokens: bool = field(
        default=False,
        metadata=flag(
            "--clamp-max-tokens",
            group=HTTP_GROUP,
            help="on the OpenAI routes, cut a max_tokens beyond what the prompt leaves of the context to fit "
            "instead of refusing it, as /v1/messages always does (default: refuse)",
        ),
    )
    # Server-side limits on what a client controls (checked at intake, before any expensive work).
    max_retention_s: float = field(
        default=600.0,
        metadata=flag(
            "--max-retention-s",
            group=LIMITS_GROUP,
            help="a session's retention_s is clamped to this many seconds (default %(default)s)",
        ),
    )
    # request_id and session_id are re-sent in every step, copied into logs and timelines.
    max_id_bytes: int = field(
        default=128,
        metadata=flag(
            "--max-id-bytes",
            group=LIMITS_GROUP,
            help="longest request_id / session_id in bytes (default %(default)s)",
        ),
    )
    max_prompt_bytes: int = field(
        default=1 << 20,
        metadata=flag(
            "--max-prompt-bytes",
            group=LIMITS_GROUP,
            help="a text prompt, or all chat messages together, in UTF-8 bytes (default %(default)s)",
        ),
    )
    max_chat_messages: int = field(
        default=2048,
        metadata=flag("--max-chat-messages", group=LIMITS_GROUP, help="messages per chat (default %(default)s)"),
    )
    max_message_bytes: int = field(
        default=4 << 20,
        metadata=flag(
            "--max-message-bytes",
            group=LIMITS_GROUP,
            help="largest gRPC message or HTTP request body the scheduler receives (default %(default)s)",
        ),
    )
    max_grammar_bytes: int = field(
        default=256 << 10,
        metadata=flag(
            "--max-grammar-bytes",
            group=LIMITS_GROUP,
            help="a structured_output's JSON schema, Lark grammar or regex, in bytes (default %(default)s)",
        ),
    )
    max_stop_strings: int = field(
        default=16,
        metadata=flag("--max-stop-strings", group=LIMITS_GROUP, help="stop strings per request (default %(default)s)"),
    )
    max_stop_string_chars: int = field(
        default=256,
        metadata=flag(
            "--max-stop-string-chars", group=LIMITS_GROUP, help="characters per stop string (default %(default)s)"
        ),
    )
    # deploy's stop grace matches.
    drain_timeout_s: float = field(
        default=30.0,
        metadata=flag(
            "--drain-timeout-s",
            help="on SIGTERM, requests in flight may finish for this long while new ones are refused "
            "(default %(default)s)",
        ),
    )
    executor_timeout_s: float = 60.0  # one Step RPC
    connect_timeout_s: float = 2.0  # one connection attempt to the executor
    executor_reconnect_timeout_s: float = field(
        default=60.0,
        metadata=flag(
            "--executor-reconnect-timeout-s",
            help="when the executor is lost, streams wait this long for it to come back "
            "(0: fail at once; default %(default)s)",
        ),
    )
    api_key_file: str | None = field(
        default=None,
        metadata=flag(
            "--api-key-file",
            help="require 'authorization: Bearer <key>' metadata with a key from this file (one per line); "
            "health checks stay open (default: no key needed)",
        ),
    )
    executor_token_file: str | None = field(
        default=None,
        metadata=flag(
            "--executor-token-file",
            help="the token the executor requires (the first line of its --scheduler-token-file; default: none)",
        ),
    )
    tls_cert: str | None = field(default=None, metadata=TLS_CERT)
    tls_key: str | None = field(default=None, metadata=TLS_KEY)
    executor_ca: str | None = field(
        default=None,
        metadata=flag(
            "--executor-ca",
            help="reach the executor over TLS, verifying its certificate against this CA (PEM; default: in the clear)",
        ),
    )
    # Empty: this host and the listen address (stable across restarts).
    scheduler_id: str = field(
        default="",
        metadata=flag(
            "--scheduler-id",
            help="how the executor knows this scheduler (default: this host and --listen, the same across restarts)",
        ),
    )
    take_over: bool = field(
        default=False,
        metadata=flag(
            "--take-over",
            help="attach even if the executor serves another scheduler, which is then refused (default: refuse to)",
        ),
    )

    def __post_init__(self) -> None:
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {BATCHING_MODES}, got {self.batching!r}")
        for name in (
            "max_running_requests",
            "max_queued_requests",
            "max_num_batched_tokens",
            "default_max_new_tokens",
            "max_id_bytes",
            "max_stop_strings",
            "max_stop_string_chars",
            "max_prompt_bytes",
            "max_chat_messages",
            "max_message_bytes",
            "max_choices",
            "max_grammar_bytes",
            "max_decode_runs",
        ):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        parse_draft_policy(self.spec)  # raises a ValueError naming the bad value
        if self.decode_latency_target_s is not None and not (
            math.isfinite(self.decode_latency_target_s) and self.decode_latency_target_s >= 0
        ):
            raise ValueError(f"decode_latency_target_s must be >= 0 (0: no cap), got {self.decode_latency_target_s}")
        if self.max_decode_runs > MAX_DECODE_RUNS:
            raise ValueError(f"max_decode_runs must be at most {MAX_DECODE_RUNS}, got {self.max_decode_runs}")
        if not (math.isfinite(self.decode_runs_window_s) and self.decode_runs_window_s >= 0):
            raise ValueError(f"decode_runs_window_s must be a finite number >= 0, got {self.decode_runs_window_s}")
        if not (math.isfinite(self.drain_timeout_s) and self.drain_timeout_s >= 0):
            raise ValueError(f"drain_timeout_s must be a finite number >= 0, got {self.drain_timeout_s}")
        if not (math.isfinite(self.executor_reconnect_timeout_s) and self.executor_reconnect_timeout_s >= 0):
            raise ValueError(
                f"executor_reconnect_timeout_s must be a finite number >= 0, got {self.executor_reconnect_timeout_s}"
            )
        if self.min_prefill_chunk <= 0:
            raise ValueError(f"min_prefill_chunk must be positive, got {self.min_prefill_chunk}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both tls_cert and tls_key")
        if self.max_message_bytes <= self.max_prompt_bytes:
            raise ValueError(
                f"max_message_bytes ({self.max_message_bytes}) must exceed max_prompt_bytes ({self.max_prompt_bytes}), "
                "or a prompt within its limit could not be received"
            )
        if not (math.isfinite(self.max_retention_s) and self.max_retention_s >= 0):
            raise ValueError(f"max_retention_s must be a finite number >= 0, got {self.max_retention_s}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.http_listen:
            host, sep, port = self.http_listen.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
                raise ValueError(f"http_listen must be HOST:PORT, got {self.http_listen!r}")
        if not 0.0 <= self.kv_watermark < 1.0:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark}")
