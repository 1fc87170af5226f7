"""Tiny random Qwen3.5 (hybrid, dense and MoE) and Qwen3-MoE models: a transformers model
and the GGUF file llama.cpp's converter would write from it.

The GGUF side follows `convert_hf_to_gguf.py` (Qwen3NextModel, _LinearAttentionVReorderBase,
Qwen3_5TextModel, Qwen3_5MoeTextModel, Qwen2MoeModel) step for step:
- zero-centred RMSNorm weights (every `*norm.weight` but the DeltaNet's gated norm) are
  stored as 1 + w; A_log is stored as ssm_a = -exp(A_log); dt_bias as ssm_dt.bias; the
  conv kernel squeezed to [channels, kernel];
- with fewer key heads than value heads, every value-head axis (v rows of the qkv
  projection and conv channels, z, a, b, A, dt, the out projection's columns) goes from
  HF's grouped order (value heads of key head 0, then of key head 1, ...) to ggml's tiled
  order (value head 0 of every key head, then value head 1, ...);
- experts stacked into 3-D `ffn_{gate,up,down}_exps` tensors.
Qwen3-MoE's norms are plain RMSNorms, stored as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tests.support.tiny_gguf import add_tensor, new_writer, tiny_vocab, write_file

ROPE = {
    "rope_type": "default",
    "rope_theta": 1e6,
    "partial_rotary_factor": 0.25,
    "mrope_section": [2, 1, 1],
    "mrope_interleaved": True,
}


@dataclass(frozen=True)
class TinyHybridSpec:
    architecture: str = "qwen35"  # qwen35 | qwen35moe | qwen3moe
    tensor_type: GGMLQuantizationType = GGMLQuantizationType.F32
    num_layers: int = 4  # qwen35*: every 4th layer is full attention
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 128
    num_experts: int = 8
    num_experts_per_token: int = 2
    expert_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 48
    linear_key_heads: int = 2
    linear_value_heads: int = 4
    linear_head_dim: int = 16
    conv_kernel: int = 4
    context_length: int = 512
    seed: int = 0


def build_hf_model(spec: TinyHybridSpec):
    """A transformers model of the spec with random weights (norms, decays and gates too)."""
    vocab = len(tiny_vocab()[0])
    common = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.context_length,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    linear = dict(
        linear_conv_kernel_dim=spec.conv_kernel,
        linear_key_head_dim=spec.linear_head_dim,
        linear_value_head_dim=spec.linear_head_dim,
        linear_num_key_heads=spec.linear_key_heads,
        linear_num_value_heads=spec.linear_value_heads,
        rope_parameters=dict(ROPE),
    )
    moe = dict(
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_token,
        moe_intermediate_size=spec.expert_intermediate_size,
    )
    if spec.architecture == "qwen35":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=spec.intermediate_size, **common, **linear))
    elif spec.architecture == "qwen35moe":
        from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        config = Qwen3_5MoeTextConfig(
            shared_expert_intermediate_size=spec.shared_expert_intermediate_size, **common, **linear, **moe
        )
        model = Qwen3_5MoeForCausalLM(config)
    elif spec.architecture == "qwen3moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(
            intermediate_size=spec.intermediate_size, norm_topk_prob=True, rope_theta=1e6, **common, **moe
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        raise ValueError(f"unknown architecture {spec.architecture!r}")

    gen = torch.Generator().manual_seed(spec.seed)
    zero_centred = spec.architecture != "qwen3moe"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 8.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
            elif "norm" in name:
                centre = 0.0 if zero_centred and "linear_attn.norm" not in name else 1.0
                p.copy_(centre + 0.1 * torch.randn(p.shape, generator=gen))
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:  # projections: [..., rows, cols] read along cols
                scale = 3.2 if "embed" in name or "lm_head" in name else 0.8
                p.copy_(torch.randn(p.shape, generator=gen) * scale / np.sqrt(p.shape[-1]))
    return model.eval()


def _tiled_order(num_key_heads: int, num_value_heads: int, head_dim: int) -> np.ndarray:
    """Row order taking HF's grouped value heads to ggml's tiled ones (the converter's _reorder_v_heads)."""
    per_key = num_value_heads // num_key_heads
    return (
        np.arange(num_value_heads * head_dim).reshape(num_key_heads, per_key, head_dim).transpose(1, 0, 2).reshape(-1)
    )


def write_gguf(model, path: Path, spec: TinyHybridSpec) -> Path:
    """The model's weights as llama.cpp's converter lays them out (see the module docstring)."""
    arch = spec.architecture
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer = new_writer(
        path,
        arch,
        context_length=spec.context_length,
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        rope_theta=1e6,
    )
    writer.add_name(f"tiny-{arch}")
    if arch != "qwen35moe":
        writer.add_feed_forward_length(spec.intermediate_size)
    if arch in ("qwen35moe", "qwen3moe"):
        writer.add_expert_count(spec.num_experts)
        writer.add_expert_used_count(spec.num_experts_per_token)
        writer.add_expert_feed_forward_length(spec.expert_intermediate_size)
    if arch == "qwen35moe":
        writer.add_expert_shared_feed_forward_length(spec.shared_expert_intermediate_size)
    if arch in ("qwen35", "qwen35moe"):
        writer.add_rope_dimension_count(int(spec.head_dim * ROPE["partial_rotary_factor"]))
        writer.add_rope_dimension_sections([*ROPE["mrope_section"], 0])
        writer.add_ssm_conv_kernel(spec.conv_kernel)
        writer.add_ssm_state_size(spec.linear_head_dim)
        writer.add_ssm_group_count(spec.linear_key_heads)
        writer.add_ssm_time_step_rank(spec.linear_value_heads)
        writer.add_ssm_inner_size(spec.linear_head_dim * spec.linear_value_heads)
        writer.add_full_attention_interval(4)
    else:
        writer.add_rope_dimension_count(spec.head_dim)

    qtype = spec.tensor_type
    plus_one = (lambda w: w + 1.0) if arch != "qwen3moe" else (lambda w: w)
    key_dim = spec.linear_key_heads * spec.linear_head_dim
    v_rows = _tiled_order(spec.linear_key_heads, spec.linear_value_heads, spec.linear_head_dim)
    v_heads = _tiled_order(spec.linear_key_heads, spec.linear_value_heads, 1)
    qkv_rows = np.concatenate([np.arange(2 * key_dim), 2 * key_dim + v_rows])

    add_tensor(writer, "token_embd.weight", sd["model.embed_tokens.weight"], qtype)
    for i in range(spec.num_layers):
        hf, p = f"model.layers.{i}.", f"blk.{i}."
        post_norm = "post_attention_norm" if arch != "qwen3moe" else "ffn_norm"
        add_tensor(writer, p + "attn_norm.weight", plus_one(sd[hf + "input_layernorm.weight"]), qtype)
        add_tensor(writer, p + post_norm + ".weight", plus_one(sd[hf + "post_attention_layernorm.weight"]), qtype)
        if hf + "linear_attn.A_log" in sd:
            la = hf + "linear_attn."
            add_tensor(writer, p + "attn_qkv.weight", sd[la + "in_proj_qkv.weight"][qkv_rows], qtype)
            add_tensor(writer, p + "attn_gate.weight", sd[la + "in_proj_z.weight"][v_rows], qtype)
            add_tensor(
                writer, p + "ssm_conv1d.weight", sd[la + "conv1d.weight"].squeeze(1)[qkv_rows], GGMLQuantizationType.F32
            )
            add_tensor(writer, p + "ssm_dt.bias", sd[la + "dt_bias"][v_heads], qtype)
            add_tensor(writer, p + "ssm_a", -np.exp(sd[la + "A_log"][v_heads]), qtype)
            add_tensor(writer, p + "ssm_beta.weight", sd[la + "in_proj_b.weight"][v_heads], qtype)
            add_tensor(writer, p + "ssm_alpha.weight", sd[la + "in_proj_a.weight"][v_heads], qtype)
            add_tensor(writer, p + "ssm_norm.weight", sd[la + "norm.weight"], qtype)
            add_tensor(writer, p + "ssm_out.weight", sd[la + "out_proj.weight"][:, v_rows], qtype)
        else:
            sa = hf + "self_attn."
            for ours, theirs in (
                ("attn_q", "q_proj"),
                ("attn_k", "k_proj"),
                ("attn_v", "v_proj"),
                ("attn_output", "o_proj"),
            ):
                add_tensor(writer, p + ours + ".weight", sd[sa + theirs + ".weight"], qtype)
            add_tensor(writer, p + "attn_q_norm.weight", plus_one(sd[sa + "q_norm.weight"]), qtype)
            add_tensor(writer, p + "attn_k_norm.weight", plus_one(sd[sa + "k_norm.weight"]), qtype)
        mlp = hf + "mlp."
        if mlp + "gate.weight" in sd:
            add_tensor(writer, p + "ffn_gate_inp.weight", sd[mlp + "gate.weight"], qtype)
            gate_up = sd[mlp + "experts.gate_up_proj"]  # [experts, 2 * ff, hidden]
            ff = gate_up.shape[1] // 2
            add_tensor(writer, p + "ffn_gate_exps.weight", gate_up[:, :ff], qtype)
            add_tensor(writer, p + "ffn_up_exps.weight", gate_up[:, ff:], qtype)
            add_tensor(writer, p + "ffn_down_exps.weight", sd[mlp + "experts.down_proj"], qtype)
            if mlp + "shared_expert_gate.weight" in sd:
                add_tensor(
                    writer, p + "ffn_gate_inp_shexp.weight", sd[mlp + "shared_expert_gate.weight"], qtype
                )  # [1, hidden], as converted
                for proj in ("gate", "up", "down"):
                    add_tensor(
                        writer, p + f"ffn_{proj}_shexp.weight", sd[mlp + f"shared_expert.{proj}_proj.weight"], qtype
                    )
        else:
            for proj in ("gate", "up", "down"):
                add_tensor(writer, p + f"ffn_{proj}.weight", sd[mlp + f"{proj}_proj.weight"], qtype)
    add_tensor(writer, "output_norm.weight", plus_one(sd["model.norm.weight"]), qtype)
    add_tensor(writer, "output.weight", sd["lm_head.weight"], qtype)

    return write_file(writer, path)


def write_tiny_hybrid_model(path: Path, spec: TinyHybridSpec = TinyHybridSpec()):
    """(the transformers model, the GGUF file written from it)."""
    model = build_hf_model(spec)
    return model, write_gguf(model, path, spec)
