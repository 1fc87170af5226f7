"""The engine's configuration, built from CLI flags and validated once; torch-free, so a
parser of the executor's flags (executor_svc/flags.py) needs neither torch nor a model.

Each field is a flag and carries it (its name, help, and unit where the flag counts in
others): `swarmserve-executor` lists them in this order, after --listen and before the
server's own flags (service_common/config_flags.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service_common.config_flags import GIB, flag

DTYPE_CHOICES = ("auto", "float32", "bfloat16")  # model_runner.DTYPES maps the named ones to torch dtypes
DEVICES = ("auto", "cpu", "cuda")
KERNELS = ("auto", "triton", "cpu", "torch")
MATMULS = ("auto", "exact", "int16", "int8", "bf16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # model_runner.resolve_kv_cache_dtype
DRAFT_SHAPES = ("chain", "tree")  # sampling/drafter.py: propose, propose_tree


# The longest suffix the indexes match, in tokens. Near-identical blocks (an agent copying one of
# several similar functions) differ at a name or a digit that lies more than 8 tokens back once
# the copy is a few tokens past it: at 8 the match then stops short of it and proposes the most
# recent block's continuation. Replayed over the embedded model's greedy output of `bench spec`'s
# branchy workload (200 tokens, 16-token drafts), 12 took chains from 42 verify steps to 37 (3.90
# to 4.57 accepted a step); 16 and 24 found nothing more. Its cost: ~1.2x the index nodes and
# append time on code, ~1.5x on text that repeats (sampling/drafter.py's module docstring).
DEFAULT_MAX_NGRAM = 12


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(
        default="default",
        metadata=flag("--model", help="'default' (embedded SmolLM2-135M-Instruct) or a path to a .gguf"),
    )
    # The id clients send and see (/v1/models, `model` in every answer, the metrics' label).
    served_model_name: str = field(
        default="",
        metadata=flag(
            "--served-model-name",
            help="the served model's id (default: the model file's stem, e.g. SmolLM2-135M-Instruct.Q4_1)",
        ),
    )
    # Activations and KV (see model_runner.resolve_dtype).
    dtype: str = field(
        default="auto",
        metadata=flag(
            "--dtype",
            choices=DTYPE_CHOICES,
            help="activation dtype; auto: bfloat16 on a GPU, float32 on the CPU (default %(default)s)",
        ),
    )
    device: str = field(
        default="auto",
        metadata=flag("--device", help="auto | cpu | cuda (ROCm's torch answers to cuda) (default %(default)s)"),
    )
    kernels: str = field(
        default="auto",
        metadata=flag(
            "--kernels",
            choices=KERNELS,
            help="auto: triton on a GPU, the C++ kernels (cpu) on the CPU; torch: the plain-torch reference "
            "(default %(default)s)",
        ),
    )
    # See model_runner.resolve_matmul.
    matmul: str = field(
        default="auto",
        metadata=flag(
            "--matmul",
            choices=MATMULS,
            help="how quantized weights multiply on the CPU: exact (float32 math on the dequantized weights), "
            "int16 (activations quantized to int16 per 32-value block, integer dot products with Q4_0/Q4_1/Q8_0 "
            "codes: faster, top-1 agreement with exact >= 99%%) or int8 (activations in 8 bits per block over its "
            "range: prompts ~1.4x faster than int16 on Zen 4, top-1 agreement ~98%%; needs AVX512-VNNI) or bf16 "
            "(weights dequantized once and rounded to bf16, activations rounded to bf16, float32 sums on the AMX "
            "tiles or with VDPBF16PS: prompts ~1.3-3x faster than int16, a lone decode slower, top-1 agreement "
            "~99-99.5%%; needs AVX512-BF16: Zen 4, Xeons with AMX); auto: int16 on the CPU unless --dtype float32 "
            "(default %(default)s)",
        ),
    )
    kv_cache_bytes: int = field(
        default=1 << 30,
        metadata=flag("--kv-cache-gb", unit=GIB, help="memory for the paged KV cache in GiB (default %(default)s)"),
    )
    # See model_runner.resolve_kv_cache_dtype.
    kv_cache_dtype: str = field(
        default="auto",
        metadata=flag(
            "--kv-cache-dtype",
            choices=KV_CACHE_DTYPES,
            help="KV cache element type; auto: bfloat16 with --matmul bf16, float16 with the C++ CPU kernels' "
            "integer matmul (the CPU default), else the activations' dtype; float16/bfloat16 with float32 "
            "activations (the C++ CPU kernels) halve the bytes a long-context decode reads and double the tokens in "
            "the budget; bfloat16 also runs attention in bfloat16 products, on the AMX tiles where the CPU has them "
            "(else AVX512_BF16 dot products where it has those) (default %(default)s)",
        ),
    )
    block_size: int = field(default=16, metadata=flag("--block-size", help="tokens per KV block (default %(default)s)"))
    # A guard against a runaway plan.
    max_num_batched_tokens: int = field(
        default=8192,
        metadata=flag("--max-num-batched-tokens", help="most tokens one step may compute (default %(default)s)"),
    )
    # A request's result does not depend on its batch (see ragged_batch.py).
    batch_invariant: bool = field(
        default=True,
        metadata=flag(
            "--no-batch-invariant",
            negated=True,
            help="let batch composition change results in the last bits (slightly faster at batch size 1)",
        ),
    )
    # None keeps torch's default.
    num_threads: int | None = field(
        default=None, metadata=flag("--threads", help="torch intra-op threads (default: torch's choice)")
    )
    max_draft_tokens: int = field(
        default=16,
        metadata=flag(
            "--max-draft-tokens", help="most draft tokens one request verifies per step (default %(default)s)"
        ),
    )
    draft_max_ngram: int = field(
        default=DEFAULT_MAX_NGRAM,
        metadata=flag(
            "--draft-max-ngram",
            help="longest suffix, in tokens, the drafter matches in the context to find what followed it "
            "(vLLM's prompt_lookup_max; default %(default)s)",
        ),
    )
    # A request's draft budget buys a chain or a tree of that many nodes (drafter.py).
    draft_shape: str = field(
        default="chain",
        metadata=flag(
            "--draft-shape",
            choices=DRAFT_SHAPES,
            help="chain: the continuation of the latest suffix match; tree: several continuations by their "
            "counts, verified in one pass (grammar requests and hybrid models keep chains; default %(default)s)",
        ),
    )
    # Hybrid models (Qwen3.5): ignored for models without recurrent layers.
    num_state_slots: int = field(
        default=16,
        metadata=flag(
            "--num-state-slots",
            help="hybrid models (Qwen3.5): recurrent-state slots, the most requests computed at once; "
            "their memory comes out of the KV budget (default %(default)s)",
        ),
    )
    # Hybrid models' prefix cache (see kv_manager.py). None: one per slot, within a quarter of what the slots leave.
    num_state_snapshots: int | None = field(
        default=None,
        metadata=flag(
            "--num-state-snapshots",
            help="hybrid models: recurrent-state snapshots at block boundaries, what their prefix cache resumes "
            "from (each the size of a slot, out of the KV budget; default: one per slot, within a quarter of what "
            "the slots leave)",
        ),
    )
    use_swarm_index: bool = field(
        default=False, metadata=flag("--swarm-index", help="also draft from other requests' outputs")
    )
    # Full KV blocks of equal prefixes are shared, and kept after their requests end.
    enable_prefix_caching: bool = field(
        default=True,
        metadata=flag(
            "--no-prefix-caching",
            negated=True,
            help="recompute every prompt instead of reusing cached KV blocks of equal prefixes",
        ),
    )
    # Triton kernels on a GPU, models without recurrent state (see decode_graphs.py); ignored elsewhere.
    decode_graphs: bool = field(
        default=True,
        metadata=flag(
            "--no-decode-graphs",
            negated=True,
            help="on a GPU, launch every decode step's kernels from Python instead of replaying captured graphs",
        ),
    )
    # Start from the calibration measured last for this setup (model file, kernel build, CPU, settings:
    # see engine/calibration_cache.py) instead of measuring again; the scheduler refines it online.
    reuse_calibration: bool = field(
        default=True,
        metadata=flag(
            "--recalibrate",
            negated=True,
            help="measure the start-up calibration even if one is cached for this setup (and keep the new one)",
        ),
    )

    def __post_init__(self) -> None:
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {DEVICES} (or cuda:N), got {self.device!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.matmul not in MATMULS:
            raise ValueError(f"matmul must be one of {MATMULS}, got {self.matmul!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.draft_shape not in DRAFT_SHAPES:
            raise ValueError(f"draft_shape must be one of {DRAFT_SHAPES}, got {self.draft_shape!r}")
        if self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {self.max_draft_tokens}")
        if self.draft_max_ngram < 1:
            raise ValueError(f"draft_max_ngram must be >= 1, got {self.draft_max_ngram}")
        if self.num_state_slots <= 0:
            raise ValueError(f"num_state_slots must be positive, got {self.num_state_slots}")
        if self.num_state_snapshots is not None and self.num_state_snapshots < 0:
            raise ValueError(f"num_state_snapshots must be >= 0, got {self.num_state_snapshots}")
