"""The GPU check script, run in its --dry-run mode (tiny sizes, CPU, interpreter), without gguf.

The real run gets one short slot on an accelerator; this catches a broken script before then.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")

REPO_ROOT = Path(__file__).resolve().parents[3]


# As on the GPU machine: no gguf package (nothing here may need it), kernels interpreted.
# The swarm section serves models (gguf and the services needed): test_gpu_swarm.py runs its dry run.
def run_without_gguf(args: str = "'--only', ','.join(KERNEL_SECTIONS)") -> str:
    """gpu_check's dry run with these arguments (Python list items), in a process without gguf."""
    return (
        "import sys; sys.modules['gguf'] = None; "
        "from executor_svc.tools.gpu_check import KERNEL_SECTIONS, main; "
        f"sys.exit(main(['--dry-run', {args}]))"
    )


@pytest.mark.slow
def test_dry_run_passes_every_check_and_writes_json(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", OUT=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", run_without_gguf()], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["errors"] == []
    sections = {record["section"] for record in results["records"]}
    assert sections == {"env", "roofline", "correct", "invariant", "greedy", "kernel", "step", "qmatmul", "decode"}
    assert all(record.get("ok", True) for record in results["records"])
    names = {(record["section"], record["name"]) for record in results["records"]}
    delta_net = {
        ("correct", "causal_conv1d"),
        ("correct", "conv_states"),
        ("correct", "gated_delta_rule"),
        ("correct", "delta_rule_states"),
        ("correct", "chunk_gated_delta_rule"),
        ("correct", "chunk_vs_recurrent"),
        ("invariant", "delta_net_request"),
        ("invariant", "delta_net_chunked_request"),
        ("kernel", "causal_conv1d_decode"),
        ("kernel", "delta_rule_decode"),
        ("kernel", "delta_rule_prefill"),
    }
    assert delta_net <= names, delta_net - names
    assert {("qmatmul", "launch_skinny_Q4_K"), ("qmatmul", "launch_tiled_Q4_K")} <= names
    assert "total" in done.stdout.splitlines()[-1]


@pytest.mark.slow
def test_labels_pick_checks_within_the_sections(tmp_path):
    """`--only correct --labels 'delta net'`: the DeltaNet checks, none of the other correct checks."""
    env = dict(os.environ, TRITON_INTERPRET="1", OUT=str(tmp_path))
    run = run_without_gguf("'--only', 'correct', '--labels', 'delta net'")
    done = subprocess.run(
        [sys.executable, "-c", run], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = json.loads((tmp_path / "gpu_check.json").read_text())["records"]
    correct = {record["name"] for record in records if record["section"] == "correct"}
    assert {"gated_delta_rule", "chunk_gated_delta_rule"} <= correct
    assert not correct & {"rms_norm", "attention_mixed"}
    assert {record["section"] for record in records} == {"correct"}
