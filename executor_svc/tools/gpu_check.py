"""One-shot check of the Triton kernels on a real accelerator: correctness, speed, equivalence.

    python -m executor_svc.tools.gpu_check                    # CUDA/ROCm machine, < 8 minutes
    python -m executor_svc.tools.gpu_check --dry-run          # tiny sizes on CPU, interpreted
    python -m executor_svc.tools.gpu_check --only correct,invariant

Sections, most important first (each check is guarded, so one failure keeps the
rest; a time budget skips whatever is left when it runs out: --budget-s in all, of
which the kernel sections stop --swarm-budget-s early to leave the swarm section its
time):

- env        torch / triton / device.
- roofline   device-to-device copy bandwidth and bf16 matmul rate: the yardsticks.
- correct    every kernel against the torch reference (`TorchOps`) on fresh random
             inputs at both model shapes: ‖out − ref‖ / ‖ref‖ per dtype; the Gated
             DeltaNet kernels (causal conv, delta rule, verify-window states, the chunked
             delta rule against torch's chunked and recurrent forms) on a ragged batch at
             Qwen3.5-9B's DeltaNet shape, with the max abs error too.
- invariant  the attention kernel's batch invariance, bit for bit, on the device; the
             DeltaNet kernels' too (a request alone, in a batch, in two chunks).
- greedy     a random-weight model of the small shape decoding a ragged batch for
             ~32 steps in lockstep (both op sets are fed the torch path's greedy
             tokens; every 8th step is a 3-token verify run): argmax mismatches and the
             max logit difference.
- kernel     each kernel, Triton vs torch, for B = 1 .. 64 decode tokens at context
             512 (bytes moved / time against the copy bandwidth); attention prefill
             (flops / time against the matmul rate); the DeltaNet kernels the same way
             (their bytes are the recurrent/conv states read and written) and the delta
             rule over prefills (tokens/s of the recurrent and the chunked Triton kernel; torch
             runs its chunked form there).
- step       a whole decode step (`Transformer.forward`), TritonOps vs TorchOps.
- swarm      the real services end to end on random-weight Qwen3-8B and Qwen3.5-9B
             Q4_K_M files (gpu_swarm.py): the speculation curve, decode tokens/s of
             N = 1, 4, 8, 16 HTTP streams beside the weight-stream floor, TTFT of a
             2K-token prompt, the swarm benchmark, greedy tokens against the CPU path.

Progress goes to stderr with timestamps, ONE compact table to stdout at the end, and
every measurement as JSON to --out (default $OUT)/gpu_check.json (rewritten after each
section, so a run cut short still leaves what it measured). Exits 1 when a check fails
or a section raised.

The kernel sections import only torch, triton, numpy and this repository (the model
modules import the `gguf` package only to read model files, which they never do); the
swarm section needs the services' packages too (this package installed), and says which
are missing instead of installing any.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import sys
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass

import torch

SMALL_MODEL = dict(  # the embedded model's shape (SmolLM2-135M)
    name="small",
    num_layers=30,
    hidden_size=576,
    intermediate_size=1536,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    vocab_size=49152,
)
BIG_MODEL = dict(  # an 8B-class layer shape, 8 layers
    name="big",
    num_layers=8,
    hidden_size=4096,
    intermediate_size=14336,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=128256,
)
TINY_MODEL = dict(  # --dry-run
    name="tiny",
    num_layers=2,
    hidden_size=64,
    intermediate_size=96,
    num_heads=6,
    num_kv_heads=2,
    head_dim=32,
    vocab_size=300,
)
# Gated DeltaNet layer shapes: Qwen3.5-9B's (the seeds' model), and a tiny one for --dry-run.
QWEN35_DELTA_NET = dict(name="qwen35-9b", key_heads=16, heads=32, dk=128, dv=128, kernel=4)
TINY_DELTA_NET = dict(name="tiny", key_heads=1, heads=2, dk=16, dv=24, kernel=4)
BLOCK_SIZE = 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# ‖out − ref‖ / ‖ref‖ bounds for "ok": float32 math throughout, inputs and outputs rounded per dtype.
REL_TOLERANCE = {"fp32": 1e-5, "bf16": 1.6e-2, "fp16": 2e-3}
KERNEL_SECTIONS = ("env", "roofline", "correct", "invariant", "greedy", "kernel", "step", "qmatmul", "decode")
SECTIONS = (*KERNEL_SECTIONS, "swarm")  # swarm: the served models end to end (gpu_swarm.py)


@dataclass(frozen=True)
class Sizes:
    models: tuple[dict, ...]
    delta_net: dict
    delta_net_prefill_len: int  # tokens per request in the delta rule's prefill timing
    batch_sizes: tuple[int, ...]
    context: int  # tokens already cached per request in the decode timings
    prefill_requests: int
    prefill_len: int
    greedy_steps: int
    greedy_prompt_lens: tuple[int, ...]
    copy_bytes: int
    matmul_n: int
    bench_warmup_ms: int
    bench_rep_ms: int

    @classmethod
    def full(cls) -> "Sizes":
        return cls(
            models=(SMALL_MODEL, BIG_MODEL),
            delta_net=QWEN35_DELTA_NET,
            delta_net_prefill_len=512,
            batch_sizes=(1, 2, 4, 8, 16, 32, 64),
            context=512,
            prefill_requests=4,
            prefill_len=512,
            greedy_steps=32,
            greedy_prompt_lens=(5, 17, 33, 64, 100, 150),
            copy_bytes=1 << 30,
            matmul_n=8192,
            bench_warmup_ms=5,
            bench_rep_ms=40,
        )

    @classmethod
    def dry_run(cls) -> "Sizes":
        return cls(
            models=(TINY_MODEL,),
            delta_net=TINY_DELTA_NET,
            delta_net_prefill_len=8,  # the interpreter runs the recurrence token by token
            batch_sizes=(1, 4),
            context=40,
            prefill_requests=2,
            prefill_len=24,
            greedy_steps=9,
            greedy_prompt_lens=(3, 17),
            copy_bytes=1 << 22,
            matmul_n=128,
            bench_warmup_ms=0,
            bench_rep_ms=0,
        )


class Report:
    """Measurements, errors, the clock and the time budget; the JSON file and the final table."""

    def __init__(self, budget_s: float, out_dir: str | None, name: str = "gpu_check") -> None:
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.out_dir = out_dir
        self.name = name  # of the .json and .txt files in out_dir
        self.records: list[dict] = []
        self.errors: list[dict] = []
        self.env: dict = {}
        self.yardsticks: dict = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        return self.elapsed() > self.budget_s

    def log(self, message: str) -> None:
        sys.stderr.write(f"[{time.strftime('%H:%M:%S')} +{self.elapsed():6.1f}s] {message}\n")
        sys.stderr.flush()

    def add(self, section: str, name: str, model: str = "", dtype: str = "", size: str = "", **values) -> None:
        record = dict(section=section, name=name, model=model, dtype=dtype, size=size, **values)
        self.records.append(record)
        shown = " ".join(f"{k}={_short(v)}" for k, v in values.items())
        self.log(f"{section} {name} {model} {dtype} {size}: {shown}")

    def run(self, section: str, label: str, fn, *args) -> None:
        """fn(*args), guarded: an exception becomes an error entry and the run goes on."""
        if self.over_budget():
            self.errors.append(dict(section=section, name=label, error="skipped: time budget spent"))
            self.log(f"{section} {label}: skipped (time budget)")
            return
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - a check reports every failure and carries on
            first_line = (str(exc).strip().splitlines() or [""])[0][:300]
            error = f"{type(exc).__name__}: {first_line}"
            self.errors.append(dict(section=section, name=label, error=error, traceback=traceback.format_exc()))
            self.log(f"{section} {label}: FAILED\n{traceback.format_exc()}")
            if torch.cuda.is_available():
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001 - a sticky CUDA error shows up in the next check too
                    pass

    def save(self) -> None:
        if not self.out_dir:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        data = dict(
            env=self.env, yardsticks=self.yardsticks, records=self.records, errors=self.errors, elapsed_s=self.elapsed()
        )
        with open(os.path.join(self.out_dir, f"{self.name}.json"), "w") as f:
            json.dump(data, f, indent=1, default=str)

    def num_failed(self) -> int:
        return sum(1 for r in self.records if r.get("ok") is False) + len(self.errors)

    def table(self) -> str:
        lines = [_format_row(row) for row in _summary_rows(self)]
        widths = [max(len(row[i]) for row in lines) for i in range(3)]
        text = ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in lines]
        text.insert(1, "-" * 100)
        for error in self.errors:
            text.append(f"ERROR {error['section']} / {error['name']}: {error['error']}")
        failures = self.num_failed()
        text.append(f"total {self.elapsed():.0f}s, {len(self.records)} measurements, {failures} failures or errors")
        return "\n".join(text)


def _short(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _format_row(row: tuple[str, str, str, str]) -> tuple[str, str, str, str]:
    return tuple(str(cell) for cell in row)


def _summary_rows(report: Report) -> list[tuple[str, str, str, str]]:
    """The table: one line per check (dtypes or batch sizes side by side)."""
    rows = [("section", "check", "model", "result")]
    by_key: dict[tuple, list[dict]] = defaultdict(list)
    for r in report.records:
        by_key[r["section"], r["name"], r["model"]].append(r)
    for (section, name, model), records in by_key.items():
        if section == "env":
            result = ", ".join(f"{k}={v}" for k, v in report.env.items())
        elif section == "roofline":
            result = "; ".join(f"{r['value']:.0f} {r['unit']} ({r['size']})" for r in records)
        elif section in ("correct", "invariant"):
            result = "  ".join(f"{r['dtype']}: {r['summary']}" for r in records)
        elif section == "greedy":
            result = "  |  ".join(f"{r['dtype']}: {r['summary']}" for r in records)
        elif section == "kernel" and name == "delta_rule_prefill":
            result = "  |  ".join(
                f"{r['size']}: triton recurrent {r['triton_us']:.0f}us chunked {r['triton_chunked_us']:.0f}us "
                f"torch (chunked) {r['torch_us']:.0f}us; {r['tokens_per_s']:.0f} / {r['chunked_tokens_per_s']:.0f} tokens/s"
                for r in records
            )
        elif section == "kernel" and name != "attention_prefill":
            cells = [f"B{r['batch']}: {r['triton_us']:.1f}/{r['torch_us']:.1f}" for r in records]
            last = records[-1]
            share = f" = {100 * last['fraction_of_copy']:.0f}% of copy" if last.get("fraction_of_copy") else ""
            result = "us triton/torch  " + "  ".join(cells) + f"  | B{last['batch']}: {last['gbps']:.0f} GB/s{share}"
        elif section == "kernel":
            r = records[-1]
            share = f" = {100 * r['fraction_of_matmul']:.0f}% of matmul" if r.get("fraction_of_matmul") else ""
            times = f"triton {r['triton_us']:.0f}us torch {r['torch_us']:.0f}us"
            result = f"{r['size']}: {times}, {r['tflops']:.1f} TFLOP/s{share}"
        elif section == "step":
            cells = [f"B{r['batch']}: {r['triton_ms']:.2f}/{r['torch_ms']:.2f}" for r in records]
            result = "ms triton/torch  " + "  ".join(cells)
        elif section in ("qmatmul", "decode", "swarm"):
            result = "  |  ".join(f"{r['dtype']} {r['size']}: {r['summary']}" for r in records)
        else:
            result = str(records)
        rows.append((section, name, model, result))
    return rows


class Bench:
    """Milliseconds per call: triton's do_bench (CUDA events, L2 flushed, median) on a device; a wall clock on CPU."""

    def __init__(self, device: torch.device, sizes: Sizes) -> None:
        self.device = device
        self.sizes = sizes

    def ms(self, fn) -> float:
        if self.device.type != "cpu":
            import triton.testing

            warmup, rep = self.sizes.bench_warmup_ms, self.sizes.bench_rep_ms
            return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(‖out − ref‖ / ‖ref‖, max |out − ref|), in float64."""
    out, ref = out.double(), ref.double()
    norm = float(ref.norm())
    diff = float((out - ref).norm())
    max_abs = float((out - ref).abs().max()) if out.numel() else 0.0
    return (diff / norm if norm else diff), max_abs


# ----------------------------------------------------------------------------- inputs


class PagedInputs:
    """A paged KV cache of random K/V for requests of given context lengths, in shuffled blocks."""

    def __init__(self, shape: dict, context_lens: list[int], dtype, device, gen) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        hkv, d = shape["num_kv_heads"], shape["head_dim"]
        blocks_per_request = [math.ceil(n / BLOCK_SIZE) for n in context_lens]
        num_blocks = 1 + sum(blocks_per_request) + 2
        # [num_blocks, block_size, num_kv_heads, head_dim]; block 0 is the null block
        self.k_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=gen, device=device).to(dtype)
        self.v_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=gen, device=device).to(dtype)
        self.k_cache[0] = 0
        self.v_cache[0] = 0
        order = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0)) + 1).tolist()
        self.tables = []
        for count in blocks_per_request:
            self.tables.append(order[:count])
            order = order[count:]
        # [requests, max_context, heads, head_dim]: one fixed query row per (request, position)
        shape_q = (len(context_lens), max(context_lens), shape["num_heads"], d)
        self.q_rows = torch.randn(*shape_q, generator=gen, device=device).to(dtype)

    def batch(self, parts, row_multiple: int = 1):
        """parts: (request, first position, query tokens) → (RaggedBatch, q [num_padded_tokens, heads, head_dim])."""
        from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice

        slices = [RequestSlice([0] * m, s, self.tables[r], num_logits=1) for r, s, m in parts]
        batch = RaggedBatch.build(slices, BLOCK_SIZE, self.device, row_multiple=row_multiple)
        q = torch.zeros(batch.num_padded_tokens, *self.q_rows.shape[2:], dtype=self.dtype, device=self.device)
        for (r, s, m), q0 in zip(parts, batch.query_starts):
            q[q0 : q0 + m] = self.q_rows[r, s : s + m]
        return batch, q


def _dims(shape: dict) -> tuple[int, int, int, int, int]:
    """(hidden, head_dim, heads, kv_heads, intermediate)"""
    return tuple(shape[k] for k in ("hidden_size", "head_dim", "num_heads", "num_kv_heads", "intermediate_size"))


def _ops():
    from executor_svc.kernels.triton_ops import TritonOps
    from executor_svc.model.torch_ops import TorchOps

    return TritonOps(), TorchOps()


# ----------------------------------------------------------------------------- env, roofline


def section_env(report: Report, device: torch.device) -> None:
    import triton

    from executor_svc.kernels import triton_available

    report.env = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        triton=triton.__version__,
        device=str(device),
        triton_available=triton_available(),
        interpreter=os.environ.get("TRITON_INTERPRET", "0") == "1",
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
        report.env.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1), capability=capability)
    report.add("env", "versions")


def section_roofline(report: Report, bench: Bench, sizes: Sizes, device: torch.device) -> None:
    src = torch.empty(sizes.copy_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = bench.ms(functools.partial(dst.copy_, src))
    gbps = 2 * sizes.copy_bytes / ms / 1e6  # read + write
    report.yardsticks["copy_gbps"] = gbps
    size = f"{sizes.copy_bytes >> 20} MiB"
    report.add("roofline", "d2d_copy", dtype="bf16", size=size, value=gbps, unit="GB/s", ms=ms)
    del src, dst
    n = sizes.matmul_n
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    ms = bench.ms(lambda: torch.matmul(a, b, out=c))
    tflops = 2 * n**3 / ms / 1e9
    report.yardsticks["matmul_tflops"] = tflops
    report.add("roofline", "bf16_matmul", dtype="bf16", size=f"{n}^3", value=tflops, unit="TFLOP/s", ms=ms)


# ----------------------------------------------------------------------------- correctness


def _compare(report: Report, name: str, shape: dict, dtype_name: str, size: str, out, ref) -> None:
    rel, max_abs = relative_error(out.float(), ref.float())
    ok = rel <= REL_TOLERANCE[dtype_name]
    summary = f"{rel:.1e}" + ("" if ok else " FAIL")
    report.add("correct", name, shape["name"], dtype_name, size, rel_err=rel, max_abs=max_abs, ok=ok, summary=summary)


def section_correct_small_kernels(report: Report, shape: dict, dtype_name: str, device, sizes: Sizes) -> None:
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device=device).manual_seed(12)
    t = 4 * max(sizes.batch_sizes)  # tokens
    h, hd, nh, nkv, inter = _dims(shape)
    triton_ops, torch_ops = _ops()
    eps = 1e-5

    def randn(*size, scale=1.0):
        return (scale * torch.randn(*size, generator=gen, device=device)).to(dtype)

    def near_one(n):
        return (1 + 0.1 * torch.randn(n, generator=gen, device=device)).to(dtype)

    x, residual, weight = randn(t, h), randn(t, h, scale=4.0), near_one(h)
    qkv = randn(t, (nh + 2 * nkv) * hd)
    q = qkv[:, : nh * hd].view(t, nh, hd)  # a strided view, as the model passes it
    k = qkv[:, nh * hd : (nh + nkv) * hd].view(t, nkv, hd)
    v = qkv[:, (nh + nkv) * hd :].view(t, nkv, hd)
    head_weight = near_one(hd)
    positions = torch.randint(0, 4096, (t,), generator=gen, device=device).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device=device).float() / hd))
    cos, sin = (positions[:, None] * inv_freq[None, :]).cos(), (positions[:, None] * inv_freq[None, :]).sin()
    gate_up = randn(t, 2 * inter, scale=2.0)

    def both(method, *args):
        return getattr(triton_ops, method)(*args), getattr(torch_ops, method)(*args)

    def check_rms_norm():
        _compare(report, "rms_norm", shape, dtype_name, f"T={t} n={h}", *both("rms_norm", x, weight, eps))

    def check_add_rms_norm():
        ours, ref = both("add_rms_norm", x, residual, weight, eps)
        _compare(report, "add_rms_norm", shape, dtype_name, f"T={t} n={h}", torch.cat(ours), torch.cat(ref))

    def check_per_head_norm():
        ours, ref = both("rms_norm", q, head_weight, eps)
        _compare(report, "rms_norm_per_head", shape, dtype_name, f"T={t} q view", ours, ref)

    def check_rope():
        _compare(report, "rope_half_split", shape, dtype_name, f"T={t} q view", *both("rope", q, cos, sin))

    def check_silu_mul():
        _compare(report, "silu_mul", shape, dtype_name, f"T={t} I={inter}", *both("silu_mul", gate_up))

    def check_write_kv():
        num_blocks = t // BLOCK_SIZE + 4
        caches = [torch.zeros(num_blocks, BLOCK_SIZE, nkv, hd, dtype=dtype, device=device) for _ in range(4)]
        slots = torch.randperm((num_blocks - 1) * BLOCK_SIZE, generator=gen, device=device)[:t] + BLOCK_SIZE
        triton_ops.write_kv(k, v, caches[0], caches[1], slots)
        torch_ops.write_kv(k, v.contiguous(), caches[2], caches[3], slots)
        ok = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        report.add("correct", "write_kv", shape["name"], dtype_name, f"T={t}", ok=ok, summary="exact" if ok else "FAIL")

    checks = [
        ("rms_norm", check_rms_norm),
        ("add_rms_norm", check_add_rms_norm),
        ("rms_norm_per_head", check_per_head_norm),
        ("rope_half_split", check_rope),
        ("silu_mul", check_silu_mul),
        ("write_kv", check_write_kv),
    ]
    for name, check in checks:
        report.run("correct", f"{name} {shape['name']} {dtype_name}", check)


def section_correct_attention(report: Report, shape: dict, dtype_name: str, device, sizes: Sizes) -> None:
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device=device).manual_seed(11)
    c = sizes.context
    contexts = [1, 16, c - 1, c, 2 * c, 4 * c, 300 % (2 * c) + 1, 129]
    parts = [
        (0, 0, 1),  # one-token prompt: empty KV
        (1, 15, 1),  # decode ending on a block boundary
        (2, c - 2, 1),  # decode
        (3, c - 4, 4),  # verify run
        (4, c + 3, c - 3),  # prefill chunk on top of cached KV
        (5, 3 * c, c),  # long chunk
        (6, 0, contexts[6]),  # whole prompt from empty KV
        (7, 120, 9),  # crossing a block boundary
    ]
    inputs = PagedInputs(shape, contexts, dtype, device, gen)
    batch, q = inputs.batch(parts, row_multiple=8)
    scale = shape["head_dim"] ** -0.5
    triton_ops, torch_ops = _ops()
    out = triton_ops.attention(q, inputs.k_cache, inputs.v_cache, triton_ops.prepare(batch, BLOCK_SIZE), scale)
    ref = torch_ops.attention(q, inputs.k_cache, inputs.v_cache, torch_ops.prepare(batch, BLOCK_SIZE), scale)
    _compare(report, "attention_mixed", shape, dtype_name, f"T={batch.num_tokens}", out, ref)
    if torch.count_nonzero(out[batch.num_tokens :]):
        summary = "FAIL: padding rows not zero"
        report.add("correct", "attention_padding", shape["name"], dtype_name, ok=False, summary=summary)


def section_invariance(report: Report, shape: dict, dtype_name: str, device, sizes: Sizes) -> None:
    """A row's output, bit for bit, alone and inside very different batches."""
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device=device).manual_seed(14)
    c = sizes.context
    target, position = 0, c + c // 2 + 3
    inputs = PagedInputs(shape, [position + 64, 50, c + 7, 9, c], dtype, device, gen)
    ops, _ = _ops()

    def row_of(parts):
        batch, q = inputs.batch(parts, row_multiple=8)
        metadata = ops.prepare(batch, BLOCK_SIZE)
        out = ops.attention(q, inputs.k_cache, inputs.v_cache, metadata, shape["head_dim"] ** -0.5)
        index = [p[0] for p in parts].index(target)
        return out[batch.query_starts[index] + position - parts[index][1]]

    solo = row_of([(target, position, 1)])
    layouts = [
        [(target, position - 3, 4)],  # last row of a verify run
        [(target, position - 10, 11)],
        [(target, position - 40, 64)],  # mid chunk
        [(target, 0, position + 1)],  # the whole prompt
        [(1, 49, 1), (target, position - 2, 5), (2, c - 30, 30), (3, 0, 9)],
        [(4, c - 1, 1), (2, c + 6, 1), (target, position, 1), (1, 10, 40)],
        [(3, 8, 1), (4, 0, c), (target, position - 1, 2)],
    ]
    max_diff = max(float((row_of(parts).float() - solo.float()).abs().max()) for parts in layouts)
    ok = max_diff == 0.0
    summary = "bitwise equal" if ok else f"FAIL max diff {max_diff:.1e}"
    size = f"{len(layouts)} layouts"
    report.add("invariant", "attention_row", shape["name"], dtype_name, size, ok=ok, max_diff=max_diff, summary=summary)


