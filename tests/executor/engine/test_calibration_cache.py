"""The start-up calibration is measured once per setup and reused by the next start."""

from __future__ import annotations

import json
import os

import pytest

from executor_svc.engine import calibration_cache
from executor_svc.engine.calibration_cache import calibrate, load_calibration, runner_setup, setup_key, still_holds
from executor_svc.engine.step_messages import CostSample
from tests.support.tiny_gguf import TinyModelSpec


@pytest.fixture(scope="module")
def tiny_runner(make_tiny_engine):
    return make_tiny_engine(TinyModelSpec(context_length=256), kv_cache_bytes=8 << 20).model_runner


def test_a_measured_calibration_is_kept_and_reused(tiny_runner, tmp_path, monkeypatch):
    measured, source = calibrate(tiny_runner, tmp_path)
    assert source == "measured" and measured
    assert [p.name for p in tmp_path.iterdir()] == [f"{setup_key(runner_setup(tiny_runner))}.json"]

    def no_measuring():
        raise AssertionError("a cached calibration was measured again")

    monkeypatch.setattr(tiny_runner, "calibrate", no_measuring)
    # The machine as fast as when it measured: the lone decode timed now would otherwise follow the
    # load of a shared machine past the drift check (tested on its own below) and fail this test.
    monkeypatch.setattr(calibration_cache, "still_holds", lambda runner, samples: True)
    reused, source = calibrate(tiny_runner, tmp_path)
    assert source == "cached" and reused == measured


def test_a_calibration_cached_on_a_busier_machine_is_measured_again(tiny_runner, tmp_path):
    """A calibration measured at a load of 10 priced a lone decode at 360 ms where it took 20: a
    cached one is checked against a lone decode timed at start-up, and measured again if far off."""
    calibrate(tiny_runner, tmp_path)
    path = next(tmp_path.glob("*.json"))
    data = json.loads(path.read_text())
    for s in data["samples"]:
        s["forward_s"] += 1.0
        s["step_s"] += 1.0
    path.write_text(json.dumps(data))
    samples, source = calibrate(tiny_runner, tmp_path)
    assert source == "remeasured" and all(s.step_s < 1.0 for s in samples)
    assert load_calibration(tmp_path, runner_setup(tiny_runner)) == samples


@pytest.mark.parametrize(
    "cached_s,now_s,holds",
    [(0.020, 0.360, False), (0.360, 0.020, False), (0.020, 0.045, True), (0.0002, 0.0015, True)],
)
def test_still_holds_within_a_factor_or_the_noise_slack(tiny_runner, monkeypatch, cached_s, now_s, holds):
    """The decision alone (the step timed now is given): MAX_DRIFT either way, DRIFT_SLACK_S absolute."""
    lone_decode = CostSample(1, 1, cached_s, 1, 1, cached_s)
    monkeypatch.setattr(tiny_runner, "time_step", lambda *args, **kwargs: CostSample(1, 1, now_s, 1, 1, now_s))
    assert still_holds(tiny_runner, [CostSample(8, 8, 1.0, 1, 1, 1.0), lone_decode]) is holds


def test_recalibrate_measures_again_and_keeps_the_new_one(tiny_runner, tmp_path):
    first, _ = calibrate(tiny_runner, tmp_path)
    again, source = calibrate(tiny_runner, tmp_path, reuse=False)
    assert source == "measured"
    assert load_calibration(tmp_path, runner_setup(tiny_runner)) == again
    assert [(s.num_tokens, s.num_attention_pairs) for s in again] == [
        (s.num_tokens, s.num_attention_pairs) for s in first
    ]


def test_another_setup_is_measured(make_tiny_engine, tiny_runner, tmp_path):
    calibrate(tiny_runner, tmp_path)
    spec = TinyModelSpec(context_length=256)
    other = make_tiny_engine(spec, kv_cache_bytes=8 << 20, batch_invariant=False).model_runner
    assert runner_setup(other) != runner_setup(tiny_runner)
    assert calibrate(other, tmp_path)[1] == "measured"
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_a_rewritten_model_file_is_another_setup(tiny_runner):
    setup = runner_setup(tiny_runner)
    path = tiny_runner.model_path
    stat = path.stat()
    try:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        assert setup_key(runner_setup(tiny_runner)) != setup_key(setup)
    finally:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("damage", ["truncated", "other_setup", "no_samples"])
def test_an_unreadable_or_foreign_file_is_measured_over(tiny_runner, tmp_path, damage):
    calibrate(tiny_runner, tmp_path)
    path = next(tmp_path.glob("*.json"))
    data = json.loads(path.read_text())
    if damage == "truncated":
        path.write_text(path.read_text()[:40])
    elif damage == "other_setup":
        data["setup"]["model_bytes"] += 1
        path.write_text(json.dumps(data))
    else:
        data["samples"] = []
        path.write_text(json.dumps(data))
    assert load_calibration(tmp_path, runner_setup(tiny_runner)) is None
    samples, source = calibrate(tiny_runner, tmp_path)
    assert source == "measured" and load_calibration(tmp_path, runner_setup(tiny_runner)) == samples


def test_the_cache_keeps_the_newest_files(tiny_runner, tmp_path, monkeypatch):
    monkeypatch.setattr(calibration_cache, "MAX_FILES", 3)
    setup = runner_setup(tiny_runner)
    samples = calibrate(tiny_runner, None)[0]
    for i in range(5):
        calibration_cache.save_calibration(tmp_path, {**setup, "threads": 100 + i}, samples)
        newest = tmp_path / f"{setup_key({**setup, 'threads': 100 + i})}.json"
        os.utime(newest, (1e9 + i, 1e9 + i))  # mtimes one second apart, oldest first
    kept = {json.loads(p.read_text())["setup"]["threads"] for p in tmp_path.glob("*.json")}
    assert kept == {102, 103, 104}
    assert not list(tmp_path.glob("*.tmp"))
