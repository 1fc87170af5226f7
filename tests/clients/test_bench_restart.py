"""`swarmserve bench restart` end to end on a tiny model: its JSON has every figure, the streams
across the kill are identical to the undisturbed run, and a restart reuses the calibration
that the first start measured."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.stack import ROOT
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_model

SUMMARIES = ("listen_s", "serving_s", "first_resumed_token_s", "all_streams_resumed_s")


@pytest.mark.e2e
def test_restart_bench_times_a_start_and_a_kill_and_the_streams_resume_identical(tmp_path):
    model = write_tiny_model(tmp_path / "tiny.gguf", TinyModelSpec(context_length=1024))
    done = subprocess.run(
        [
            sys.executable, "-m", "clients.cli", "bench", "restart", "--model", str(model), "--rounds", "2",
            "--kills", "1", "--streams", "2", "--tokens", "300", "--kill-after", "8", "--timeout", "240", "--json",
            "--executor-args", "--kv-cache-gb", "0.01",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(done.stdout)
    for name in SUMMARIES:
        summary = result[name]
        assert summary is not None and 0 < summary["min"] <= summary["median"] <= summary["max"], (name, summary)
    assert result["listen_s"]["max"] <= result["serving_s"]["max"]
    assert result["first_resumed_token_s"]["min"] <= result["all_streams_resumed_s"]["max"]
    assert result["streams_identical"] == result["kills"] == 1 and not result["kill_rounds"][0]["errors"]
    # The first start measured its calibration (a new model file is a new setup); the later ones, and
    # the restart after the kill, found it. They reuse it unless the lone decode they time at start
    # differs from it by over 3x, which a machine whose load swings (a shared CI box) can make
    # happen: then they measure again, and say so ("remeasured", never "measured").
    calibrations = [s["events"]["calibration"] for s in result["starts"]]
    calibrations.append(result["kill_rounds"][0]["restart"]["calibration"])
    assert calibrations[0] == "measured" and all(c in ("cached", "remeasured") for c in calibrations[1:]), calibrations
    for start in result["starts"]:
        events = start["events"]
        assert 0 < events["executor_listening"] <= events["executor_ready"], events
