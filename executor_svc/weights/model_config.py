"""The shape of a model, read from GGUF metadata.

Keys follow llama.cpp's naming: `{arch}.block_count`, `{arch}.attention.head_count`, ...
Three families share one config:

- dense llama-family (llama, qwen2, qwen3);
- mixture of experts (qwen3moe; qwen35moe's FFN): `{arch}.expert_count` experts of
  `{arch}.expert_feed_forward_length`, `{arch}.expert_used_count` of them per token,
  softmax routing with the top-k weights renormalised (llama.cpp hard-codes that for
  both architectures), plus for qwen35moe a shared expert behind a sigmoid gate;
- the Qwen3.5 hybrid (qwen35, qwen35moe): Gated DeltaNet layers (`{arch}.ssm.*`:
  conv_kernel, state_size = key head dim, group_count = key heads, time_step_rank =
  value heads, inner_size = value heads × value head dim) with a gated full-attention
  layer every `{arch}.full_attention_interval` layers, whose RoPE turns only the first
  `{arch}.rope.dimension_count` dims of each head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from executor_svc.errors import ModelLoadError

if TYPE_CHECKING:  # reading GGUF files needs the gguf package; the shapes alone do not
    from executor_svc.weights.gguf_file import GGUFFile

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen35", "qwen35moe")
HYBRID_ARCHITECTURES = ("qwen35", "qwen35moe")
MOE_ARCHITECTURES = ("qwen3moe", "qwen35moe")


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
    rope_dims: int = 0  # dims of each head RoPE turns (the first ones); 0: all of head_dim
    # Mixture of experts (0 experts: a dense FFN).
    num_experts: int = 0
    num_experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    # The hybrid's recurrent (Gated DeltaNet) layers; empty: every layer is full attention.
    recurrent_layers: tuple[bool, ...] = ()
    conv_kernel: int = 0
    num_linear_key_heads: int = 0
    num_linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"head_count {self.num_heads} is not a multiple of head_count_kv {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelLoadError(f"head dimension {self.head_dim} must be even for RoPE")
        if self.rope_dims % 2 or not 0 <= self.rope_dims <= self.head_dim:
            raise ModelLoadError(
                f"rope dimension count {self.rope_dims} must be even and at most head_dim {self.head_dim}"
            )
        if self.num_experts and not 0 < self.num_experts_per_token <= self.num_experts:
            raise ModelLoadError(
                f"expert_used_count {self.num_experts_per_token} must be in [1, expert_count {self.num_experts}]"
            )
        if self.recurrent_layers:
            if len(self.recurrent_layers) != self.num_layers:
                raise ModelLoadError(f"{len(self.recurrent_layers)} layer kinds for {self.num_layers} layers")
            if (
                min(
                    self.conv_kernel,
                    self.num_linear_key_heads,
                    self.num_linear_value_heads,
                    self.linear_key_head_dim,
                    self.linear_value_head_dim,
                )
                <= 0
            ):
                raise ModelLoadError(
                    "a hybrid model needs positive ssm conv_kernel, group_count, time_step_rank, state_size and inner_size"
                )
            if self.num_linear_value_heads % self.num_linear_key_heads:
                raise ModelLoadError(
                    f"ssm time_step_rank (value heads) {self.num_linear_value_heads} is not a multiple of "
                    f"group_count (key heads) {self.num_linear_key_heads}"
                )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_hybrid(self) -> bool:
        """Some layers are recurrent (Gated DeltaNet): each request also holds a fixed-size state."""
        return any(self.recurrent_layers)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_layers(self) -> list[int]:
        """The layers that keep paged KV (full attention): all of them in a dense model."""
        return [i for i in range(self.num_layers) if not (self.recurrent_layers and self.recurrent_layers[i])]

    @property
    def recurrent_layer_indices(self) -> list[int]:
        return [i for i, is_recurrent in enumerate(self.recurrent_layers) if is_recurrent]

    @property
    def rotary_dims(self) -> int:
        return self.rope_dims or self.head_dim

    @property
    def linear_key_dim(self) -> int:
        return self.num_linear_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.num_linear_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short causal conv: q, k and v of a DeltaNet layer."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> "ModelConfig":
        arch = gguf.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{gguf.path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
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
        is_hybrid = arch in HYBRID_ARCHITECTURES
        if rope_dims != head_dim and not is_hybrid:
            raise ModelLoadError(
                f"{gguf.path}: partial RoPE ({rope_dims} of {head_dim} dims) is not supported for {arch}"
            )

        scaling_type = str(get("rope.scaling.type", "none"))
        factor = float(get("rope.scaling.factor", 1.0))
        if scaling_type in ("none", "") or factor == 1.0:
            linear_factor = 1.0
        elif scaling_type == "linear":
            linear_factor = factor
        else:
            raise ModelLoadError(
                f"{gguf.path}: rope scaling {scaling_type!r} is not supported (supported: none, linear)"
            )

        tokens = meta.get("tokenizer.ggml.tokens")
        vocab_size = int(get("vocab_size", len(tokens) if tokens else 0) or 0)
        embed = gguf.tensors.get("token_embd.weight")
        if embed is None:
            raise ModelLoadError(f"{gguf.path}: tensor 'token_embd.weight' is missing")
        if vocab_size == 0:
            vocab_size = embed.shape[0]

        # llama.cpp's converter appends Qwen3.5's multi-token-prediction block(s) to block_count; we skip them.
        num_layers = int(get("block_count")) - int(get("nextn_predict_layers", 0) or 0)
        moe, hybrid = {}, {}
        if arch in MOE_ARCHITECTURES:
            moe = dict(
                num_experts=int(get("expert_count")),
                num_experts_per_token=int(get("expert_used_count")),
                expert_intermediate_size=int(get("expert_feed_forward_length")),
                shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0) or 0)
                if "blk.0.ffn_up_shexp.weight" in gguf.tensors
                else 0,
            )
            if not bool(get("expert_weights_norm", True)) or float(get("expert_weights_scale", 1.0) or 1.0) != 1.0:
                raise ModelLoadError(f"{gguf.path}: only renormalised, unscaled top-k expert weights are supported")
        if is_hybrid:
            interval = int(get("full_attention_interval", 4))
            if interval <= 0:
                raise ModelLoadError(f"{gguf.path}: full_attention_interval must be positive, got {interval}")
            value_heads = int(get("ssm.time_step_rank"))
            inner = int(get("ssm.inner_size"))
            if inner % value_heads:
                raise ModelLoadError(
                    f"{gguf.path}: ssm.inner_size {inner} is not a multiple of time_step_rank {value_heads}"
                )
            recurrent = meta.get(f"{arch}.attention.recurrent_layers")
            if recurrent is None:
                recurrent = [(i + 1) % interval != 0 for i in range(num_layers)]
            hybrid = dict(
                recurrent_layers=tuple(bool(r) for r in list(recurrent)[:num_layers]),
                conv_kernel=int(get("ssm.conv_kernel")),
                num_linear_key_heads=int(get("ssm.group_count")),
                num_linear_value_heads=value_heads,
                linear_key_head_dim=int(get("ssm.state_size")),
                linear_value_head_dim=inner // value_heads,
            )
        # Attention-only tensors are looked up in the first full-attention layer (a hybrid's layer 0 is DeltaNet).
        first_attention = next((i for i, r in enumerate(hybrid.get("recurrent_layers", ())) if not r), 0)
        a = f"blk.{first_attention}."
        return cls(
            architecture=arch,
            name=str(meta.get("general.name", gguf.path.stem)),
            num_layers=num_layers,
            hidden_size=hidden_size,
            intermediate_size=int(get("feed_forward_length", 0 if arch in MOE_ARCHITECTURES else None)),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            vocab_size=vocab_size,
            context_length=int(get("context_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_linear_factor=linear_factor,
            has_qkv_bias=a + "attn_q.bias" in gguf.tensors,
            has_qk_norm=a + "attn_q_norm.weight" in gguf.tensors,
            has_rope_freq_factors="rope_freqs.weight" in gguf.tensors,
            tie_word_embeddings="output.weight" not in gguf.tensors,
            rope_dims=rope_dims if rope_dims != head_dim else 0,
            **moe,
            **hybrid,
        )
