"""Prefill on the CPU against this machine's compute peak: the integer matmul's two kernels, and prompts of T tokens.

    python -m executor_svc.tools.bench_prefill [--model default] [--tokens 64,128,...,2048] [--chunk 256]
        [--matmul int16|int8]

An agent's turn is mostly prompt, so prefill speed is what its time to first token is made of.
This prints, on the machine it runs on (its CPU model and vector ISA first):

1. the measured peak: multiply-accumulates per second of the instruction the prompt kernel
   issues (int16-pair dot products at its vector width, 512-bit on AVX-512 and 256-bit on AVX2:
   pmaddwd + paddd, or vpdpwssd with VNNI; with `--matmul int8`, AVX512-VNNI's 512-bit vpdpbusd)
   and of float32 FMA, one thread, times the threads; on CPUs with AMX (Sapphire Rapids and later),
   also the tile unit's TDPBF16PS, and on AVX512-BF16 CPUs without it (Zen 4) VDPBF16PS;
2. the integer matmul (`--matmul`: int16, the CPU default, or int8) on each of the model's layer
   shapes at M rows: one-row register tiles forced ("rows"), the vector tiles ("panels": 8 rows,
   4 on AVX2, and one of the rest) and, on AMX CPUs, the AMX tiles ("amx": 16 rows, the engine's
   from 16 rows); all bit-identical (qlinear.cpp), in GMAC/s and as a fraction of the peak of
   their instruction (the AMX tiles issue two TDPBF16PS per product, one per digit of the int16
   code, so their ceiling is half the tile unit's peak); on AVX512-BF16 CPUs also the opt-in bf16
   matmul (`--matmul bf16`: bf16 weights and activations, float32 sums over all of K, on the AMX
   tiles or with VDPBF16PS), against the engine's int16 path and as a fraction of its instruction's
   peak;
3. one prompt of T tokens prefilled from an empty cache in chunks of `--chunk` tokens (the
   scheduler's default step budget is 256), as the engine runs it (the model's forward over a
   ragged batch, KV written): tokens/s, the layers' matmul GFLOP/s (2 · weights · T), the
   attention's (4 · heads · head_dim per (query, key) pair, causal), and what share of the
   machine's peak for the matmul's vector instruction the whole prefill reaches; on AMX CPUs
   also the same prefill with the AMX tiles turned off, and on AVX512-BF16 CPUs with `--matmul
   bf16` (over the KV cache it takes: bfloat16 where attention over one is fastest), alternating
   with it run by run;
4. where a chunk's time goes as the prompt grows: one layer's matmuls on a chunk of `--chunk`
   rows against its attention (the chunk's queries over the keys before and in it), at each
   context length of `--contexts`, with the attention of one decode row there for scale; where
   attention over a bfloat16 cache is the CPU's fastest (the AMX tiles; VDPBF16PS without AMX),
   also both attentions over one (`--matmul bf16`'s, or `--kv-cache-dtype bfloat16`). An agent's later turns prefill at thousands of tokens of
   context, where attention, not the matmuls, is most of a chunk.

Each point is the best of `--reps` runs: the machines are shared, and the minimum is the run
least disturbed. Compare variants in one run, as ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from executor_svc.engine.model_runner import resolve_kv_cache_dtype, resolve_ops
from executor_svc.kv.kv_cache import KVCache, to_key_layout, to_value_layout
from executor_svc.model.cpu_ops import bfloat16_attention_is_fastest
from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice
from executor_svc.model.transformer import Transformer
from executor_svc.weights.gguf_file import open_gguf
from executor_svc.weights.model_config import ModelConfig
from executor_svc.weights.model_source import resolve_model_path
from executor_svc.weights.model_weights import load_weights
from executor_svc.weights.weight_format import MATMUL_KERNELS, Kernel, PackedWeight, linear

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
ROWS_KERNEL, PANEL_KERNEL, AMX_TILES = 1, 2, 3  # the integer matmul's `path`


def cpu_description() -> dict:
    """The CPU's model name and which of the vector ISAs that matter here it has."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {"model": model, "isa": [f for f in ISA_FLAGS if f in flags], "threads": torch.get_num_threads()}