# ----------------------------------------------------------------------------- greedy equivalence


def section_greedy(report: Report, dtype_name: str, device, sizes: Sizes) -> None:
    """Lockstep greedy decoding: both op sets get the torch path's tokens; every scored row is compared."""
    from executor_svc.kv.kv_cache import KVCache
    from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice
    from executor_svc.model.transformer import Transformer
    from executor_svc.tools.random_model import model_config, random_weights

    dtype = DTYPES[dtype_name]
    shape = sizes.models[0]
    config = model_config(**shape, context_length=4096)
    weights = random_weights(config, dtype, device, seed=1)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in sizes.greedy_prompt_lens]
    tables, next_block = [], 1
    for n in sizes.greedy_prompt_lens:
        count = math.ceil((n + 3 * sizes.greedy_steps + 1) / BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    triton_ops, torch_ops = _ops()
    runs = {
        ops.name: (
            Transformer(config, weights, device, ops=ops),
            KVCache(config, num_blocks=next_block, block_size=BLOCK_SIZE, dtype=dtype, device=device),
        )
        for ops in (torch_ops, triton_ops)
    }
    pending = [list(p) for p in prompts]  # tokens each request computes next step
    positions = [0] * len(prompts)
    rows = mismatches = 0
    max_logit_diff = 0.0
    for step in range(sizes.greedy_steps + 1):
        is_verify = any(len(p) > 1 for p in pending) and step > 0
        slices = [
            RequestSlice(pending[r], positions[r], tables[r], num_logits=len(pending[r]) if is_verify else 1)
            for r in range(len(prompts))
        ]
        batch = RaggedBatch.build(slices, BLOCK_SIZE, device)
        logits = {name: model.forward(batch, kv_cache) for name, (model, kv_cache) in runs.items()}
        ref, ours = logits["torch"], logits["triton"]
        ref_ids, our_ids = torch.argmax(ref, dim=-1), torch.argmax(ours, dim=-1)
        rows += ref.shape[0]
        mismatches += int((ref_ids != our_ids).sum())
        max_logit_diff = max(max_logit_diff, float((ours - ref).abs().max()))

        starts = [0] + torch.tensor([s.num_logits for s in slices]).cumsum(0).tolist()
        for r in range(len(prompts)):
            positions[r] += len(pending[r])
            token = int(ref_ids[starts[r + 1] - 1])
            # Before every 8th step: a 3-token run, the greedy token and two arbitrary drafts to verify.
            extra = torch.randint(0, config.vocab_size, (2,), generator=gen).tolist() if (step + 1) % 8 == 0 else []
            pending[r] = [token] + extra
    summary = f"argmax mismatches {mismatches}/{rows}, max |dlogit| {max_logit_diff:.1e}"
    report.add(
        "greedy",
        "lockstep_decode",
        shape["name"],
        dtype_name,
        f"{len(prompts)} req x {sizes.greedy_steps} steps",
        mismatches=mismatches,
        rows=rows,
        max_logit_diff=max_logit_diff,
        summary=summary,
    )


# ----------------------------------------------------------------------------- timings


def section_kernel_timings(report: Report, bench: Bench, shape: dict, device, sizes: Sizes) -> None:
    """Each kernel in bf16 at B decode tokens: Triton vs torch, and bytes moved / time."""
    dtype, elt = torch.bfloat16, 2
    gen = torch.Generator(device=device).manual_seed(15)
    h, hd, nh, nkv, inter = _dims(shape)
    triton_ops, torch_ops = _ops()
    copy_gbps = report.yardsticks.get("copy_gbps")
    c = sizes.context
    cache = PagedInputs(shape, [c + 1] * max(sizes.batch_sizes), dtype, device, gen)

    def record(name, b, size, triton_fn, torch_fn, bytes_moved):
        triton_ms, torch_ms = bench.ms(triton_fn), bench.ms(torch_fn)
        gbps = bytes_moved / triton_ms / 1e6
        report.add(
            "kernel",
            name,
            shape["name"],
            "bf16",
            size,
            batch=b,
            triton_us=1e3 * triton_ms,
            torch_us=1e3 * torch_ms,
            bytes=bytes_moved,
            gbps=gbps,
            fraction_of_copy=gbps / copy_gbps if copy_gbps else None,
        )

    for b in sizes.batch_sizes:
        if report.over_budget():
            break
        batch, q = cache.batch([(r, c, 1) for r in range(b)])
        scale = hd**-0.5
        meta_triton, meta_torch = triton_ops.prepare(batch, BLOCK_SIZE), torch_ops.prepare(batch, BLOCK_SIZE)
        x = torch.randn(b, h, generator=gen, device=device).to(dtype)
        residual = torch.randn(b, h, generator=gen, device=device).to(dtype)
        weight = torch.ones(h, device=device, dtype=dtype)
        qkv = torch.randn(b, (nh + 2 * nkv) * hd, generator=gen, device=device).to(dtype)
        qv = qkv[:, : nh * hd].view(b, nh, hd)
        k = qkv[:, nh * hd : (nh + nkv) * hd].view(b, nkv, hd)
        v = qkv[:, (nh + nkv) * hd :].view(b, nkv, hd).contiguous()
        cos = torch.rand(b, hd // 2, generator=gen, device=device)
        sin = torch.rand(b, hd // 2, generator=gen, device=device)
        gate_up = torch.randn(b, 2 * inter, generator=gen, device=device).to(dtype)
        k_cache, v_cache, slots = cache.k_cache, cache.v_cache, batch.slot_mapping
        timings = [
            (
                "attention_decode",
                f"B={b} ctx={c}",
                lambda: triton_ops.attention(q, k_cache, v_cache, meta_triton, scale),
                lambda: torch_ops.attention(q, k_cache, v_cache, meta_torch, scale),
                b * (c + 1) * nkv * hd * 2 * elt + 2 * q.numel() * elt,  # K and V of every request, q in, out
            ),
            (
                "rms_norm",
                f"B={b}",
                lambda: triton_ops.rms_norm(x, weight, 1e-5),
                lambda: torch_ops.rms_norm(x, weight, 1e-5),
                2 * x.numel() * elt,
            ),
            (
                "add_rms_norm",
                f"B={b}",
                lambda: triton_ops.add_rms_norm(x, residual, weight, 1e-5),
                lambda: torch_ops.add_rms_norm(x, residual, weight, 1e-5),
                4 * x.numel() * elt,
            ),
            (
                "rope_q",
                f"B={b}",
                lambda: triton_ops.rope(qv, cos, sin),
                lambda: torch_ops.rope(qv, cos, sin),
                2 * qv.numel() * elt + 2 * cos.numel() * 4,
            ),
            (
                "silu_mul",
                f"B={b}",
                lambda: triton_ops.silu_mul(gate_up),
                lambda: torch_ops.silu_mul(gate_up),
                3 * b * inter * elt,
            ),
            (
                "write_kv",
                f"B={b}",
                lambda: triton_ops.write_kv(k, v, k_cache, v_cache, slots),
                lambda: torch_ops.write_kv(k, v, k_cache, v_cache, slots),
                4 * k.numel() * elt,
            ),
        ]
        for name, size, triton_fn, torch_fn, bytes_moved in timings:
            label = f"{name} {shape['name']} B={b}"
            report.run("kernel", label, record, name, b, size, triton_fn, torch_fn, bytes_moved)


def section_prefill_timing(report: Report, bench: Bench, shape: dict, device, sizes: Sizes) -> None:
    """Attention over whole prompts: causal flops / time against the matmul rate."""
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(16)
    _, hd, nh, _, _ = _dims(shape)
    n, m = sizes.prefill_requests, sizes.prefill_len
    triton_ops, torch_ops = _ops()
    inputs = PagedInputs(shape, [m] * n, dtype, device, gen)
    batch, q = inputs.batch([(r, 0, m) for r in range(n)])
    meta_triton, meta_torch = triton_ops.prepare(batch, BLOCK_SIZE), torch_ops.prepare(batch, BLOCK_SIZE)
    scale = hd**-0.5
    triton_ms = bench.ms(lambda: triton_ops.attention(q, inputs.k_cache, inputs.v_cache, meta_triton, scale))
    torch_ms = bench.ms(lambda: torch_ops.attention(q, inputs.k_cache, inputs.v_cache, meta_torch, scale))
    flops = 4 * nh * hd * n * (m * (m + 1) // 2)  # QK^T and PV over the causal pairs
    tflops = flops / triton_ms / 1e9
    rate = report.yardsticks.get("matmul_tflops")
    report.add(
        "kernel",
        "attention_prefill",
        shape["name"],
        "bf16",
        f"{n}x{m} tokens",
        triton_us=1e3 * triton_ms,
        torch_us=1e3 * torch_ms,
        tflops=tflops,
        fraction_of_matmul=tflops / rate if rate else None,
    )


def section_step_timings(report: Report, bench: Bench, shape: dict, device, sizes: Sizes) -> None:
    """A whole decode step, host work included (prepare, launches): what a serving step costs."""
    from executor_svc.kv.kv_cache import KVCache
    from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice
    from executor_svc.model.transformer import Transformer
    from executor_svc.tools.random_model import model_config, random_weights

    dtype = torch.bfloat16
    config = model_config(**shape, context_length=4096)
    weights = random_weights(config, dtype, device, seed=3)
    c = sizes.context
    blocks_per_request = math.ceil((c + 1) / BLOCK_SIZE)
    num_blocks = 1 + max(sizes.batch_sizes) * blocks_per_request
    kv_cache = KVCache(config, num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype=dtype, device=device)
    kv_cache.tensor.normal_()
    models = {ops.name: Transformer(config, weights, device, ops=ops) for ops in _ops()}
    for b in sizes.batch_sizes:
        if report.over_budget():
            break
        tables = [list(range(1 + r * blocks_per_request, 1 + (r + 1) * blocks_per_request)) for r in range(b)]
        batch = RaggedBatch.build([RequestSlice([7], c, tables[r], 1) for r in range(b)], BLOCK_SIZE, device)
        times = {name: bench.ms(lambda model=model: model.forward(batch, kv_cache)) for name, model in models.items()}
        report.add(
            "step",
            "decode_forward",
            shape["name"],
            "bf16",
            f"B={b} ctx={c} L={config.num_layers}",
            batch=b,
            triton_ms=times["triton"],
            torch_ms=times["torch"],
            tokens_per_s=b / times["triton"] * 1e3,
        )


# ----------------------------------------------------------------------------- Gated DeltaNet


class DeltaNetInputs:
    """Random inputs of one DeltaNet layer for requests of given query lengths: the conv's input and
    output widths, gate projections, weights, and state pools whose slots the requests hold out of order."""

    def __init__(self, shape: dict, query_lens: list[int], dtype, device, gen) -> None:
        hk, h, dk, dv, kernel = (shape[k] for k in ("key_heads", "heads", "dk", "dv", "kernel"))
        t, self.channels = sum(query_lens), 2 * hk * dk + h * dv
        self.num_slots = 2 * len(query_lens) + 1
        self.slots = torch.randperm(self.num_slots, generator=torch.Generator().manual_seed(0))[
            : len(query_lens)
        ].tolist()
        self.query_lens = query_lens
        self.x = torch.randn(t, self.channels, generator=gen, device=device).to(dtype)
        # The conv's output is what the delta rule reads; L2 norms make its scale irrelevant.
        self.mixed = torch.randn(t, self.channels, generator=gen, device=device).to(dtype)
        self.alpha = torch.randn(t, h, generator=gen, device=device).to(dtype)
        self.beta = (4 * torch.randn(t, h, generator=gen, device=device)).to(dtype)
        self.a = (-2 * torch.rand(h, generator=gen, device=device)).to(dtype)
        self.dt_bias = torch.randn(h, generator=gen, device=device).to(dtype)
        self.weight = (0.5 * torch.randn(self.channels, kernel, generator=gen, device=device)).to(dtype)
        self.conv_states = torch.randn(self.num_slots, kernel - 1, self.channels, generator=gen, device=device).to(
            dtype
        )
        self.states = torch.randn(self.num_slots, h, dk, dv, generator=gen, device=device)
        self.kernel = kernel

    def plan(self, logits_counts: list[int], torch_conv: bool = False, min_chunked_tokens: int | None = None):
        from executor_svc.model.gated_delta_net import build_delta_net_plan

        starts = [sum(self.query_lens[:i]) for i in range(len(self.query_lens))]
        return build_delta_net_plan(
            starts,
            self.query_lens,
            logits_counts,
            self.slots,
            self.x.device,
            self.kernel if torch_conv else None,
            min_chunked_tokens,
        )


def _delta_net_batch(sizes: Sizes) -> tuple[list[int], list[int]]:
    """(query lens, logits counts): a prefill chunk, decodes, verify runs of 5 and 3, a mid-prompt chunk."""
    c = sizes.context
    return [c // 4, 1, 5, 1, 3, c // 8 + 3, 1], [1, 1, 5, 1, 3, 0, 1]


def section_correct_delta_net(report: Report, dtype_name: str, device, sizes: Sizes) -> None:
    """The DeltaNet kernels against the torch reference on one ragged batch: outputs, the states
    written into the pools, and the states kept for the verify windows."""
    dtype, shape = DTYPES[dtype_name], sizes.delta_net
    gen = torch.Generator(device=device).manual_seed(17)
    lens, counts = _delta_net_batch(sizes)
    inputs = DeltaNetInputs(shape, lens, dtype, device, gen)
    triton_ops, torch_ops = _ops()
    size = f"T={sum(lens)} R={len(lens)}"

    def record(name, out, ref, tolerance):
        rel, max_abs = relative_error(out.float(), ref.float())
        ok = rel <= tolerance
        summary = f"{rel:.1e} (max {max_abs:.1e})" + ("" if ok else " FAIL")
        report.add(
            "correct", name, shape["name"], dtype_name, size, rel_err=rel, max_abs=max_abs, ok=ok, summary=summary
        )

    ours, ref = inputs.conv_states.clone(), inputs.conv_states.clone()
    out, windows = triton_ops.causal_conv1d(inputs.x, ours, inputs.weight, inputs.plan(counts))
    ref_out, ref_windows = torch_ops.causal_conv1d(inputs.x, ref, inputs.weight, inputs.plan(counts, torch_conv=True))
    record("causal_conv1d", out, ref_out, REL_TOLERANCE[dtype_name])
    kept = [windows[i, :n] for i, n in enumerate(c for c in counts if c > 1)]
    ref_kept = [ref_windows[i, :n] for i, n in enumerate(c for c in counts if c > 1)]
    exact = torch.equal(ours, ref) and all(torch.equal(a, b) for a, b in zip(kept, ref_kept))
    report.add(
        "correct", "conv_states", shape["name"], dtype_name, size, ok=exact, summary="exact" if exact else "FAIL"
    )

    # The delta rule computes in float32 whatever its inputs' dtype: float32 bounds on both sides.
    ours, ref = inputs.states.clone(), inputs.states.clone()
    plan = inputs.plan(counts)
    args = (inputs.mixed, inputs.alpha, inputs.beta, inputs.a, inputs.dt_bias)
    out, window_starts = triton_ops.gated_delta_rule(*args, ours, plan)
    ref_out, ref_window_starts = torch_ops.gated_delta_rule(*args, ref, plan)
    record("gated_delta_rule", out, ref_out, 1e-5)
    record(
        "delta_rule_states",
        torch.cat([ours.flatten(), window_starts.flatten()]),
        torch.cat([ref.flatten(), ref_window_starts.flatten()]),
        1e-5,
    )

    # The prefill rows in the chunked form (C = 64), against torch's chunked form and its recurrent one.
    ours, ref = inputs.states.clone(), inputs.states.clone()
    out, _ = triton_ops.gated_delta_rule(*args, ours, inputs.plan(counts, min_chunked_tokens=2))
    ref_out, _ = torch_ops.gated_delta_rule(*args, ref, inputs.plan(counts, min_chunked_tokens=2))
    record(
        "chunk_gated_delta_rule",
        torch.cat([out.flatten(), ours.flatten()]),
        torch.cat([ref_out.flatten(), ref.flatten()]),
        1e-5,
    )
    ref = inputs.states.clone()
    ref_out, _ = torch_ops.gated_delta_rule(*args, ref, plan)
    record(
        "chunk_vs_recurrent",
        torch.cat([out.flatten(), ours.flatten()]),
        torch.cat([ref_out.flatten(), ref.flatten()]),
        1e-5,
    )


def section_delta_net_invariance(report: Report, dtype_name: str, device, sizes: Sizes) -> None:
    """One request's conv and delta-rule outputs and states, bit for bit: alone, in the ragged batch,
    and prefilled in two chunks beside a decode; then its delta rule in the chunked form, alone and
    in the batch (and in two steps split at a multiple of the kernel's chunk, where it is long enough)."""
    dtype, shape = DTYPES[dtype_name], sizes.delta_net
    gen = torch.Generator(device=device).manual_seed(18)
    lens, counts = _delta_net_batch(sizes)
    inputs = DeltaNetInputs(shape, lens, dtype, device, gen)
    ops, _ = _ops()
    target = 5  # the mid-prompt chunk
    start, n = sum(lens[:target]), lens[target]
    slot = inputs.slots[target]

    def run(parts, query_lens, logits_counts, slots, conv_states, states, min_chunked_tokens=None):
        """parts: row ranges laid end to end → (conv out, delta out, the target slot's conv state and state)."""
        from executor_svc.model.gated_delta_net import build_delta_net_plan

        pick = lambda t: torch.cat([t[p] for p in parts])  # noqa: E731
        starts = [sum(query_lens[:i]) for i in range(len(query_lens))]
        plan = build_delta_net_plan(
            starts, query_lens, logits_counts, slots, device, min_chunked_tokens=min_chunked_tokens
        )
        conv_out, _ = ops.causal_conv1d(pick(inputs.x), conv_states, inputs.weight, plan)
        delta_out, _ = ops.gated_delta_rule(
            pick(inputs.mixed), pick(inputs.alpha), pick(inputs.beta), inputs.a, inputs.dt_bias, states, plan
        )
        return conv_out, delta_out, conv_states[slot].clone(), states[slot].clone()

    def max_diff(runs, batch):
        return max(float((a.float() - b.float()).abs().max()) for run_ in runs for a, b in zip(run_, batch))

    def add(name, size, diff):
        summary = "bitwise equal" if diff == 0.0 else f"FAIL max diff {diff:.1e}"
        report.add("invariant", name, shape["name"], dtype_name, size, ok=diff == 0.0, max_diff=diff, summary=summary)

    rows = slice(start, start + n)
    batch = run([slice(0, sum(lens))], lens, counts, inputs.slots, inputs.conv_states.clone(), inputs.states.clone())
    batch = (batch[0][rows], batch[1][rows], batch[2], batch[3])
    alone = run([rows], [n], [0], [slot], inputs.conv_states.clone(), inputs.states.clone())
    conv_states, states = inputs.conv_states.clone(), inputs.states.clone()
    half = n // 2
    first = run([slice(start, start + half)], [half], [0], [slot], conv_states, states)
    other = inputs.slots[1]  # a decode token of another request beside the second chunk
    second = run(
        [slice(sum(lens[:1]), sum(lens[:1]) + 1), slice(start + half, start + n)],
        [1, n - half],
        [1, 0],
        [other, slot],
        conv_states,
        states,
    )
    chunked = (torch.cat([first[0], second[0][1:]]), torch.cat([first[1], second[1][1:]]), second[2], second[3])
    add("delta_net_request", "alone/batch/2 chunks", max_diff((alone, chunked), batch))

    # The chunked form: every prefill row of the batch takes it, decode and verify rows stay recurrent.
    from executor_svc.kernels.chunk_gated_delta_rule import CHUNK_TOKENS

    batch = run([slice(0, sum(lens))], lens, counts, inputs.slots, inputs.conv_states.clone(), inputs.states.clone(), 2)
    batch = (batch[0][rows], batch[1][rows], batch[2], batch[3])
    alone = run([rows], [n], [0], [slot], inputs.conv_states.clone(), inputs.states.clone(), 2)
    runs, size = [alone], "alone/batch"
    split = n - n % CHUNK_TOKENS if n > CHUNK_TOKENS else 0
    if split:
        conv_states, states = inputs.conv_states.clone(), inputs.states.clone()
        first = run([slice(start, start + split)], [split], [0], [slot], conv_states, states, 2)
        second = run([slice(start + split, start + n)], [n - split], [0], [slot], conv_states, states, 1)
        runs.append((torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]]), second[2], second[3]))
        size += f"/2 chunks at {split}"
    add("delta_net_chunked_request", size, max_diff(runs, batch))


def section_delta_net_timings(report: Report, bench: Bench, device, sizes: Sizes) -> None:
    """The DeltaNet kernels in bf16 at B decode tokens (bytes: states read and written, inputs, outputs),
    and the delta rule over prefills (torch in its chunked form, its fast path for prefills)."""
    dtype, elt, shape = torch.bfloat16, 2, sizes.delta_net
    gen = torch.Generator(device=device).manual_seed(19)
    triton_ops, torch_ops = _ops()
    copy_gbps = report.yardsticks.get("copy_gbps")
    h, dk, dv = shape["heads"], shape["dk"], shape["dv"]

    def record(name, b, size, triton_fn, torch_fn, bytes_moved):
        triton_ms, torch_ms = bench.ms(triton_fn), bench.ms(torch_fn)
        gbps = bytes_moved / triton_ms / 1e6
        report.add(
            "kernel",
            name,
            shape["name"],
            "bf16",
            size,
            batch=b,
            triton_us=1e3 * triton_ms,
            torch_us=1e3 * torch_ms,
            bytes=bytes_moved,
            gbps=gbps,
            fraction_of_copy=gbps / copy_gbps if copy_gbps else None,
        )

    for b in sizes.batch_sizes:
        if report.over_budget():
            break
        inputs = DeltaNetInputs(shape, [1] * b, dtype, device, gen)
        plan, torch_plan = inputs.plan([1] * b), inputs.plan([1] * b, torch_conv=True)
        args = (inputs.mixed, inputs.alpha, inputs.beta, inputs.a, inputs.dt_bias, inputs.states)
        c = inputs.channels
        timings = [
            (
                "causal_conv1d_decode",
                lambda: triton_ops.causal_conv1d(inputs.x, inputs.conv_states, inputs.weight, plan),
                lambda: torch_ops.causal_conv1d(inputs.x, inputs.conv_states, inputs.weight, torch_plan),
                b * c * elt * (2 * (inputs.kernel - 1) + 2) + c * inputs.kernel * elt,
            ),
            (
                "delta_rule_decode",
                lambda: triton_ops.gated_delta_rule(*args, plan),
                lambda: torch_ops.gated_delta_rule(*args, plan),
                b * (2 * h * dk * dv * 4 + c * elt + h * dv * 4 + 2 * h * elt),
            ),
        ]
        for name, triton_fn, torch_fn, bytes_moved in timings:
            report.run("kernel", f"{name} B={b}", record, name, b, f"B={b}", triton_fn, torch_fn, bytes_moved)
    if report.over_budget():
        return
    # Several prefills, then one long prompt (where the recurrent kernel has only heads × value tiles programs).
    for n, m in ((sizes.prefill_requests, sizes.delta_net_prefill_len), (1, 8 * sizes.delta_net_prefill_len)):
        if report.over_budget():
            return
        inputs = DeltaNetInputs(shape, [m] * n, dtype, device, gen)
        args = (inputs.mixed, inputs.alpha, inputs.beta, inputs.a, inputs.dt_bias, inputs.states)
        plan, chunked_plan = inputs.plan([1] * n), inputs.plan([1] * n, min_chunked_tokens=1)
        triton_ms = bench.ms(lambda: triton_ops.gated_delta_rule(*args, plan))
        triton_chunked_ms = bench.ms(lambda: triton_ops.gated_delta_rule(*args, chunked_plan))
        torch_ms = bench.ms(lambda: torch_ops.gated_delta_rule(*args, chunked_plan))
        report.add(
            "kernel",
            "delta_rule_prefill",
            shape["name"],
            "bf16",
            f"{n}x{m} tokens",
            triton_us=1e3 * triton_ms,
            triton_chunked_us=1e3 * triton_chunked_ms,
            torch_us=1e3 * torch_ms,
            tokens_per_s=n * m / triton_ms * 1e3,
            chunked_tokens_per_s=n * m / triton_chunked_ms * 1e3,
        )


# ----------------------------------------------------------------------------- GGUF dequant-matmul and the decode floor


@dataclass(frozen=True)
class GgufSizes:
    """Sizes of the dequant-matmul and decode-floor sections (kept apart from `Sizes`)."""

    correct_shapes: tuple[tuple[int, int, int], ...]  # (M, N, K): x rows, weight rows, columns
    bandwidth_types: tuple[str, ...]
    bandwidth_rows: tuple[int, ...]  # M of the bandwidth timings
    bandwidth_shape: tuple[int, int]  # (N, K)
    launch_types: tuple[str, ...]  # the launch sweep's
    skinny_launch_rows: tuple[int, ...]  # M of the skinny candidates (decode, verify)
    tiled_launch_rows: int  # M of the tiled candidates (a prefill chunk), on the bandwidth shape
    model: dict
    model_type: str  # the decode model's GGUF type
    batch_sizes: tuple[int, ...]
    verify_batch_sizes: tuple[int, ...]
    verify_drafts: tuple[int, ...]
    context: int

    @classmethod
    def full(cls) -> "GgufSizes":
        return cls(
            correct_shapes=((1, 4097, 4096), (16, 4096, 4096), (100, 1031, 4096)),
            bandwidth_types=("F16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"),
            bandwidth_rows=(1, 16),
            bandwidth_shape=(14336, 4096),
            launch_types=("Q4_K", "Q8_0"),
            skinny_launch_rows=(1, 16),
            tiled_launch_rows=2048,
            model=BIG_MODEL,
            model_type="Q4_K",
            batch_sizes=(1, 2, 4, 8, 16, 32),
            verify_batch_sizes=(1, 8),
            verify_drafts=(0, 1, 2, 4, 8),
            context=512,
        )

    @classmethod
    def for_device(cls, device) -> "GgufSizes":
        return cls.full() if device.type != "cpu" else cls.dry_run()

    @classmethod
    def dry_run(cls) -> "GgufSizes":
        return cls(
            correct_shapes=((37, 33, 256),),
            bandwidth_types=("Q4_K",),
            bandwidth_rows=(1,),
            bandwidth_shape=(64, 256),
            launch_types=("Q4_K",),
            skinny_launch_rows=(1,),
            tiled_launch_rows=40,
            model=dict(TINY_MODEL, num_layers=1),
            model_type="Q8_0",
            batch_sizes=(2,),
            verify_batch_sizes=(1,),
            verify_drafts=(0, 2),
            context=20,
        )


def _gguf_type_ids() -> dict[str, int]:
    from executor_svc.weights.gguf_types import PACKED_TYPES

    return {name: type_id for type_id, (name, _, _) in PACKED_TYPES.items()}


def section_qmatmul_correct(report: Report, dtype_name: str, device, sizes: GgufSizes) -> None:
    """Every GGUF type's kernel against x · dequantize(w)ᵀ in float64 (the torch reference dequantizer),
    and a row's bits with 1 and 9 rows against the whole matmul (batch invariance on the device)."""
    from executor_svc.kernels.qmatmul import dequantize, qmatmul
    from executor_svc.tools.random_model import random_gguf_rows

    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device=device).manual_seed(21)
    for name, type_id in _gguf_type_ids().items():
        worst_rel, worst_abs, is_invariant = 0.0, 0.0, True
        for m, n, k in sizes.correct_shapes:
            data = random_gguf_rows(n, k, type_id, gen, device)
            x = torch.randn(m, k, generator=gen, device=device).to(dtype)
            ref = x.double() @ dequantize(data, type_id, k).double().T
            out = qmatmul(x, data, type_id, k)
            rel, max_abs = relative_error(out.double(), ref)
            worst_rel, worst_abs = max(worst_rel, rel), max(worst_abs, max_abs)
            # Batch invariance: the first rows alone (the skinny launch for M <= 32) give the same bits.
            is_invariant = is_invariant and all(
                torch.equal(qmatmul(x[:r], data, type_id, k), out[:r]) for r in (1, min(m, 9))
            )
        ok = worst_rel <= REL_TOLERANCE[dtype_name] and is_invariant
        summary = f"rel {worst_rel:.1e} max|err| {worst_abs:.1e}" + ("" if is_invariant else " NOT ROW-INVARIANT")
        summary += "" if ok else " FAIL"
        shapes = " ".join(f"{m}x{n}x{k}" for m, n, k in sizes.correct_shapes)
        report.add(
            "qmatmul",
            f"correct_{name}",
            "",
            dtype_name,
            shapes,
            rel_err=worst_rel,
            max_abs=worst_abs,
            is_invariant=is_invariant,
            ok=ok,
            summary=summary,
        )


def _streamed_gbps(data: torch.Tensor, m: int, n: int, k: int, ms: float) -> float:
    """A dequant-matmul's GB/s: its weight bytes read once, its bf16 x [m, k] read and y [m, n] written."""
    return (data.numel() + 2 * m * (k + n)) / ms / 1e6


def section_qmatmul_bandwidth(report: Report, bench: Bench, device, sizes: GgufSizes) -> None:
    """Each type's kernel at decode rows: bytes read / time as a share of the copy, beside a dense bf16 matmul."""
    from executor_svc.kernels.qmatmul import dequantize, qmatmul
    from executor_svc.tools.random_model import random_gguf_rows

    gen = torch.Generator(device=device).manual_seed(22)
    n, k = sizes.bandwidth_shape
    copy_gbps = report.yardsticks.get("copy_gbps")
    for name in sizes.bandwidth_types:
        type_id = _gguf_type_ids()[name]
        data = random_gguf_rows(n, k, type_id, gen, device)
        dense = dequantize(data, type_id, k).to(torch.bfloat16)
        for m in sizes.bandwidth_rows:
            x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
            ms = bench.ms(lambda: qmatmul(x, data, type_id, k))
            dense_ms = bench.ms(lambda: torch.nn.functional.linear(x, dense))
            gbps = _streamed_gbps(data, m, n, k, ms)
            share = gbps / copy_gbps if copy_gbps else None
            summary = f"{1e3 * ms:.0f}us {gbps:.0f} GB/s" + (f" = {100 * share:.0f}% of copy" if share else "")
            summary += f" (dense bf16 {1e3 * dense_ms:.0f}us)"
            size = f"M={m} {n}x{k}"
            report.add(
                "qmatmul",
                f"bandwidth_{name}",
                "",
                "bf16",
                size,
                batch=m,
                us=1e3 * ms,
                dense_us=1e3 * dense_ms,
                gbps=gbps,
                fraction_of_copy=share,
                summary=summary,
            )


def _launch_candidates(device) -> tuple[list, list]:
    """The skinny and tiled launches the sweep times: today's first, then the neighbours worth knowing."""
    from executor_svc.kernels.qmatmul import SKINNY, TILED, Launch

    if device.type == "cpu":  # the interpreter: one of each, to keep the dry run short
        return [SKINNY, Launch(16, 1, 4, 4)], [TILED]
    skinny = [SKINNY] + [
        Launch(block_n, 1, k_steps, num_warps)
        for block_n in (16, 32, 64)
        for k_steps in (1, 2, 4)
        for num_warps in (4, 8)
        if Launch(block_n, 1, k_steps, num_warps) != SKINNY
    ]
    tiled = [TILED] + [
        Launch(block_n, 8, k_steps, num_warps, block_m)
        for block_m, block_n, k_steps, num_warps in (
            (16, 128, 1, 4),
            (16, 64, 2, 4),
            (16, 64, 1, 8),
            (64, 64, 1, 4),
            (64, 128, 1, 4),
            (64, 128, 1, 8),
            (64, 64, 2, 4),
            (128, 64, 1, 4),
            (128, 128, 1, 8),
            (128, 128, 2, 8),
        )
    ]
    return skinny, tiled


def section_qmatmul_launches(report: Report, bench: Bench, device, sizes: GgufSizes) -> None:
    """The dequant-matmul's launch candidates timed, for picking SKINNY and TILED on a card: GB/s
    at decode rows, TFLOP/s at a prefill chunk. A launch may not change a row's bits: each output is
    compared with the default launch's (a difference fails the row)."""
    from executor_svc.kernels.qmatmul import qmatmul
    from executor_svc.tools.random_model import random_gguf_rows

    gen = torch.Generator(device=device).manual_seed(24)
    n, k = sizes.bandwidth_shape
    copy_gbps = report.yardsticks.get("copy_gbps")
    skinny, tiled = _launch_candidates(device)
    for name in sizes.launch_types:
        type_id = _gguf_type_ids()[name]
        data = random_gguf_rows(n, k, type_id, gen, device)
        runs = [("skinny", m, launch) for m in sizes.skinny_launch_rows for launch in skinny]
        runs += [("tiled", sizes.tiled_launch_rows, launch) for launch in tiled]
        for kind, m, launch in runs:
            if report.over_budget():
                return
            x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
            is_same = torch.equal(qmatmul(x, data, type_id, k, launch), qmatmul(x, data, type_id, k))
            ms = bench.ms(lambda: qmatmul(x, data, type_id, k, launch))
            gbps = _streamed_gbps(data, m, n, k, ms)
            tflops = 2 * m * n * k / ms / 1e9
            shape = f"m{launch.block_m} n{launch.block_n} g{launch.group_m} s{launch.k_steps} w{launch.num_warps}"
            share = f" = {100 * gbps / copy_gbps:.0f}% of copy" if copy_gbps else ""
            rate = f"{gbps:.0f} GB/s{share}" if kind == "skinny" else f"{tflops:.1f} TFLOP/s"
            summary = f"{1e3 * ms:.0f}us {rate}" + ("" if is_same else " BITS DIFFER FAIL")
            report.add(
                "qmatmul",
                f"launch_{kind}_{name}",
                "",
                "bf16",
                f"M={m} {shape}",
                batch=m,
                launch=dataclasses.asdict(launch),
                us=1e3 * ms,
                gbps=gbps,
                tflops=tflops,
                fraction_of_copy=gbps / copy_gbps if copy_gbps else None,
                ok=is_same,
                summary=summary,
            )


class _QuantizedDecodeModel:
    """A random model of GGUF rows (Triton dequant-matmul) with a KV cache of random context."""

    def __init__(self, device, sizes: GgufSizes, max_requests: int, max_tokens_per_request: int) -> None:
        from executor_svc.kernels.triton_ops import TritonOps
        from executor_svc.kv.kv_cache import KVCache
        from executor_svc.model.transformer import Transformer
        from executor_svc.tools.random_model import model_config, random_packed_weights

        self.config = model_config(**sizes.model, context_length=4096)
        self.weights = random_packed_weights(
            self.config, _gguf_type_ids()[sizes.model_type], torch.bfloat16, device, seed=23
        )
        self.model = Transformer(self.config, self.weights, device, ops=TritonOps(), dtype=torch.bfloat16)
        self.blocks_per_request = math.ceil((sizes.context + max_tokens_per_request) / BLOCK_SIZE)
        num_blocks = 1 + max_requests * self.blocks_per_request
        self.kv_cache = KVCache(
            self.config, num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype=torch.bfloat16, device=device
        )
        self.kv_cache.tensor.normal_()
        self.device, self.context = device, sizes.context

    @property
    def streamed_bytes(self) -> int:
        return self.weights.streamed_bytes

    def batch(self, num_requests: int, num_tokens: int):
        from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice

        bpr = self.blocks_per_request
        slices = [
            RequestSlice([7] * num_tokens, self.context, list(range(1 + r * bpr, 1 + (r + 1) * bpr)), num_tokens)
            for r in range(num_requests)
        ]
        return RaggedBatch.build(slices, BLOCK_SIZE, self.device)


def section_decode_floor(report: Report, bench: Bench, device, sizes: GgufSizes) -> None:
    """Decode step time against B, eager and replayed from graphs, beside the weight-stream floor."""
    from executor_svc.engine.decode_graphs import DecodeGraphs

    run = _QuantizedDecodeModel(device, sizes, max(sizes.batch_sizes), 1)
    # On the CPU (--dry-run) there are no graphs: the "capture" replays by running the forward again.
    graphs = DecodeGraphs(run.model, run.kv_cache, capture=None if device.type == "cuda" else (lambda fn: fn))
    copy_gbps = report.yardsticks.get("copy_gbps")
    floor_ms = run.streamed_bytes / copy_gbps / 1e6 if copy_gbps else None
    for b in sizes.batch_sizes:
        if report.over_budget():
            break
        batch = run.batch(b, 1)
        eager_ms = bench.ms(lambda: run.model.forward(batch, run.kv_cache))
        graph_ms = bench.ms(lambda: graphs.forward(batch))
        summary = f"graph {graph_ms:.2f} eager {eager_ms:.2f}"
        if floor_ms:
            summary += f" floor {floor_ms:.2f} ms = {graph_ms / floor_ms:.2f}x"
        size = f"B={b} ctx={run.context} L={run.config.num_layers} {sizes.model_type} {run.streamed_bytes / 1e9:.2f} GB"
        report.add(
            "decode",
            "step_vs_floor",
            sizes.model["name"],
            "bf16",
            size,
            batch=b,
            graph_ms=graph_ms,
            eager_ms=eager_ms,
            floor_ms=floor_ms,
            weight_bytes=run.streamed_bytes,
            summary=summary,
        )


def section_verify_cost(report: Report, bench: Bench, device, sizes: GgufSizes) -> None:
    """A step verifying K drafts per request (1 + K tokens and logits rows each) against K = 0: the
    compute slack, measured."""
    max_drafts = max(sizes.verify_drafts)
    run = _QuantizedDecodeModel(device, sizes, max(sizes.verify_batch_sizes), 1 + max_drafts)
    for b in sizes.verify_batch_sizes:
        base_ms = None
        for k in sizes.verify_drafts:
            if report.over_budget():
                return
            batch = run.batch(b, 1 + k)
            ms = bench.ms(lambda: run.model.forward(batch, run.kv_cache))
            base_ms = base_ms or ms
            summary = f"{ms:.2f} ms = {ms / base_ms:.2f}x K=0"
            report.add(
                "decode",
                f"verify_B{b}",
                sizes.model["name"],
                "bf16",
                f"B={b} K={k}",
                batch=b,
                drafts=k,
                ms=ms,
                ratio=ms / base_ms,
                summary=summary,
            )


# ----------------------------------------------------------------------------- main


def gguf_plan(report: Report, bench: Bench, device) -> list[tuple]:
    """The dequant-matmul and decode-floor checks (sections qmatmul, decode)."""
    sizes = GgufSizes.for_device(device)
    plan = [
        ("qmatmul", f"dequant-matmul {d}", section_qmatmul_correct, (report, d, device, sizes))
        for d in ("fp32", "bf16")
    ]
    plan.append(("qmatmul", "dequant-matmul bandwidth", section_qmatmul_bandwidth, (report, bench, device, sizes)))
    plan.append(("decode", "decode step vs floor", section_decode_floor, (report, bench, device, sizes)))
    plan.append(("decode", "verify cost", section_verify_cost, (report, bench, device, sizes)))
    plan.append(("qmatmul", "dequant-matmul launches", section_qmatmul_launches, (report, bench, device, sizes)))
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--device", default=None, help="cuda (the default when there is one) or cpu")
    parser.add_argument("--budget-s", type=float, default=460.0, help="skip what is left after this many seconds")
    parser.add_argument(
        "--swarm-budget-s",
        type=float,
        default=260.0,
        help="of --budget-s, the seconds kept for the swarm section (the kernel sections stop before)",
    )
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated, out of {','.join(SECTIONS)}")
    parser.add_argument(
        "--labels",
        default="",
        help="comma-separated: of the kernel sections' checks, run only those whose label contains one (e.g. 'delta net')",
    )
    parser.add_argument("--out", default=os.environ.get("OUT"), help="where gpu_check.json/.txt go (default $OUT)")
    parser.add_argument("--model-dir", default=None, help="the swarm section's model files (see gpu_swarm.py)")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    if only - set(SECTIONS):
        parser.error(f"unknown sections {sorted(only - set(SECTIONS))}")

    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"))
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        sys.stderr.write("on CPU the kernels run only under TRITON_INTERPRET=1 (or pass --dry-run)\n")
        return 2
    sizes = Sizes.full() if device.type != "cpu" else Sizes.dry_run()
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    has_swarm = "swarm" in only
    report = Report(args.budget_s - (args.swarm_budget_s if has_swarm else 0.0), args.out)
    bench = Bench(device, sizes)
    kind = "full" if device.type != "cpu" else "dry-run"
    report.log(f"gpu_check on {device}, {kind} sizes, budget {args.budget_s:.0f}s")

    plan = [
        ("env", "env", section_env, (report, device)),
        ("roofline", "copy and matmul", section_roofline, (report, bench, sizes, device)),
    ]
    # First after the ceilings: the dequant-matmul, the decode step and the launch sweep. The first
    # card measured the others as correct and the dequant-matmul as the decode step's bottleneck
    # (29x its floor), and the checks after these took the kernel sections' whole budget there.
    plan += gguf_plan(report, bench, device)
    models = sizes.models
    for shape in models:
        for dtype_name in DTYPES:
            args_ = (report, shape, dtype_name, device, sizes)
            label = f"small kernels {shape['name']} {dtype_name}"
            plan.append(("correct", label, section_correct_small_kernels, args_))
    for shape in models:
        for dtype_name in DTYPES:
            args_ = (report, shape, dtype_name, device, sizes)
            plan.append(("correct", f"attention {shape['name']} {dtype_name}", section_correct_attention, args_))
    for dtype_name in DTYPES:
        args_ = (report, dtype_name, device, sizes)
        plan.append(("correct", f"delta net {sizes.delta_net['name']} {dtype_name}", section_correct_delta_net, args_))
    for shape in models:
        for dtype_name in ("bf16", "fp32"):
            args_ = (report, shape, dtype_name, device, sizes)
            plan.append(("invariant", f"attention {shape['name']} {dtype_name}", section_invariance, args_))
    for dtype_name in ("bf16", "fp32"):
        args_ = (report, dtype_name, device, sizes)
        plan.append(
            ("invariant", f"delta net {sizes.delta_net['name']} {dtype_name}", section_delta_net_invariance, args_)
        )
    for dtype_name in ("fp32", "bf16"):
        plan.append(("greedy", f"lockstep {dtype_name}", section_greedy, (report, dtype_name, device, sizes)))
    for shape in models:
        args_ = (report, bench, shape, device, sizes)
        plan.append(("kernel", f"decode kernels {shape['name']}", section_kernel_timings, args_))
        plan.append(("kernel", f"prefill attention {shape['name']}", section_prefill_timing, args_))
    plan.append(
        ("kernel", f"delta net {sizes.delta_net['name']}", section_delta_net_timings, (report, bench, device, sizes))
    )
    for shape in models:
        args_ = (report, bench, shape, device, sizes)
        plan.append(("step", f"decode step {shape['name']}", section_step_timings, args_))
    labels = [label for label in args.labels.split(",") if label]
    plan = [entry for entry in plan if entry[0] in only]
    if labels:
        plan = [entry for entry in plan if entry[0] in ("env", "roofline") or any(x in entry[1] for x in labels)]
    run_entries(report, plan, device)
    if has_swarm:
        from pathlib import Path

        from executor_svc.tools.gpu_swarm import swarm_plan

        report.budget_s = args.budget_s
        model_dir = Path(args.model_dir) if args.model_dir else None
        run_entries(report, swarm_plan(report, device, model_dir, Path(args.out) if args.out else None), device)
    return finish(report)


def run_entries(report: Report, plan: list[tuple], device: torch.device) -> None:
    """Each (section, label, fn, args) entry, guarded and timed against the budget, the JSON saved after each."""
    for section, label, fn, fn_args in plan:
        report.run(section, label, fn, *fn_args)
        report.save()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def finish(report: Report) -> int:
    """The table on stdout (and beside the JSON); 1 if any check failed or any section raised."""
    table = report.table()
    sys.stdout.write(table + "\n")
    sys.stdout.flush()
    if report.out_dir:
        with open(os.path.join(report.out_dir, f"{report.name}.txt"), "w") as f:
            f.write(table + "\n")
    return 1 if report.num_failed() else 0


if __name__ == "__main__":
    sys.exit(main())
