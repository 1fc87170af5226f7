"""A tiny-model stack serving the HTTP API, shared by the HTTP test modules."""

from __future__ import annotations

import json

from tests.support.stack import Stack
from tests.support.tiny_gguf import HERMES_TOOLS_TEMPLATE, TinyModelSpec, tiny_kv_bytes_per_block, write_tiny_model

BLOCK = 16
NUM_KV_BLOCKS = 64
BYTES_PER_BLOCK = tiny_kv_bytes_per_block(BLOCK)


def http_stack(
    tmp_path_factory, *scheduler_args: str, chat_template: str = HERMES_TOOLS_TEMPLATE, context_length: int = 1024
) -> Stack:
    """Executor + scheduler with --http-listen on a tiny random model whose chat template
    renders tools and tool calls Qwen-style (so the hermes tool-call parser is picked), or
    `chat_template`; a KV cache of the context's size (NUM_KV_BLOCKS blocks for 1024)."""
    model = write_tiny_model(
        tmp_path_factory.mktemp("m") / "tiny.gguf",
        TinyModelSpec(context_length=context_length, chat_template=chat_template, tie_word_embeddings=False),
    )
    kv_gb = NUM_KV_BLOCKS * (context_length // 1024) * BYTES_PER_BLOCK / (1 << 30)
    stack = Stack(
        ["--model", str(model), "--kv-cache-gb", repr(kv_gb), "--no-calibration"],
        ["--spec", "off", *scheduler_args],
        log_dir=tmp_path_factory.mktemp("logs"),
        serve_http=True,
    )
    return stack.start()


def pick_stop(text: str) -> str:
    """A stop string inside `text`, past its start: its first ASCII letter or digit after
    the 4th character (the tiny models write mostly bytes of no script)."""
    stop = next((c for c in text[4:] if c.isascii() and c.isalnum()), None)
    assert stop is not None, f"no stop string to pick in {text!r}"
    return stop


def refusal_lines(stack: Stack) -> list[dict]:
    """The scheduler's `request_refused` log lines so far (JSON lines: its output is a file)."""
    lines = []
    for line in (stack.log_dir / "scheduler.log").read_text(errors="replace").splitlines():
        if '"request_refused"' in line:
            lines.append(json.loads(line))
    return lines