def best_of(reps: int, run) -> float:
    """The shortest of `reps` timed calls of run() (after one untimed call)."""
    run()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def amx_tiles(kernels, matmul: str) -> bool:
    """Whether the int16 matmul takes the AMX tiles here (for prompts: its own path from 16 rows)."""
    return matmul == "int16" and kernels.has_amx_tiles()


def bf16_kernel(kernels) -> str | None:
    """The kernel `--matmul bf16` takes here: the AMX tiles, VDPBF16PS (AVX512-BF16 without AMX), or none."""
    if not kernels.has_bf16_dot_products():
        return None
    return "amx" if kernels.has_amx_tiles() else "vdpbf16ps"


def measured_peak(kernels, matmul: str) -> dict:
    """MACs/s per thread of int16 pairs and float32 FMA (the best of three), of int8 quads with
    `matmul` int8, of the AMX tiles' TDPBF16PS where the int16 matmul takes them, of the bf16
    matmul's instruction where it runs (TDPBF16PS or VDPBF16PS), and the machine's (times the
    threads) for the matmul's vector instruction and for the bf16 matmul's."""
    int16, fp32 = max(kernels.measure_peak_macs() for _ in range(3))
    per_thread = int16 if matmul == "int16" else max(kernels.measure_int8_peak_macs() for _ in range(3))
    amx = max(kernels.measure_amx_peak_macs() for _ in range(3)) if amx_tiles(kernels, matmul) else 0.0
    bf16_name = bf16_kernel(kernels)
    bf16 = {"amx": kernels.measure_amx_peak_macs, "vdpbf16ps": kernels.measure_bf16_dot_peak_macs}.get(bf16_name)
    bf16_per_thread = max(bf16() for _ in range(3)) if bf16 else 0.0
    threads = torch.get_num_threads()
    return {
        "bf16_kernel": bf16_name,
        "bf16_macs_per_thread": bf16_per_thread,
        "bf16_macs": bf16_per_thread * threads,
        "matmul": matmul,
        "int16_macs_per_thread": int16,
        "fp32_macs_per_thread": fp32,
        "matmul_macs_per_thread": per_thread,
        "matmul_macs": per_thread * threads,
        "amx_macs_per_thread": amx,
        "amx_macs": amx * threads,
    }


def layer_shapes(weights) -> dict[str, PackedWeight]:
    """The first layer's integer-matmul weights by name (every layer has the same shapes)."""
    layer = weights.layers[0]
    named = {"qkv": layer.qkv, "o_proj": layer.o_proj, "gate_up": layer.gate_up, "down": layer.down}
    return {name: w for name, w in named.items() if isinstance(w, PackedWeight) and w.kernel.in_panels}


def integer_matmul(kernels, x: torch.Tensor, w: PackedWeight, path: int = 0) -> torch.Tensor:
    """x · wᵀ by the integer matmul w is tagged for (int16 or int8 activations)."""
    multiply = kernels.qlinear_int8 if w.kernel == Kernel.INT8 else kernels.qlinear_int16
    return multiply(x, w.data, w.tensor_type, w.shape[1], w.shape[0], path=path)


