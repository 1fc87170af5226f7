"""The swarm benchmark end to end on a tiny configuration: it runs against real services
and its JSON has every field."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from clients.bench.swarm import parse_sse_line
from tests.support.stack import ROOT
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_model

SUMMARY_FIELDS = {
    "useful_tokens", "makespan_s", "useful_tokens_per_s", "agent_completion_s", "ttft_p50_s", "ttft_p99_s",
    "itl_p50_s", "itl_p99_s", "prompt_tokens", "prefix_hit_rate", "draft_acceptance", "kv_use_mean", "kv_use_max",
}  # fmt: skip
TURN_FIELDS = {
    "agent", "turn", "start_s", "first_token_s", "end_s", "output_tokens", "prompt_tokens", "cached_tokens",
    "drafted_tokens", "accepted_tokens", "token_times_s",
}  # fmt: skip


@pytest.mark.e2e
def test_swarm_bench_runs_end_to_end_and_reports_every_field(tmp_path):
    model = write_tiny_model(tmp_path / "tiny.gguf", TinyModelSpec(context_length=2048))
    out = tmp_path / "swarm"
    done = subprocess.run(
        [
            sys.executable, "-m", "clients.cli", "bench", "swarm", "--start", "--compare-prefix-caching",
            "--model", str(model), "--kv-cache-gb", "0.01", "--agents", "3", "--turns", "2", "--system-tokens", "120",
            "--length-scale", "0.02", "--tool-pause-s", "0.05", "--out", str(out), "--log", str(tmp_path / "log"),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    runs = json.loads(out.with_suffix(".json").read_text())
    assert set(runs) == {"prefix-cache-on", "prefix-cache-off"}
    for name, run in runs.items():
        assert set(run["summary"]) == SUMMARY_FIELDS
        assert len(run["turns"]) == 3 * 2
        assert all(set(t) == TURN_FIELDS for t in run["turns"])
        assert run["summary"]["useful_tokens"] == sum(t["output_tokens"] for t in run["turns"]) > 0
        assert len(run["summary"]["agent_completion_s"]) == 3
        assert run["kv_use"], "KV use was never sampled"
    # The shared system prompt and each agent's earlier turn are reused only with the cache on.
    assert runs["prefix-cache-on"]["summary"]["prefix_hit_rate"] > 0.3
    assert runs["prefix-cache-off"]["summary"]["prefix_hit_rate"] == 0
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "prefix-cache-on / prefix-cache-off useful tokens/s" in done.stdout


def test_openai_stream_lines_are_parsed():
    assert parse_sse_line('data: {"choices": [{"delta": {"content": "hi"}}]}') == {
        "choices": [{"delta": {"content": "hi"}}]
    }
    assert parse_sse_line("data: [DONE]") is None
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("") is None


def test_tokens_of_one_message_are_spread_since_the_previous_token():
    from clients.bench.swarm import spread_arrivals

    assert spread_arrivals(None, 5.0, 3) == [5.0, 5.0, 5.0]  # the first message: no previous token
    assert spread_arrivals(1.0, 2.0, 1) == [2.0]
    assert spread_arrivals(1.0, 2.0, 4) == [1.25, 1.5, 1.75, 2.0]
    assert spread_arrivals(1.0, 2.0, 0) == []
