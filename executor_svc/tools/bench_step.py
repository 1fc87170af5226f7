"""Step time vs tokens per step and vs decode batch size: the cost model's input.

    python -m executor_svc.tools.bench_step [--model default] [--variants float32/exact,float32/int16]

Two sweeps per variant, each point the median of `--reps` forward passes (the
model's forward over a ragged batch plus building the batch, as a step runs it):
- T sweep: one request computing T new tokens on top of `--context` cached ones
  (T = 1 is a decode step, T > 1 a prefill chunk or a verify run);
- B sweep: B requests each decoding one token with `--context` cached tokens.
Ratios are to T = 1 / B = 1 of the same variant (a dtype and a CPU matmul: exact, int16,
int8 or bf16, see `--matmul`), measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from executor_svc.engine.model_runner import DTYPES, resolve_ops
from executor_svc.kv.kv_cache import KVCache
from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice
from executor_svc.model.transformer import Transformer
from executor_svc.weights.gguf_file import open_gguf
from executor_svc.weights.model_config import ModelConfig
from executor_svc.weights.model_source import resolve_model_path
from executor_svc.weights.model_weights import load_weights
from executor_svc.weights.weight_format import MATMUL_KERNELS, has_matmul


def time_forward(model: Transformer, cache: KVCache, slices: list[RequestSlice], reps: int, row_multiple: int) -> float:
    def once() -> float:
        t0 = time.perf_counter()
        batch = RaggedBatch.build(slices, cache.block_size, model.device, row_multiple)
        model.forward(batch, cache)
        return time.perf_counter() - t0

    for _ in range(2):
        once()
    return statistics.median(once() for _ in range(reps))


def run(model_name: str, variants: list[str], context: int, reps: int, t_values, b_values) -> dict:
    gguf = open_gguf(resolve_model_path(model_name))
    config = ModelConfig.from_gguf(gguf)
    device = torch.device("cpu")
    results: dict = {"model": config.name, "context": context, "threads": torch.get_num_threads(), "variants": {}}
    for name in variants:
        dtype_name, _, matmul = name.partition("/")
        dtype = DTYPES[dtype_name]
        if not has_matmul(matmul):
            print(f"skipping {name}: this CPU has no {matmul} matmul")
            continue
        weights = load_weights(gguf, config, dtype, device, matmul_kernel=MATMUL_KERNELS.get(matmul))
        model = Transformer(config, weights, device, resolve_ops("auto", device), dtype)  # the engine's ops
        rows = 1 if weights.is_packed else 4  # packed-weight kernels need no row padding to stay invariant
        max_b = max(b_values)
        blocks_per_request = -(-(context + max(t_values)) // 16)
        cache = KVCache(config, 1 + blocks_per_request * max_b, 16, dtype, device, model.ops.kv_layout)
        tables = [cache.allocator.allocate(blocks_per_request) for _ in range(max_b)]
        # Fill each request's cached context once, so attention reads real values.
        for table in tables:
            batch = RaggedBatch.build([RequestSlice([7] * context, 0, table, 1)], 16, device)
            model.forward(batch, cache)

        # Warm up once before measuring: the first passes after a load run slow (caches, page faults).
        time_forward(model, cache, [RequestSlice([11] * max(t_values), context, tables[0], 1)], 3, rows)
        by_t = {}
        for t in t_values:
            by_t[t] = time_forward(model, cache, [RequestSlice([11] * t, context, tables[0], 1)], reps, rows)
        by_b = {}
        for b in b_values:
            by_b[b] = time_forward(
                model, cache, [RequestSlice([11], context, tables[i], 1) for i in range(b)], reps, rows
            )
        results["variants"][name] = {
            "step_s_by_tokens": by_t,
            "step_s_by_batch": by_b,
        }
    return results


def print_table(results: dict) -> None:
    names = list(results["variants"])
    print(f"model {results['model']}, {results['context']} cached tokens per request, {results['threads']} threads")
    print("\nstep time vs tokens computed in one request (T):")
    print("     T | " + " | ".join(f"{n:>9} ms  ×t(1)" for n in names))
    t_values = list(results["variants"][names[0]]["step_s_by_tokens"])
    for t in t_values:
        cells = []
        for n in names:
            by_t = results["variants"][n]["step_s_by_tokens"]
            cells.append(f"{by_t[t] * 1e3:12.1f} {by_t[t] / by_t[t_values[0]]:6.2f}")
        print(f"{t:6d} | " + " | ".join(cells))
    print("\nstep time vs decode batch size (B requests × 1 token):")
    print("     B | " + " | ".join(f"{n:>9} ms  tok/s" for n in names))
    b_values = list(results["variants"][names[0]]["step_s_by_batch"])
    for b in b_values:
        cells = []
        for n in names:
            s = results["variants"][n]["step_s_by_batch"][b]
            cells.append(f"{s * 1e3:12.1f} {b / s:6.0f}")
        print(f"{b:6d} | " + " | ".join(cells))
    if len(names) == 2:
        a, b = names
        print(f"\n{b} vs {a} (time ratio, < 1 is faster):")
        for t in t_values:
            r = results["variants"][b]["step_s_by_tokens"][t] / results["variants"][a]["step_s_by_tokens"][t]
            print(f"  T={t:4d}: {r:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument(
        "--variants",
        default="float32/exact,float32/int16",
        help="dtype/matmul pairs (matmul: exact | int16 | int8 | bf16)",
    )
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = run(
        args.model,
        args.variants.split(","),
        args.context,
        args.reps,
        [int(x) for x in args.tokens.split(",")],
        [int(x) for x in args.batch_sizes.split(",")],
    )
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