def bench_matmuls(kernels, weights, row_counts: list[int], reps: int, peak: dict) -> list[dict]:
    rows = []
    for name, w in layer_shapes(weights).items():
        n, k = w.shape
        for m in row_counts:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            point = {"weight": name, "n": n, "k": k, "m": m, "type": w.type_name}
            paths = [("rows", ROWS_KERNEL), ("panels", PANEL_KERNEL)]
            if peak["amx_macs"]:
                paths.append(("amx", AMX_TILES))
            for label, path in paths:
                seconds = best_of(reps, lambda: integer_matmul(kernels, x, w, path))
                point[f"{label}_gmacs"] = m * n * k / seconds / 1e9
            point["panels_share_of_peak"] = point["panels_gmacs"] * 1e9 / peak["matmul_macs"]
            if peak["amx_macs"]:
                point["amx_share_of_peak"] = point["amx_gmacs"] * 1e9 / peak["amx_macs"]
            if peak["bf16_macs"]:
                bf16 = w.for_kernel(Kernel.BF16)
                point["bf16_gmacs"] = m * n * k / best_of(reps, lambda: linear(x, bf16)) / 1e9
                point["bf16_share_of_peak"] = point["bf16_gmacs"] * 1e9 / peak["bf16_macs"]  # one bf16 product a MAC
            rows.append(point)
    return rows


def matmul_macs_per_token(weights) -> int:
    """Multiply-accumulates of every layer's matmuls for one token (the LM head runs once per prompt)."""
    total = 0
    for layer in weights.layers:
        for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            parts = w if isinstance(w, tuple) else (w,)
            total += sum(p.shape[0] * p.shape[1] for p in parts if p is not None)
    return total


def attention_macs(config: ModelConfig, num_tokens: int) -> int:
    """QK and PV multiply-accumulates of a causal prefill of num_tokens tokens from an empty cache."""
    pairs = num_tokens * (num_tokens + 1) // 2
    return 2 * pairs * config.num_heads * config.head_dim * len(config.kv_layers)


