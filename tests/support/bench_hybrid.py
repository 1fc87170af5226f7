"""Dense vs hybrid on tiny models on this CPU: decode step time and memory per request, and
what keeping the verify window's recurrent states costs against the draft length K; and an
agent's second turn on the hybrid with and without its prefix cache (recurrent-state snapshots).

    PYTHONPATH=$PWD/protos:$PWD python -m tests.support.bench_hybrid

The dense model is a qwen3 of the hybrid's size (same hidden size, heads, FFN, layers), so
the difference is the token mixer: 3 of 4 layers DeltaNet instead of attention.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from executor_svc.engine.engine import Engine, EngineConfig, ScheduledRequest, StepRequest
from executor_svc.engine.request_state import NewRequest
from executor_svc.kv.kv_cache import bytes_per_block
from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice
from service_common.sampling_params import SamplingParams
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_model
from tests.support.tiny_hybrid_gguf import TinyHybridSpec, write_tiny_hybrid_model


def time_step(engine: Engine, num_requests: int, context_len: int, num_tokens: int, reps: int) -> tuple[float, int]:
    """Best forward time of `num_requests` requests computing `num_tokens` each (all logits rows, a verify
    of num_tokens − 1 drafts) after `context_len` tokens; and the verify-window bytes the step kept."""
    pool = engine.kv.state_pool
    with engine.kv.scratch(num_requests, context_len + num_tokens) as held:
        if held is None:
            raise ValueError(f"{num_requests} requests of {context_len + num_tokens} tokens do not fit the KV cache")
        pieces = [RequestSlice([7] * num_tokens, context_len, b, num_tokens, s) for b, s in held]
        batch = RaggedBatch.build(pieces, engine.kv.block_size, engine.model_runner.device)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            engine.model_runner.model.forward(batch, engine.kv.cache, pool)
            times.append(time.perf_counter() - t0)
        return min(times[1:]), pool.window_bytes if pool else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kernels", default="cpu")
    args = p.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())
    hybrid_spec = TinyHybridSpec(
        "qwen35",
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=512,
        linear_key_heads=2,
        linear_value_heads=4,
        linear_head_dim=64,
        num_layers=8,
    )
    _, hybrid_path = write_tiny_hybrid_model(root / "hybrid.gguf", hybrid_spec)
    dense_path = write_tiny_model(
        root / "dense.gguf",
        TinyModelSpec(
            "qwen3", num_layers=8, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512
        ),
    )
    engines = {
        name: Engine(EngineConfig(model=str(path), kv_cache_bytes=64 << 20, kernels=args.kernels, num_state_slots=16))
        for name, path in (("dense", dense_path), ("hybrid", hybrid_path))
    }
    print(f"context {args.context} tokens, kernels {args.kernels}, 1 thread")
    print("memory per request (bytes):")
    for name, e in engines.items():
        per_token = bytes_per_block(e.model_config, 1, e.model_runner.dtype)
        state = e.kv.state_pool.bytes_per_slot if e.kv.state_pool else 0
        print(
            f"  {name:6s} KV/token {per_token:6d}  state {state:7d}  at {args.context} tokens: {per_token * args.context + state}"
        )
    print("decode step (ms), B requests × 1 token:")
    for b in (1, 4, 8):
        row = [f"{1000 * time_step(e, b, args.context, 1, args.reps)[0]:7.2f}" for e in engines.values()]
        print(f"  B={b}: dense {row[0]}  hybrid {row[1]}")
    print("verify K drafts, B=4 (ms; window states kept, bytes):")
    for k in (0, 1, 2, 4, 8):
        dense_s, _ = time_step(engines["dense"], 4, args.context, k + 1, args.reps)
        hybrid_s, window = time_step(engines["hybrid"], 4, args.context, k + 1, args.reps)
        print(f"  K={k}: dense {1000 * dense_s:7.2f}  hybrid {1000 * hybrid_s:7.2f}  window {window}")
    prompt_len = args.context - 6  # its last block boundary falls inside the prefill: captured by the forward pass
    print(f"agent turn 2 on the hybrid: turn 1 = {prompt_len} prompt tokens + 40 generated, turn 2 adds 24:")
    for caching in (False, True):
        engine = Engine(
            EngineConfig(
                model=str(hybrid_path),
                kv_cache_bytes=64 << 20,
                kernels=args.kernels,
                num_state_slots=16,
                enable_prefix_caching=caching,
            )
        )
        turn1_s, computed, ttft_s = agent_turns(engine, prompt_len, 40, 24)
        snapshots = engine.kv.state_pool.num_snapshots
        print(
            f"  prefix cache {'on ' if caching else 'off'}: turn-1 prefill {1000 * turn1_s:6.1f} ms; turn 2 computes "
            f"{computed} prompt tokens, first token after {1000 * ttft_s:6.1f} ms; {snapshots} snapshots of "
            f"{engine.kv.state_pool.bytes_per_slot} bytes"
        )


def agent_turns(engine: Engine, prompt_len: int, num_generated: int, num_added: int) -> tuple[float, int, float]:
    """Two turns of one agent, each prompt in one chunk: (turn 1's prefill step seconds, best of
    three agents with different prompts; the prompt tokens turn 2 computes; its time to first token)."""
    turn1_times = []
    for agent in range(3):
        prompt = [(7 * i + agent) % 200 + 3 for i in range(prompt_len)]
        first, turn1_s = run_turn(engine, f"t1-{agent}", prompt, num_generated)
        turn1_times.append(turn1_s)
    second = prompt + first + [(11 * i) % 200 + 3 for i in range(num_added)]
    t0 = time.perf_counter()
    out = engine.step(
        StepRequest(
            new_requests=[NewRequest("t2", second, SamplingParams(), 1, ignore_eos=True)],
            scheduled=[ScheduledRequest("t2", len(second))],
        )
    ).outputs[0]
    ttft_s = time.perf_counter() - t0
    return min(turn1_times), len(second) - out.num_cached_tokens, ttft_s


def run_turn(engine: Engine, request_id: str, prompt: list[int], num_new_tokens: int) -> tuple[list[int], float]:
    """Greedy decode of a prompt given in one chunk: (its tokens, the prefill step's seconds)."""
    t0 = time.perf_counter()
    request = NewRequest(request_id, prompt, SamplingParams(), num_new_tokens, ignore_eos=True)
    out = engine.step(
        StepRequest(new_requests=[request], scheduled=[ScheduledRequest(request_id, len(prompt))])
    ).outputs[0]
    prefill_s, tokens = time.perf_counter() - t0, list(out.new_token_ids)
    while out.finish_reason is None:
        out = engine.step(StepRequest(scheduled=[ScheduledRequest(request_id, 1)])).outputs[0]
        tokens += out.new_token_ids
    return tokens, prefill_s


if __name__ == "__main__":
    main()
