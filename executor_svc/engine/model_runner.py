"""The model side of the executor: the device, the weights, the model, and how a step runs on them.

The engine decides what a step computes (which requests, which of their tokens, in which KV
blocks); the runner turns those slices into logits. Everything chosen once at start-up lives
here: the device, the compute dtype, how packed weights multiply, which kernels run, the model
as loaded, the paged KV cache's memory (its size and layout follow the model and the dtype, so
it is allocated here; the engine keeps its bookkeeping through the same KVManager), and the
captured decode graphs. Calibration is here too: it times forward passes of scratch requests,
which needs the model and free KV, and no request.
"""

from __future__ import annotations

import time

import torch

from executor_svc.config import MATMULS, EngineConfig
from executor_svc.engine.step_messages import CostSample
from executor_svc.kv.block_allocator import root_hash
from executor_svc.kv.kv_manager import KVManager
from executor_svc.load_progress import load_progress
from executor_svc.model.hybrid_model import HybridTransformer
from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice
from executor_svc.model.torch_ops import TorchOps
from executor_svc.model.transformer import Transformer
from executor_svc.weights.gguf_file import GGUFFile, open_gguf
from executor_svc.weights.model_config import ModelConfig
from executor_svc.weights.model_source import resolve_model_path
from executor_svc.weights.model_weights import ModelWeights, load_weights
from executor_svc.weights.tokenizer import load_tokenizer
from executor_svc.weights.weight_format import MATMUL_KERNELS
from service_common.attention_pairs import attention_pairs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KV_DTYPES = {**DTYPES, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA/ROCm device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on a GPU; float32 on the CPU, where the packed-weight kernels compute
    in float32 whatever the activations' dtype, so bfloat16 activations would only add
    conversions and rounding (measured: see the README's CPU section)."""
    if name != "auto":
        return DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, ops, matmul: str, head_dim: int) -> torch.dtype:
    """The KV cache's element type. `float16` / `bfloat16` under float32 activations (the C++ CPU
    kernels only: they round each K/V value once, where it is written) halve the bytes a decode
    step reads at long context and double the tokens the KV budget holds; greedy output may then
    differ from the float32 reference on near-ties (the README's CPU section has the measured
    top-1 agreement: float16 778/778, bfloat16 776/778). `auto`: bfloat16 with `--matmul bf16`
    where attention over it is the CPU's fastest (cpu_ops.bfloat16_attention_is_fastest: the AMX
    tiles for heads of 32 or 64, ~5x the vector kernels on a prompt chunk at long context; VDPBF16PS
    on a CPU without AMX, 1.4-1.9x the float16 cache's kernel on Zen 4), else float16; float16 with
    the C++ kernels' integer matmul
    (the CPU's default path), which measures the float32 cache's agreement; else the activations'
    dtype, so `--dtype float32` stays the exact reference. `head_dim`: the model's."""
    if name == "auto":
        if ops.name != "cpu" or matmul not in MATMUL_KERNELS or dtype != torch.float32:
            return dtype
        if matmul == "bf16":
            from executor_svc.model.cpu_ops import bfloat16_attention_is_fastest  # bf16 needs the kernels

            return torch.bfloat16 if bfloat16_attention_is_fastest(head_dim) else torch.float16
        return torch.float16
    kv_dtype = KV_DTYPES[name]
    if kv_dtype != dtype and ops.name != "cpu":
        raise ValueError(
            f"kv_cache_dtype={name} differs from the activations' dtype, which only the C++ CPU kernels run "
            f"(--device cpu, --kernels auto|cpu)"
        )
    return kv_dtype


# Prompt tokens per step the scheduler should plan by default (its --max-num-batched-tokens).
DEFAULT_STEP_TOKENS = 256
BF16_STEP_TOKENS = 1024


def preferred_step_tokens(matmul: str) -> int:
    """The step size at which this executor's prompt chunks reach their speed without freezing the
    agents that decode beside them for long: `--matmul bf16` runs a 256-token chunk in ~25-80 ms
    on a 2-core Xeon, so a step's fixed costs (the scheduler's plan, the RPC, sampling) weigh, and
    1,024-token steps measured TTFT 0.26 -> 0.22 s for a lone 1,024-token prompt and the 8-agent
    swarm's makespan ~7% shorter (25.7-25.8 -> 23.8-24.2 s, two runs each; its TTFT p50 moved
    within the runs' spread, 0.88-1.12 against 0.90-1.18 s) (`bench vs`); with the int16 matmul
    a chunk costs ~2.5x as much and 1,024-token steps made the swarm's TTFT worse (3.3 -> 3.9 s:
    newcomers wait behind longer steps), so 256."""
    return BF16_STEP_TOKENS if matmul == "bf16" else DEFAULT_STEP_TOKENS


def resolve_matmul(name: str, dtype_name: str, device: torch.device, kernels: str) -> str:
    """How packed weights multiply. `exact`: dequantized in registers, float32 math (the
    reference). `int16`: activations quantized to int16 per 32-value block and dotted with
    the integer codes of Q4_0/Q4_1/Q8_0 blocks (other types stay exact; see qlinear.cpp).
    `int8`: the same with activations quantized to 8 bits per block over its range, twice the
    MACs per instruction (AVX512-VNNI) for ~98% top-1 agreement with exact instead of ~100%,
    so only when asked for. `bf16`: weights dequantized once and rounded to bf16, activations
    rounded to bf16, float32 sums on the AMX tiles or with VDPBF16PS (AVX512-BF16 CPUs: Xeons
    with AMX, Zen 4), every row through the same kernel: prompts ~1.4x faster than int16 on the
    Xeon (its matmuls 2-3x), ~1.3-1.5x on Zen 4, a lone decode slower (bf16 weights are 2-4x the
    bytes to read: ~2.6x on the Xeon, 1.4x on Zen 4), ~99-99.5% top-1 agreement, so opt-in too. `auto`: int16
    with the C++ kernels on a CPU that has them, unless `--dtype float32` was asked for, which
    stays the exact reference mode."""
    if name not in MATMULS:
        raise ValueError(f"matmul must be one of {MATMULS}, got {name!r}")
    uses_cpu_kernels = device.type == "cpu" and kernels in ("auto", "cpu")
    if name == "auto":
        if not uses_cpu_kernels or dtype_name == "float32":
            return "exact"
        from executor_svc.weights.weight_format import has_int16_dot

        return "int16" if has_int16_dot() else "exact"
    if name in MATMUL_KERNELS and not uses_cpu_kernels:
        raise ValueError(f"--matmul {name} runs with the C++ CPU kernels (--device cpu, --kernels auto|cpu)")
    if name == "int8":
        from executor_svc.weights.weight_format import has_int8_dot

        if not has_int8_dot():
            raise ValueError("--matmul int8 needs a CPU with AVX512-VNNI (this one has none); use --matmul int16")
    if name == "bf16":
        from executor_svc.weights.weight_format import has_bf16_dot

        if not has_bf16_dot():
            raise ValueError(
                "--matmul bf16 needs AVX512-BF16 (Zen 4, or a Xeon with AMX); this CPU has none: use --matmul int16"
            )
    return name


def resolve_ops(kernels: str, device: torch.device):
    """The hot-path ops: Triton kernels on a GPU, the C++ kernels on the CPU, plain torch when asked."""
    from executor_svc.kernels import triton_available

    if kernels == "auto":
        kernels = "triton" if device.type == "cuda" else "cpu"
    if kernels == "torch":
        return TorchOps()
    if kernels == "cpu":
        if device.type != "cpu":
            raise ValueError("kernels='cpu' runs on the CPU; use --device cpu or --kernels triton|torch")
        from executor_svc.model.cpu_ops import CpuOps

        return CpuOps()
    if not triton_available():
        raise ValueError("kernels='triton' needs triton and a CUDA/ROCm device (or TRITON_INTERPRET=1)")
    from executor_svc.kernels.triton_ops import TritonOps

    return TritonOps()


class ModelRunner:
    """prepare(slices) -> batch, forward(batch) -> logits; calibrate() / time_step() for the cost model."""

    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = resolve_device(config.device)
        self.model_path = resolve_model_path(config.model)
        gguf = open_gguf(self.model_path)
        self.model_config = ModelConfig.from_gguf(gguf)
        self.tokenizer = load_tokenizer(gguf)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.matmul = resolve_matmul(config.matmul, config.dtype, self.device, config.kernels)
        self.ops = resolve_ops(config.kernels, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, self.dtype, self.ops, self.matmul, self.model_config.head_dim
        )
        self.preferred_step_tokens = preferred_step_tokens(self.matmul)
        weights = self._load_weights(gguf)
        self.weight_bytes = weights.num_bytes
        self.model = self._build_model(weights)
        self.kv = self._allocate_kv_cache()
        self.decode_graphs = self._capture_decode_graphs()
        # Packed-weight kernels are row-invariant by construction; dense fp32 CPU GEMMs group rows
        # in fours (see ragged_batch.py); on a GPU padding buys nothing.
        is_dense_cpu = self.device.type == "cpu" and not weights.is_packed
        self._row_multiple = 4 if config.batch_invariant and is_dense_cpu else 1

    # ------------------------------------------------------------------ set-up

    def _load_weights(self, gguf: GGUFFile) -> ModelWeights:
        # With the Triton kernels the weights stay GGUF blocks on the device (resident ≈ the file's size).
        with load_progress(gguf) as loading:
            return load_weights(
                loading,
                self.model_config,
                self.dtype,
                self.device,
                matmul_kernel=MATMUL_KERNELS.get(self.matmul),
                triton=self.ops.name == "triton",
            )

    def _build_model(self, weights: ModelWeights) -> Transformer | HybridTransformer:
        if self.model_config.is_hybrid:
            return HybridTransformer(
                self.model_config,
                weights,
                self.device,
                self.ops,
                self.dtype,
                batch_invariant=self.config.batch_invariant,
            )
        return Transformer(self.model_config, weights, self.device, self.ops, self.dtype)

    def _allocate_kv_cache(self) -> KVManager:
        """The paged KV cache and its prefix cache; hybrid models also keep a recurrent state per running
        request there. KV depends on the weights and the dtypes: a cached block is only valid for this
        model as loaded, hence the prefix root. K is laid out as the ops read it (see kv_cache.py)."""
        config = self.config
        return KVManager.from_memory_budget(
            self.model_config,
            config.kv_cache_bytes,
            config.block_size,
            config.num_state_slots,
            self.dtype,
            self.device,
            prefix_root=root_hash(
                f"{self.model_path.resolve()}:{self.model_path.stat().st_size}:{self.dtype}:{self.kv_dtype}"
            ),
            enable_prefix_caching=config.enable_prefix_caching,
            num_state_snapshots=config.num_state_snapshots,
            kv_dtype=self.kv_dtype,
            kv_layout=self.ops.kv_layout,
        )

    def _capture_decode_graphs(self):
        """Graphs for plain decode steps where they can be captured (see decode_graphs.py); else None."""
        is_triton = self.ops.name == "triton"
        if not (self.config.decode_graphs and self.device.type == "cuda" and is_triton and self.kv.state_pool is None):
            return None
        from executor_svc.engine.decode_graphs import DecodeGraphs

        return DecodeGraphs(self.model, self.kv.cache)

    # -------------------------------------------------------------------- a step

    def prepare(self, pieces: list[RequestSlice]) -> RaggedBatch:
        """The step's slices as one ragged batch on the device."""
        return RaggedBatch.build(pieces, self.kv.block_size, self.device, self._row_multiple)

    def forward(self, batch: RaggedBatch) -> torch.Tensor:
        """The model's logits for the batch: replayed from a captured graph when it is a plain decode step."""
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            return self.decode_graphs.forward(batch)
        return self.model.forward(batch, self.kv.cache, self.kv.state_pool)

    # -------------------------------------------------------------- calibration

    def calibrate(
        self,
        token_counts: tuple[int, ...] = (1, 4, 8, 16, 32, 64),
        context_lens: tuple[int, ...] = (0, 512),
        reps: int = 1,
        batch_sizes: tuple[int, ...] = (4, 16),
    ) -> list[CostSample]:
        """Time forward passes (and the argmax that picks their tokens) of scratch requests over a grid of step shapes.

        One request computing T tokens at each context length (a prefill chunk
        ending its prompt: one logits row), then B requests decoding one token
        each and one request verifying T − 1 drafts (T logits rows), so the
        scheduler's cost model can tell per-token, per-row and per-request
        costs apart before any real step has run. Uses free KV blocks and
        gives them back; call it while no request runs.
        """
        shapes = []  # (context length, tokens per request, logits rows per request, requests)
        for context_len in context_lens:
            shapes += [(context_len, n, 1, 1) for n in token_counts]
            shapes += [(context_len, 1, 1, b) for b in batch_sizes]
            shapes += [(context_len, n, n, 1) for n in token_counts if 1 < n <= 16]
        max_context = self.model_config.context_length - max(token_counts)
        samples = [
            self.time_step(min(context_len, max_context), num_tokens, num_logits, num_requests, reps)
            for context_len, num_tokens, num_logits, num_requests in shapes
        ]
        return [sample for sample in samples if sample is not None]

    def time_step(
        self, context_len: int, num_tokens: int, num_logits: int, num_requests: int, reps: int = 1
    ) -> CostSample | None:
        """The fastest of `reps` forward passes (after one to warm up) of `num_requests` scratch
        requests, each computing `num_tokens` tokens after `context_len` cached ones with
        `num_logits` logits rows (a verify of num_tokens − 1 drafts when they are equal); None
        when their KV does not fit. Call it while no request runs."""
        with self.kv.scratch(num_requests, context_len + num_tokens) as held:
            if held is None:
                return None
            pieces = [
                RequestSlice([0] * num_tokens, context_len, block_ids, num_logits, slot) for block_ids, slot in held
            ]
            forward_s, step_s = self._time_forward(pieces, reps)
        return CostSample(
            num_tokens * num_requests,
            attention_pairs(context_len, num_tokens) * num_requests,
            forward_s,
            num_logits * num_requests,
            num_requests,
            step_s,
        )

    def _time_forward(self, pieces: list[RequestSlice], reps: int) -> tuple[float, float]:
        """The fastest of `reps` forward passes over the pieces, after one to warm up: forward
        alone, and prepare + forward + argmax as a step would."""
        forward_times, step_times = [], []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            batch = self.prepare(pieces)
            t1 = time.perf_counter()
            logits = self.forward(batch)
            t2 = time.perf_counter()
            logits.argmax(dim=-1).tolist()
            t3 = time.perf_counter()
            forward_times.append(t2 - t1)
            step_times.append(t3 - t0)
        return min(forward_times[1:]), min(step_times[1:])
