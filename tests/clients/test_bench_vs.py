"""`swarmserve bench vs`: its pure parts (flags, arithmetic, the report), and a swarmserve-only
run end to end on a tiny GGUF (llama-server is not part of the test environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from clients.bench.llama_server import completion_body, llama_server_command
from clients.bench.vs_llama_cpp import (
    COPY_SOURCE,
    MISSING,
    common_prefix_chars,
    copy_prompt,
    format_report,
    read_resident,
    speed_ratio,
    stream_prompts,
    tokens_per_s,
)
from clients.cli import parse_args
from clients.serve import flag_value
from tests.support.stack import ROOT
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_model


def test_flags_parse_with_defaults_and_passthrough():
    args = parse_args(["bench", "vs"])
    assert args.llama_server is None
    assert args.model == "default"
    assert args.streams == (1, 8, 16)
    assert (args.max_tokens, args.copy_tokens, args.threads) == (128, 256, 2)
    assert args.executor_arg == [] and args.scheduler_arg == [] and args.llama_args == ""

    args = parse_args(
        ["bench", "vs", "--llama-server", "/x/llama-server", "--streams", "2,4", "--executor-arg=--dtype=bfloat16",
         "--executor-arg=--kv-cache-gb=0.5", "--scheduler-arg=--spec=off", "--llama-args", "--poll 0", "--json", "out.json"]
    )  # fmt: skip
    assert args.llama_server == "/x/llama-server"
    assert args.streams == (2, 4)
    assert args.executor_arg == ["--dtype=bfloat16", "--kv-cache-gb=0.5"]
    assert args.scheduler_arg == ["--spec=off"]
    assert args.llama_args == "--poll 0"
    assert args.json == "out.json"


@pytest.mark.parametrize(
    "argv", [["--streams", "0"], ["--streams", "1,x"], ["--streams", ""], ["--max-tokens", "0"], ["--threads", "0"]]
)
def test_bad_flags_are_usage_errors(argv):
    with pytest.raises(SystemExit) as exited:
        parse_args(["bench", "vs", *argv])
    assert exited.value.code == 2


def test_tokens_per_second_and_ratio():
    assert tokens_per_s(16 * 128, 8.0) == 256.0
    assert tokens_per_s(10, 0.0) == 0.0
    assert speed_ratio(50.0, 200.0) == 0.25
    assert speed_ratio(50.0, None) is None
    assert speed_ratio(50.0, 0.0) is None


def test_prompts_are_distinct_and_the_copy_prompt_holds_the_file():
    for n in (1, 8, 16, 40):
        prompts = stream_prompts(n)
        assert len(prompts) == len(set(prompts)) == n
    lead = "".join(COPY_SOURCE.splitlines(keepends=True)[:3])
    prompt = copy_prompt()
    assert COPY_SOURCE in prompt and prompt.endswith(f"```python\n{lead}")
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    prompt = copy_prompt(template)
    assert prompt.startswith("<|im_start|>user\nHere is a file:\n```python\n" + COPY_SOURCE)
    assert prompt.endswith(f"Rewrite the file exactly.<|im_end|>\n<|im_start|>assistant\n```python\n{lead}")


def test_helpers():
    assert common_prefix_chars("abcdef", "abcxyz") == 3
    assert common_prefix_chars("", "abc") == 0
    assert flag_value(["--spec", "off", "--x"], "--spec") == "off"
    assert flag_value(["--spec=fixed:4"], "--spec") == "fixed:4"
    assert flag_value(["--spec-x=1"], "--spec") is None
    resident = read_resident(os.getpid())
    assert resident.rss > 0 and resident.anon > 0
    assert llama_server_command("bin", "m.gguf", num_slots=8, context_length=8 * 192, threads=2, port=9) == [
        "bin", "-m", "m.gguf", "-np", "8", "-c", "1536", "-t", "2", "--host", "127.0.0.1", "--port", "9",
    ]  # fmt: skip
    assert llama_server_command("bin", "m", num_slots=1, context_length=192, threads=1, port=9, extra_args=["--poll", "0"])[-2:] == [
        "--poll", "0",
    ]  # fmt: skip
    assert completion_body("p", 128) == {
        "prompt": "p",
        "n_predict": 128,
        "ignore_eos": True,
        "temperature": 0,
        "cache_prompt": False,
    }


def _run(kind, streams, tokens, theirs_tps, ours_tps, text_a="abc", text_b="abd"):
    theirs = None if theirs_tps is None else {"tokens_per_s": theirs_tps, "texts": [text_a], "load_avg_1m": 2.0}
    row = {
        "kind": kind,
        "streams": streams,
        "max_tokens": tokens,
        "llama_cpp": theirs,
        "swarmserve": {
            "tokens_per_s": ours_tps,
            "texts": [text_b],
            "drafted_tokens": 100,
            "accepted_tokens": 80,
            "load_avg_1m": 1.5,
        },
        "ratio": speed_ratio(ours_tps, theirs_tps),
    }
    if theirs:
        row["same_text_chars"] = common_prefix_chars(text_a, text_b)
    return row


def _result(with_llama: bool, weight_bytes: int | None) -> dict:
    mib = 2**20
    return {
        "model": "/m/SmolLM2.gguf",
        "gguf_bytes": 100 * mib,
        "threads": 2,
        "cpu_count": 2,
        "executor_args": ["--threads", "2"],
        "scheduler_args": [],
        "llama_server_version": "version: 1 (abc)" if with_llama else None,
        "swarmserve_dtype": "float32",
        "swarmserve_spec": "goodput",
        "rows": [
            _run("streams", 1, 128, 130.0 if with_llama else None, 13.0),
            _run("streams", 16, 128, 250.0 if with_llama else None, 500.0),
            _run("copy", 1, 256, 120.0 if with_llama else None, 300.0),
        ],
        "llama_cpp_resident": {"rss_bytes": 150 * mib, "anon_bytes": 50 * mib, "file_bytes": 100 * mib}
        if with_llama
        else None,
        "swarmserve_resident": {"rss_bytes": 1000 * mib, "anon_bytes": 990 * mib, "file_bytes": 10 * mib},
        "swarmserve_weight_bytes": weight_bytes,
    }


def test_report_has_a_row_per_run_ratios_and_memory():
    report = format_report(_result(with_llama=True, weight_bytes=105 * 2**20))
    lines = report.splitlines()
    row = next(line for line in lines if line.startswith("N=1 x 128 tok"))
    assert [cell.strip() for cell in row.split("|")] == ["N=1 x 128 tok", "130.0", "13.0", "0.10x", "2.0/1.5"]
    row = next(line for line in lines if line.startswith("N=16 x 128 tok"))
    assert row.split("|")[3].strip() == "2.00x"
    row = next(line for line in lines if line.startswith("copy turn, 1 x 256 tok"))
    assert row.split("|")[3].strip() == "2.50x"
    assert "100 draft tokens, 80 accepted (80%)" in report
    assert "agree on the first 2 of 3 chars" in report
    assert "GGUF file              100.0 MiB" in report
    assert "llama-server           VmRSS 150.0 MiB (1.50x the GGUF" in report
    assert "swarmserve executor    VmRSS 1000.0 MiB (10.00x the GGUF" in report
    assert "105.0 MiB (1.05x the GGUF), as GetInfo reports" in report


def test_a_busy_machine_is_flagged_when_llama_cpp_ran():
    result = _result(with_llama=True, weight_bytes=None)
    assert "WARNING: the machine was busy" not in format_report(result)  # loads 2.0 and 1.5 on 2 cores
    result["rows"][1]["swarmserve"]["load_avg_1m"] = 4.5
    assert "WARNING: the machine was busy (load up to 4.5 on 2 cores)" in format_report(result)
    result = _result(with_llama=False, weight_bytes=None)
    result["rows"][1]["swarmserve"]["load_avg_1m"] = 4.5
    assert "WARNING" not in format_report(result)  # nothing to compare against


def test_report_without_llama_cpp_shows_dashes():
    report = format_report(_result(with_llama=False, weight_bytes=None))
    row = next(line for line in report.splitlines() if line.startswith("N=16 x 128 tok"))
    assert [cell.strip() for cell in row.split("|")] == ["N=16 x 128 tok", MISSING, "500.0", MISSING, f"{MISSING}/1.5"]
    assert "not run (no --llama-server)" in report
    assert f"llama-server           {MISSING}" in report
    assert "not reported by GetInfo" in report
    assert "agree on" not in report


@pytest.mark.e2e
def test_swarmserve_only_run_end_to_end(tmp_path):
    model = write_tiny_model(tmp_path / "tiny.gguf", TinyModelSpec(context_length=4096))
    out = tmp_path / "vs.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "clients.cli", "bench", "vs", "--model", str(model), "--streams", "1,3",
            "--max-tokens", "6", "--copy-tokens", "8", "--threads", "1", "--executor-arg=--kv-cache-gb=0.01",
            "--scheduler-arg=--spec=goodput", "--workloads", "streams,copy", "--json", str(out),
            "--log", str(tmp_path / "log"),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["kind"], r["streams"]) for r in result["rows"]] == [("streams", 1), ("streams", 3), ("copy", 1)]
    for row in result["rows"]:
        assert row["llama_cpp"] is None and row["ratio"] is None
        assert row["swarmserve"]["tokens"] == row["streams"] * row["max_tokens"]  # EOS ignored: exact lengths
        assert row["swarmserve"]["tokens_per_s"] > 0
    assert result["gguf_bytes"] == model.stat().st_size
    assert result["swarmserve_resident"]["rss_bytes"] > 0
    assert result["swarmserve_spec"] == "goodput"
    assert result["swarmserve_dtype"]
    assert "N=3 x 6 tok" in done.stdout and MISSING in done.stdout
