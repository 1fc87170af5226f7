"""The engine's configuration, built from CLI flags and validated once; torch-free, so a
parser of the executor's flags (executor_svc/flags.py) needs neither torch nor a model."""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_CHOICES = ("auto", "float32", "bfloat16")  # model_runner.DTYPES maps the named ones to torch dtypes
DEVICES = ("auto", "cpu", "cuda")
KERNELS = ("auto", "triton", "cpu", "torch")
MATMULS = ("auto", "exact", "int16")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"  # "default" (the embedded SmolLM2) or a path to a .gguf
    dtype: str = "auto"  # activations and KV: auto | float32 | bfloat16 (see resolve_dtype)
    device: str = "auto"  # auto | cpu | cuda (ROCm's torch answers to cuda too)
    kernels: str = "auto"  # auto | triton | cpu | torch: auto is triton on a GPU, the C++ kernels on the CPU
    matmul: str = "auto"  # auto | exact | int16 (see model_runner.resolve_matmul)
    kv_cache_bytes: int = 1 << 30
    block_size: int = 16
    max_num_batched_tokens: int = 8192  # tokens one step may compute, a guard against a runaway plan
    batch_invariant: bool = True  # a request's result does not depend on its batch (see ragged_batch.py)
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default
    max_draft_tokens: int = 16  # most speculative tokens one request may verify per step
    use_swarm_index: bool = False  # also draft from other requests' outputs
    enable_prefix_caching: bool = True  # share full KV blocks of equal prefixes, keep them after requests end
    # Hybrid models (Qwen3.5): recurrent-state slots, the most requests computed at once; their
    # memory comes out of kv_cache_bytes. Ignored for models without recurrent layers.
    num_state_slots: int = 16
    # Hybrid models' prefix cache: recurrent-state snapshots at block boundaries (see kv_manager.py), each
    # the size of a slot, out of kv_cache_bytes. None: one per slot, within a quarter of what the slots leave.
    num_state_snapshots: int | None = None
    # Replay plain decode steps from captured CUDA/HIP graphs (Triton kernels on a GPU, models without
    # recurrent state; see decode_graphs.py). Ignored elsewhere.
    decode_graphs: bool = True

    def __post_init__(self) -> None:
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {DEVICES} (or cuda:N), got {self.device!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.matmul not in MATMULS:
            raise ValueError(f"matmul must be one of {MATMULS}, got {self.matmul!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {self.max_draft_tokens}")
        if self.num_state_slots <= 0:
            raise ValueError(f"num_state_slots must be positive, got {self.num_state_slots}")
        if self.num_state_snapshots is not None and self.num_state_snapshots < 0:
            raise ValueError(f"num_state_snapshots must be >= 0, got {self.num_state_snapshots}")
