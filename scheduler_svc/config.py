"""The scheduler's configuration, built from CLI flags and validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler_svc.draft_policy import parse_draft_policy

BATCHING_MODES = ("continuous", "static")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3", "none")  # auto: picked from the chat template
DEFAULT_HTTP_LISTEN = "127.0.0.1:8000"  # what `--http-listen` alone and `swarmserve serve` use
MAX_DECODE_RUNS = 64  # the executor's limit on a plan's runs in one call (StepRequest.max_runs)


@dataclass(frozen=True)
class SchedulerConfig:
    listen: str = "127.0.0.1:50051"
    executor: str = "127.0.0.1:50052"
    max_running_requests: int = 16  # requests in the batch at once
    max_queued_requests: int = 256  # beyond this Generate answers RESOURCE_EXHAUSTED
    max_num_batched_tokens: int = 256  # tokens computed per step: decodes first, then prefill chunks
    batching: str = "continuous"  # continuous | static (fixed membership until every member finishes)
    default_max_new_tokens: int = 1024  # when a request names none (capped by the context)
    kv_watermark: float = 0.01  # fraction of KV blocks admission keeps free for running decodes
    executor_timeout_s: float = 60.0  # one Step RPC
    executor_reconnect_timeout_s: float = 60.0  # streams wait this long for a lost executor (0: fail at once)
    drain_timeout_s: float = (
        30.0  # on SIGTERM, requests in flight may finish for this long (deploy's stop grace matches)
    )
    connect_timeout_s: float = 2.0  # one connection attempt to the executor
    spec: str = "goodput"  # draft budgets: off | fixed:K | even | goodput
    decode_latency_target_s: float | None = None  # cap prefill chunks so a step stays within this (cost model)
    min_prefill_chunk: int = 16  # ... but never below this, so prefills always progress
    scheduler_id: str = ""  # how the executor knows this scheduler; empty: host/listen address (stable across restarts)
    take_over: bool = False  # attach even if the executor serves another scheduler, retiring it
    api_key_file: str | None = None  # require 'authorization: Bearer <key>' with a key from this file
    executor_token_file: str | None = None  # the token the executor requires (its --scheduler-token-file)
    tls_cert: str | None = None  # serve over TLS with this certificate (PEM) ...
    tls_key: str | None = None  # ... and its private key
    executor_ca: str | None = None  # reach the executor over TLS, verifying it against this CA (PEM)
    # Overlapped scheduling: build and send step N+1 while the executor runs step N (two steps in flight).
    # Off by default: on a CPU-only box the scheduler's overlapped work takes the executor's cores (README).
    async_scheduling: bool = False
    # A plan of decodes only, with no request waiting, runs up to this many times in one Step RPC
    # (a token per request per run; 1: an RPC per token), while the cost model predicts the runs
    # after the first within `decode_runs_window_s`: the most they delay a request that arrives.
    max_decode_runs: int = 4
    decode_runs_window_s: float = 0.1
    # Server-side limits on what a client controls (checked at intake, before any expensive work).
    max_retention_s: float = 600.0  # a session's retention_s is clamped to this
    max_id_bytes: int = 128  # request_id and session_id: re-sent in every step, copied into logs and timelines
    max_stop_strings: int = 16  # stop strings per request
    max_stop_string_chars: int = 256  # characters per stop string
    max_prompt_bytes: int = 1 << 20  # a text prompt, or all chat messages together (UTF-8 bytes)
    max_chat_messages: int = 2048
    max_message_bytes: int = 4 << 20  # any gRPC message or HTTP request body the scheduler receives
    max_grammar_bytes: int = 256 << 10  # a structured_output's schema, grammar or regex (UTF-8 bytes)
    # The OpenAI- and Anthropic-compatible HTTP API (scheduler_svc/http_api), in this process. Empty: off.
    http_listen: str = ""
    max_choices: int = 8  # OpenAI's `n`: completions per request
    tool_call_parser: str = "auto"  # how the model writes tool calls: auto | hermes | llama3 | none

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
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        parse_draft_policy(self.spec)  # raises a ValueError naming the bad value
        if self.decode_latency_target_s is not None and self.decode_latency_target_s <= 0:
            raise ValueError(f"decode_latency_target_s must be positive, got {self.decode_latency_target_s}")
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
