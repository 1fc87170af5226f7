"""bench_prefill: the command a user runs to see prefill against the machine's peak (a short run)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from executor_svc.weights.weight_format import has_int8_dot, has_int16_dot


@pytest.mark.parametrize("matmul", ["int16", "int8"])
def test_a_short_run_prints_and_writes_every_table(tmp_path, matmul):
    if not (has_int8_dot() if matmul == "int8" else has_int16_dot()):
        pytest.skip(f"this CPU has no {matmul} matmul")
    out = tmp_path / "prefill.json"
    run = subprocess.run(
        [sys.executable, "-m", "executor_svc.tools.bench_prefill", "--tokens", "48", "--rows", "1,9"]
        + ["--chunk", "32", "--contexts", "16,96", "--reps", "1", "--matmul", matmul, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "measured peak per thread" in run.stdout and "one prompt from an empty cache" in run.stdout
    r = json.loads(out.read_text())
    peak = r["peak"]
    assert peak["matmul"] == matmul and f"the {matmul} matmul, GMAC/s" in run.stdout
    # pmaddwd does 16 multiply-adds where an FMA does 8 (vpdpbusd 32 more): the integer peaks are higher.
    assert peak["int16_macs_per_thread"] > peak["fp32_macs_per_thread"] > 0
    if matmul == "int8":
        assert peak["matmul_macs_per_thread"] > peak["int16_macs_per_thread"]
    assert {(m["weight"], m["m"]) for m in r["matmuls"]} == {
        (w, m) for w in ("qkv", "o_proj", "gate_up", "down") for m in (1, 9)
    }
    for m in r["matmuls"]:
        assert m["rows_gmacs"] > 0 and m["panels_share_of_peak"] == pytest.approx(
            m["panels_gmacs"] * 1e9 / peak["matmul_macs"]
        )
    (prefill,) = r["prefill"]
    assert prefill["tokens"] == 48 and prefill["tokens_per_s"] == pytest.approx(48 / prefill["seconds"])
    assert "a chunk of 32 prompt tokens ending at each context" in run.stdout
    assert [c["context"] for c in r["chunk_costs"]] == [16, 96]
    for c in r["chunk_costs"]:
        assert c["matmul_s"] > 0 and c["decode_row_attention_s"] > 0
        assert c["attention_per_matmul"] == pytest.approx(c["attention_s"] / c["matmul_s"])
