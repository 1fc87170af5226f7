"""The end-to-end GPU script: its random-weight GGUFs, its equality rule, and its --dry-run
(every step on the CPU: the real services on tiny models, the Triton kernels interpreted).

The real run gets one short slot on an accelerator; the dry run catches a broken script before then.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from executor_svc.tools.gpu_check import Report, finish
from executor_svc.tools.gpu_swarm import GreedyRun, add_equality, compare_greedy
from executor_svc.tools.random_gguf import (
    QWEN3_8B,
    QWEN35_9B,
    TINY_QWEN3,
    TINY_QWEN35,
    gguf_file_bytes,
    model_file_name,
    uses_more_bits,
    write_random_gguf,
)

REPO_ROOT = Path(__file__).resolve().parents[3]


def greedy(tokens: list[int], logprobs: list[dict[int, float]] | None = None) -> GreedyRun:
    return GreedyRun(list(tokens), logprobs or [{t: -0.1} for t in tokens])


# ----------------------------------------------------------------------------- equality


def test_identical_runs_are_equal_and_compare_every_position():
    reference = [greedy([5, 6, 7]), greedy([8, 9])]
    c = compare_greedy([greedy([5, 6, 7]), greedy([8, 9])], reference, tolerance=1e-3)
    assert (c.num_equal, c.num_near_ties, c.num_mismatches, c.num_positions) == (2, 0, 0, 5)


def test_a_first_difference_within_the_tolerance_is_a_near_tie():
    reference = [greedy([5, 6, 7], [{5: -0.1}, {6: -0.70, 11: -0.7004}, {7: -0.1}])]
    c = compare_greedy([greedy([5, 11, 3])], reference, tolerance=1e-3)
    assert (c.num_equal, c.num_near_ties, c.num_mismatches, c.num_positions) == (0, 1, 0, 1)
    assert c.worst_gap == pytest.approx(4e-4)


def test_a_first_difference_beyond_the_tolerance_or_outside_the_top_k_is_a_mismatch():
    reference = [greedy([5, 6], [{5: -0.1}, {6: -0.5, 11: -2.5}]), greedy([5, 6])]
    c = compare_greedy([greedy([5, 11]), greedy([5, 12])], reference, tolerance=0.5)
    assert (c.num_near_ties, c.num_mismatches) == (0, 2)
    assert math.isinf(c.worst_gap)


def test_a_run_shorter_than_the_reference_is_a_mismatch():
    c = compare_greedy([greedy([5])], [greedy([5, 6])], tolerance=1.0)
    assert (c.num_equal, c.num_mismatches) == (0, 1)


def test_a_mismatch_makes_the_command_exit_1(tmp_path):
    report = Report(60.0, str(tmp_path), name="t")
    add_equality(report, "m", "fp32", [greedy([5, 6])], [greedy([5, 7])], tolerance=1e-3)
    assert finish(report) == 1
    assert "FAIL" in (tmp_path / "t.txt").read_text()

    passing = Report(60.0, None, name="t")
    add_equality(passing, "m", "fp32", [greedy([5, 6])], [greedy([5, 6])], tolerance=1e-3)
    assert finish(passing) == 0


# ----------------------------------------------------------------------------- random GGUFs


def test_q4_k_m_keeps_llama_cpp_s_layers_in_q6_k():
    # llama.cpp's use_more_bits for 36 layers: the first 4, the last 5, every third between.
    assert [i for i in range(36) if uses_more_bits(i, 36)] == [0, 1, 2, 3, *range(6, 31, 3), 31, 32, 33, 34, 35]


def test_the_real_shapes_weigh_what_the_readme_says():
    assert gguf_file_bytes(QWEN3_8B) / 1e9 == pytest.approx(5.02, abs=0.01)
    assert gguf_file_bytes(QWEN35_9B) / 1e9 == pytest.approx(5.5, abs=0.05)


def test_file_names_change_with_the_shape_and_the_seed():
    names = {model_file_name(TINY_QWEN3, 0), model_file_name(TINY_QWEN3, 1), model_file_name(TINY_QWEN35, 0)}
    assert len(names) == 3


@pytest.mark.parametrize("shape", [TINY_QWEN3, TINY_QWEN35], ids=lambda s: s.name)
def test_a_written_model_loads_with_its_shape_and_decodes_every_token(tmp_path, shape):
    from executor_svc.weights.gguf_file import open_gguf
    from executor_svc.weights.model_config import ModelConfig
    from executor_svc.weights.tokenizer import load_tokenizer

    path = write_random_gguf(tmp_path / "m.gguf", shape)
    assert not (tmp_path / "m.gguf.partial").exists()
    gguf = open_gguf(path)
    config = ModelConfig.from_gguf(gguf)
    assert (config.architecture, config.num_layers, config.hidden_size) == (
        shape.architecture,
        shape.num_layers,
        shape.hidden_size,
    )
    assert config.vocab_size == shape.vocab_size
    assert config.is_hybrid == shape.is_hybrid
    if shape.is_hybrid:
        assert config.recurrent_layers == tuple(shape.is_recurrent(i) for i in range(shape.num_layers))
    tokenizer = load_tokenizer(gguf)
    assert tokenizer.tokenizer.get_vocab_size() == shape.vocab_size
    assert tokenizer.tokenizer.decode([shape.vocab_size - 1]) == f"x{shape.vocab_size - 1 - 267}"


# ----------------------------------------------------------------------------- the dry run


@pytest.mark.slow
@pytest.mark.e2e
def test_dry_run_measures_every_step_of_both_models_and_writes_json(tmp_path):
    pytest.importorskip("triton", reason="triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", OUT=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "executor_svc.tools.gpu_swarm", "--dry-run", "--model-dir", str(tmp_path / "models")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_swarm.json").read_text())
    assert results["errors"] == []
    assert all(record.get("ok", True) for record in results["records"])
    names = {(r["name"], r["model"], r["dtype"]) for r in results["records"] if r["section"] == "swarm"}
    for model in ("tiny-qwen3", "tiny-qwen35"):
        expected = {
            ("model_file", model, ""),
            ("verify_B1", model, "bf16"),
            ("verify_B2", model, "bf16"),
            ("decode_streams", model, "bf16"),
            ("ttft", model, "bf16"),
            ("bench_swarm", model, "bf16"),
            ("equality_vs_cpu", model, "fp32"),
            ("equality_vs_cpu", model, "bf16"),
        }
        assert expected <= names, expected - names
    streams = [r for r in results["records"] if r["name"] == "decode_streams"]
    assert {r["streams"] for r in streams} == {1, 2}
    assert all(r["floor_tokens_per_s"] > 0 for r in streams)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("section") and "total" in lines[-1]
    assert (tmp_path / "gpu_swarm.txt").read_text().splitlines()[-1] == lines[-1]