def prefill_seconds(model: Transformer, cache: KVCache, num_tokens: int, chunk: int, reps: int) -> float:
    """One prompt of num_tokens (fixed random ids) prefilled from an empty cache in chunks."""
    ids = torch.randint(3, model.config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    blocks = cache.allocator.allocate(cache.num_blocks_for(num_tokens))

    def run() -> None:
        for start in range(0, num_tokens, chunk):
            piece = ids[start : start + chunk]
            last = start + len(piece) == num_tokens
            batch = RaggedBatch.build(
                [RequestSlice(piece, start, blocks, 1 if last else 0)], cache.block_size, model.device
            )
            model.forward(batch, cache)

    try:
        return best_of(reps, run)
    finally:
        cache.allocator.free(blocks)


def bench_prefill(
    kernels,
    model: Transformer,
    kv_dtype,
    token_counts: list[int],
    chunk: int,
    reps: int,
    peak: dict,
    bf16_model: Transformer | None = None,
) -> list[dict]:
    """Each prompt length as the engine runs it; where the int16 matmul takes the AMX tiles, also
    with them turned off (the vector tiles: the same bits) and, given `bf16_model`, with
    `--matmul bf16` over its bfloat16 KV cache, alternating run by run."""
    config = model.config
    num_blocks = 2 + max(token_counts) // 16
    cache = KVCache(config, num_blocks, 16, kv_dtype, model.device, model.ops.kv_layout)
    bf16_kv = resolve_kv_cache_dtype("auto", torch.float32, model.ops, "bf16", config.head_dim)
    bf16_cache = KVCache(config, num_blocks, 16, bf16_kv, model.device, model.ops.kv_layout) if bf16_model else None
    per_token = matmul_macs_per_token(model.weights)
    rows = []
    for t in token_counts:
        seconds = vector_seconds = bf16_seconds = float("inf")
        for _ in range(reps):
            seconds = min(seconds, prefill_seconds(model, cache, t, chunk, 1))
            if bf16_model is not None:
                bf16_seconds = min(bf16_seconds, prefill_seconds(bf16_model, bf16_cache, t, chunk, 1))
            if peak["amx_macs"]:
                kernels.allow_amx_tiles(False)
                try:
                    vector_seconds = min(vector_seconds, prefill_seconds(model, cache, t, chunk, 1))
                finally:
                    kernels.allow_amx_tiles(True)
        matmul, attention = per_token * t, attention_macs(config, t)
        rows.append(
            {
                "tokens": t,
                "seconds": seconds,
                "tokens_per_s": t / seconds,
                "matmul_gflops": 2 * matmul / seconds / 1e9,
                "attention_gflops": 2 * attention / seconds / 1e9,
                "share_of_peak": (matmul + attention) / seconds / peak["matmul_macs"],
                "vector_tiles_seconds": vector_seconds if peak["amx_macs"] else None,
                "bf16_seconds": bf16_seconds if bf16_model is not None else None,
                "bf16_share_of_peak": (matmul + attention) / bf16_seconds / peak["bf16_macs"] if bf16_model else None,
            }
        )
    return rows


def attention_seconds(
    kernels, config: ModelConfig, kv_dtype, kv_layout: str, num_queries: int, context: int, reps: int
) -> float:
    """One request's `num_queries` last tokens of `context` over the paged KV, one layer (random q, K, V)."""
    block_size, generator = 16, torch.Generator().manual_seed(context)
    num_blocks = -(-context // block_size)
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    k_cache = to_key_layout(torch.randn(shape, generator=generator).to(kv_dtype), kv_layout)
    v_cache = to_value_layout(torch.randn(shape, generator=generator).to(kv_dtype), kv_layout)
    q = torch.randn(num_queries, config.num_heads, config.head_dim, generator=generator)
    one = torch.zeros(1, dtype=torch.long)
    lens, contexts = torch.tensor([num_queries]), torch.tensor([context])
    table = torch.arange(num_blocks, dtype=torch.int32).view(1, -1)
    scale = config.head_dim**-0.5
    return best_of(reps, lambda: kernels.paged_attention(q, k_cache, v_cache, one, lens, contexts, table, scale))


def bench_chunk_costs(
    kernels, weights, config: ModelConfig, kv_dtype, kv_layout: str, chunk: int, contexts: list[int], reps: int
):
    """Per layer: a chunk's matmuls (the prompt kernel's path at `chunk` rows) and its attention
    ending at each context length, and one decode row's attention there; where attention over a
    bfloat16 cache is the CPU's fastest (the AMX tiles, or VDPBF16PS without AMX), both attentions
    again over one."""
    tiles = bfloat16_attention_is_fastest(config.head_dim)
    x = {k: torch.randn(chunk, k) for k in {w.shape[1] for w in layer_shapes(weights).values()}}
    matmuls = sum(
        best_of(reps, lambda w=w: integer_matmul(kernels, x[w.shape[1]], w)) for w in layer_shapes(weights).values()
    )
    rows = []
    for context in contexts:
        attention = attention_seconds(kernels, config, kv_dtype, kv_layout, min(chunk, context), context, reps)
        decode_row = attention_seconds(kernels, config, kv_dtype, kv_layout, 1, context, reps)
        on_tiles = {}
        if tiles:
            on_tiles = {
                "bf16_kv_attention_s": attention_seconds(
                    kernels, config, torch.bfloat16, kv_layout, min(chunk, context), context, reps
                ),
                "bf16_kv_decode_row_attention_s": attention_seconds(
                    kernels, config, torch.bfloat16, kv_layout, 1, context, reps
                ),
            }
        rows.append(
            {
                "context": context,
                "matmul_s": matmuls,
                "attention_s": attention,
                "attention_per_matmul": attention / matmuls,
                "decode_row_attention_s": decode_row,
                **on_tiles,
            }
        )
    return rows


def run(
    model_name: str,
    token_counts: list[int],
    row_counts: list[int],
    chunk: int,
    kv_cache_dtype: str,
    reps: int,
    contexts: list[int],
    matmul: str = "int16",
):
    from executor_svc.cpu_kernels import load

    kernels = load()
    gguf = open_gguf(resolve_model_path(model_name))
    config = ModelConfig.from_gguf(gguf)
    cpu = torch.device("cpu")
    ops = resolve_ops("cpu", cpu)
    weights = load_weights(gguf, config, torch.float32, cpu, matmul_kernel=MATMUL_KERNELS[matmul])
    model = Transformer(config, weights, cpu, ops, torch.float32)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, torch.float32, ops, matmul, config.head_dim)
    peak = measured_peak(kernels, matmul)
    bf16_model = None
    if peak["bf16_macs"]:
        bf16_weights = load_weights(gguf, config, torch.float32, cpu, matmul_kernel=Kernel.BF16)
        bf16_model = Transformer(config, bf16_weights, cpu, ops, torch.float32)
    return {
        "model": config.name,
        "cpu": cpu_description(),
        "peak": peak,
        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        "chunk": chunk,
        "matmuls": bench_matmuls(kernels, weights, row_counts, reps, peak),
        "prefill": bench_prefill(kernels, model, kv_dtype, token_counts, chunk, reps, peak, bf16_model),
        "chunk_costs": bench_chunk_costs(kernels, weights, config, kv_dtype, ops.kv_layout, chunk, contexts, reps),
    }


def print_report(r: dict) -> None:
    cpu, peak = r["cpu"], r["peak"]
    print(f"{cpu['model']} ({', '.join(cpu['isa'])}), {cpu['threads']} threads; model {r['model']}")
    matmul = peak["matmul"]
    print(
        f"measured peak per thread: int16 pairs {peak['int16_macs_per_thread'] / 1e9:.1f} GMAC/s, "
        f"float32 FMA {peak['fp32_macs_per_thread'] / 1e9:.1f} GMAC/s"
        + (f", int8 quads {peak['matmul_macs_per_thread'] / 1e9:.1f} GMAC/s" if matmul == "int8" else "")
        + f"; machine {matmul} peak {peak['matmul_macs'] / 1e9:.1f} GMAC/s"
        + (f"; AMX TDPBF16PS {peak['amx_macs_per_thread'] / 1e9:.0f} GMAC/s a thread" if peak["amx_macs"] else "")
        + (
            f"; VDPBF16PS {peak['bf16_macs_per_thread'] / 1e9:.1f} GMAC/s a thread (the bf16 matmul's)"
            if peak["bf16_kernel"] == "vdpbf16ps"
            else ""
        )
    )
    amx, bf16 = bool(peak["amx_macs"]), peak["bf16_kernel"]
    print(
        f"\nthe {matmul} matmul, GMAC/s (rows: one-row tiles; panels: the vector tiles"
        + ("; amx: the AMX tiles, the engine's from 16 rows" if amx else ", the engine's")
        + "; all bit-identical):"
    )
    if bf16:
        print(
            f"bf16: the opt-in --matmul bf16 ({'AMX tiles' if bf16 == 'amx' else 'VDPBF16PS'}; other bits), "
            f"of its instruction's peak; x: over the engine's int16 ({'amx, or ' if amx else ''}panels"
            f"{' below 16 rows' if amx else ''})"
        )
    amx_head = f" {'amx':>7} {'x':>5} {'of AMX':>7}" if amx else ""
    bf16_head = f" | {'bf16':>7} {'x':>5} {'of peak':>7}" if bf16 else ""
    print(
        f"{'weight':>8} {'N':>6} {'K':>6} {'M':>6} | {'rows':>7} {'panels':>7} {'x':>5} {'of peak':>8}"
        + amx_head
        + bf16_head
    )
    for m in r["matmuls"]:
        amx_cells = ""
        engine = m["amx_gmacs"] if amx and m["m"] >= 16 else m["panels_gmacs"]
        if amx:
            amx_cells = (
                f" {m['amx_gmacs']:7.1f} {m['amx_gmacs'] / m['panels_gmacs']:5.2f} {m['amx_share_of_peak']:7.0%}"
            )
        if bf16:
            amx_cells += f" | {m['bf16_gmacs']:7.1f} {m['bf16_gmacs'] / engine:5.2f} {m['bf16_share_of_peak']:7.0%}"
        print(
            f"{m['weight']:>8} {m['n']:>6} {m['k']:>6} {m['m']:>6} | {m['rows_gmacs']:7.1f} {m['panels_gmacs']:7.1f} "
            f"{m['panels_gmacs'] / m['rows_gmacs']:5.2f} {m['panels_share_of_peak']:8.0%}{amx_cells}"
        )
    print(f"\none prompt from an empty cache, chunks of {r['chunk']}, KV {r['kv_cache_dtype']}:")
    if bf16:
        print("bf16 s: --matmul bf16 over its own KV cache, alternating run by run; x: int16's seconds ÷ bf16's")
    vector_head = f" | {'vector tiles s':>14} {'x':>5}" if amx else ""
    vector_head += f" | {'bf16 s':>7} {'x':>5} {'of bf16 peak':>12}" if bf16 else ""
    print(
        f"{'T':>6} | {'s':>7} {'tok/s':>7} {'matmul GFLOP/s':>15} {'attn GFLOP/s':>13} {'of ' + matmul + ' peak':>14}"
        + vector_head
    )
    for p in r["prefill"]:
        vector_cells = (
            f" | {p['vector_tiles_seconds']:14.3f} {p['vector_tiles_seconds'] / p['seconds']:5.2f}" if amx else ""
        )
        if bf16:
            vector_cells += (
                f" | {p['bf16_seconds']:7.3f} {p['seconds'] / p['bf16_seconds']:5.2f} {p['bf16_share_of_peak']:12.0%}"
            )
        print(
            f"{p['tokens']:>6} | {p['seconds']:7.3f} {p['tokens_per_s']:7.0f} {p['matmul_gflops']:15.1f} "
            f"{p['attention_gflops']:13.1f} {p['share_of_peak']:14.0%}{vector_cells}"
        )
    print(f"\nper layer, a chunk of {r['chunk']} prompt tokens ending at each context (ms), KV {r['kv_cache_dtype']}:")
    tiles = "bf16_kv_attention_s" in r["chunk_costs"][0]
    if tiles:
        print(
            "bf16 KV: attention over a bfloat16 cache (--matmul bf16's: "
            + ("the AMX tiles" if peak["bf16_kernel"] == "amx" else "VDPBF16PS")
            + "); x: KV's attention ÷ its"
        )
    tiles_head = f" | {'bf16 KV attn':>12} {'x':>5} {'bf16 KV decode row':>19}" if tiles else ""
    print(
        f"{'context':>8} | {'matmuls':>8} {'attention':>10} {'attn/matmuls':>13} | {'1 decode row attn':>18}"
        + tiles_head
    )
    for c in r["chunk_costs"]:
        tiles_cells = (
            f" | {c['bf16_kv_attention_s'] * 1e3:12.2f} {c['attention_s'] / c['bf16_kv_attention_s']:5.2f}"
            f" {c['bf16_kv_decode_row_attention_s'] * 1e3:19.3f}"
            if tiles
            else ""
        )
        print(
            f"{c['context']:>8} | {c['matmul_s'] * 1e3:8.2f} {c['attention_s'] * 1e3:10.2f} "
            f"{c['attention_per_matmul']:13.2f} | {c['decode_row_attention_s'] * 1e3:18.3f}{tiles_cells}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", default="64,128,256,512,1024,2048", help="prompt lengths")
    parser.add_argument("--rows", default="1,8,64,256,1024", help="M for the matmul kernels")
    parser.add_argument("--chunk", type=int, default=256, help="prefill tokens per forward pass")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    parser.add_argument("--contexts", default="256,1024,2048,4096,8192", help="context lengths for the chunk costs")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--matmul", default="int16", choices=("int16", "int8"), help="the integer matmul")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = run(
        args.model,
        [int(x) for x in args.tokens.split(",")],
        [int(x) for x in args.rows.split(",")],
        args.chunk,
        args.kv_cache_dtype,
        args.reps,
        [int(x) for x in args.contexts.split(",")],
        args.matmul,
    )
    print_report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
