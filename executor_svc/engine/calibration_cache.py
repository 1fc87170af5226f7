"""Start-up calibration, reused: the last one measured for the same setup, instead of a new one.

Calibration (ModelRunner.calibrate) times a grid of scratch steps so that the scheduler's cost
model has a shape before any real step has run. It is most of a restart's time on a CPU,
and on a busy machine it is also the part that stretches most (OpenMP teams timed against
other work): a restart measured 63 s at a load of 8. A calibration is a property of the
setup, not of the run, so the executor keeps the last one measured for each setup and a
restart reuses it.

The setup is what step times depend on: the model file (path, size, modification time),
the kernels (their kind, the C++ kernels' build: CPU model and flags, sources, torch), the
device, dtype, KV cache dtype, matmul, threads and batch invariance, and the grid itself. Anything else
changed makes another key, hence a new measurement. A reused calibration is only where the
cost model starts: the scheduler refines it from every real step's timings (its level and
refits). But a start-up far off misleads the first decisions (a calibration measured at a load
of 10 priced a lone decode at 360 ms where it took 20, and speculation was priced out), so a
cached one is first checked against one step timed now (`still_holds`): the lone decode, the
grid's first point. Off by more than `MAX_DRIFT` either way, it is measured again.

Files live in `$XDG_CACHE_HOME/swarmserve/calibration/` (`~/.cache/...`), one small JSON
file per setup, written atomically; the oldest beyond `MAX_FILES` are removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, fields
from pathlib import Path

import structlog

from executor_svc.engine.step_messages import CostSample

log = structlog.get_logger()

# Of the file and of the grid Engine.calibrate measures: bump when either changes (2: samples count
# attention pairs, not KV tokens).
FORMAT_VERSION = 2
MAX_FILES = 64
MAX_DRIFT = 3.0  # a cached lone decode this many times slower or faster than one timed now: measured again
DRIFT_SLACK_S = 0.002  # differences below this are timer and scheduling noise, whatever the ratio


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "swarmserve" / "calibration"


def runner_setup(runner) -> dict:
    """What the model runner's step times depend on, as plain values (the cache key's material)."""
    import torch

    model = runner.model_path.resolve()
    stat = model.stat()
    setup = {
        "format": FORMAT_VERSION,
        "model": str(model),
        "model_bytes": stat.st_size,
        "model_mtime_ns": stat.st_mtime_ns,
        "kernels": runner.ops.name,
        "device": str(runner.device),
        "dtype": str(runner.dtype),
        "kv_cache_dtype": str(runner.kv_dtype),
        "matmul": runner.matmul,
        "threads": torch.get_num_threads(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "batch_invariant": runner.config.batch_invariant,
        "block_size": runner.kv.block_size,
        "torch": torch.__version__,
    }
    if runner.device.type == "cpu":
        from executor_svc import cpu_kernels

        setup["cpu_kernels_build"] = f"{cpu_kernels.build_root().name}/{cpu_kernels.source_signature()}"
    else:
        setup["device_name"] = torch.cuda.get_device_name(runner.device)
    return setup


def setup_key(setup: dict) -> str:
    return hashlib.blake2b(json.dumps(setup, sort_keys=True).encode(), digest_size=10).hexdigest()


def load_calibration(cache_dir: Path, setup: dict) -> list[CostSample] | None:
    """The samples cached for `setup`, or None (none cached, or a file that cannot be read)."""
    path = cache_dir / f"{setup_key(setup)}.json"
    try:
        data = json.loads(path.read_text())
        if data["setup"] != setup:  # a key collision, or a file edited by hand
            return None
        names = {f.name for f in fields(CostSample)}
        samples = [CostSample(**{k: v for k, v in s.items() if k in names}) for s in data["samples"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return samples or None


def save_calibration(cache_dir: Path, setup: dict, samples: list[CostSample]) -> None:
    """Keep `samples` for `setup` (atomically: a reader never sees half a file); failures only log."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        path = cache_dir / f"{setup_key(setup)}.json"
        data = {"setup": setup, "measured_unix_s": time.time(), "samples": [asdict(s) for s in samples]}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
        _prune(cache_dir)
    except OSError as exc:
        log.warning("calibration_not_cached", cache_dir=str(cache_dir), error=str(exc))


def _prune(cache_dir: Path) -> None:
    files = sorted(cache_dir.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in files[MAX_FILES:]:
        old.unlink(missing_ok=True)


def calibrate(runner, cache_dir: Path | None, reuse: bool = True) -> tuple[list[CostSample], str]:
    """(samples, where they came from: "cached"; "measured", none being cached; or "remeasured",
    the cached one no longer holding, see `still_holds`). A measurement is kept in `cache_dir`
    for the next start (None: not kept); `reuse` False measures even when one is cached. Call it
    on the engine's thread, while no request runs."""
    setup = runner_setup(runner) if cache_dir is not None else {}
    source = "measured"
    if cache_dir is not None and reuse:
        samples = load_calibration(cache_dir, setup)
        if samples is not None:
            if still_holds(runner, samples):
                return samples, "cached"
            source = "remeasured"
    samples = runner.calibrate()
    if cache_dir is not None:
        save_calibration(cache_dir, setup, samples)
    return samples, source


def still_holds(runner, samples: list[CostSample]) -> bool:
    """Whether a cached calibration prices a lone decode (one request, one token, no context) as
    the fastest of three timed now does, within MAX_DRIFT; True when it has no such point."""
    cached = next((s for s in samples if (s.num_tokens, s.num_attention_pairs, s.num_requests) == (1, 1, 1)), None)
    if cached is None:
        return True
    now = runner.time_step(0, 1, 1, 1, reps=3)
    if now is None:
        return True
    then_s, now_s = cached.step_s or cached.forward_s, now.step_s or now.forward_s
    if abs(then_s - now_s) <= DRIFT_SLACK_S or then_s / MAX_DRIFT <= now_s <= then_s * MAX_DRIFT:
        return True
    log.info("calibration_stale", cached_decode_ms=round(then_s * 1e3, 2), measured_decode_ms=round(now_s * 1e3, 2))
    return False
