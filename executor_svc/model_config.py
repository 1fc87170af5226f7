"""The shape of a llama-family model, read from GGUF metadata.

Keys follow llama.cpp's naming: `{arch}.block_count`, `{arch}.attention.head_count`, ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from executor_svc.errors import ModelLoadError

if TYPE_CHECKING:  # reading GGUF files needs the gguf package; the shapes alone do not
    from executor_svc.gguf_file import GGUFFile

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_norm_eps: float
    rope_theta: float
    rope_linear_factor: float  # positions are divided by this ("linear" rope scaling)
    has_qkv_bias: bool  # qwen2
    has_qk_norm: bool  # qwen3: RMSNorm over each head of q and k before RoPE
    has_rope_freq_factors: bool  # llama3-style per-dimension frequency divisors
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"head_count {self.num_heads} is not a multiple of head_count_kv {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head dimension {self.head_dim} must be even for RoPE")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> "ModelConfig":
        arch = gguf.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{gguf.path}: architecture {arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        meta = gguf.metadata

        def get(key: str, default=None):
            full = f"{arch}.{key}"
            if full in meta:
                return meta[full]
            if default is None:
                raise ModelLoadError(f"{gguf.path}: required metadata key {full!r} is missing")
            return default

        num_heads = int(get("attention.head_count"))
        hidden_size = int(get("embedding_length"))
        head_dim = int(get("attention.key_length", hidden_size // num_heads))
        value_dim = int(get("attention.value_length", head_dim))
        if value_dim != head_dim:
            raise ModelLoadError(f"{gguf.path}: key_length {head_dim} != value_length {value_dim} is not supported")
        rope_dims = int(get("rope.dimension_count", head_dim))
        if rope_dims != head_dim:
            raise ModelLoadError(f"{gguf.path}: partial RoPE ({rope_dims} of {head_dim} dims) is not supported")

        scaling_type = str(get("rope.scaling.type", "none"))
        factor = float(get("rope.scaling.factor", 1.0))
        if scaling_type in ("none", "") or factor == 1.0:
            linear_factor = 1.0
        elif scaling_type == "linear":
            linear_factor = factor
        else:
            raise ModelLoadError(f"{gguf.path}: rope scaling {scaling_type!r} is not supported (supported: none, linear)")

        tokens = meta.get("tokenizer.ggml.tokens")
        vocab_size = int(get("vocab_size", len(tokens) if tokens else 0) or 0)
        embed = gguf.tensors.get("token_embd.weight")
        if embed is None:
            raise ModelLoadError(f"{gguf.path}: tensor 'token_embd.weight' is missing")
        if vocab_size == 0:
            vocab_size = embed.shape[0]

        return cls(
            architecture=arch,
            name=str(meta.get("general.name", gguf.path.stem)),
            num_layers=int(get("block_count")),
            hidden_size=hidden_size,
            intermediate_size=int(get("feed_forward_length")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            vocab_size=vocab_size,
            context_length=int(get("context_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_linear_factor=linear_factor,
            has_qkv_bias="blk.0.attn_q.bias" in gguf.tensors,
            has_qk_norm="blk.0.attn_q_norm.weight" in gguf.tensors,
            has_rope_freq_factors="rope_freqs.weight" in gguf.tensors,
            tie_word_embeddings="output.weight" not in gguf.tensors,
        )
