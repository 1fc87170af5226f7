"""Tiny random GGUF models written with the `gguf` writer, for fast tests.

Each has a real (small) byte-level BPE tokenizer in its metadata, so the engine and
transformers can both load it. Quantized tensor types the `gguf` package cannot
quantize (the K-quants) are written as random blocks with sane fp16 scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants
from gguf.constants import GGML_QUANT_SIZES

# GPT-2's byte-to-unicode table: every byte as a printable character.
_BYTE_CHARS = (
    list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
)


def byte_alphabet() -> list[str]:
    cs = list(_BYTE_CHARS)
    n = 0
    for b in range(256):
        if b not in _BYTE_CHARS:
            cs.append(256 + n)
            n += 1
    bs = list(_BYTE_CHARS) + [b for b in range(256) if b not in _BYTE_CHARS]
    table = dict(zip(bs, (chr(c) for c in cs)))
    return [table[b] for b in range(256)]


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]


CHATML_TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)

# Qwen2.5's template, cut down: tools in the system prompt, calls as <tool_call> JSON (hermes).
HERMES_TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are a helpful assistant.{% endif %}


# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{% for message in messages %}
{% if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}{% for call in message.tool_calls %}{% if call.function is defined %}{% set call = call.function %}{% endif %}
<tool_call>
{"name": "{{ call.name }}", "arguments": {{ call.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 3 control tokens, 256 bytes, one token per merge."""
    tokens = list(SPECIAL_TOKENS) + byte_alphabet()
    for merge in MERGES:
        tokens.append(merge.replace(" ", ""))
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, types, list(MERGES)


@dataclass(frozen=True)
class TinyModelSpec:
    architecture: str = "llama"  # llama | qwen2 | qwen3
    tensor_type: GGMLQuantizationType = GGMLQuantizationType.F32
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    context_length: int = 512
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    head_dim: int | None = None  # None: hidden_size // num_heads
    seed: int = 0
    chat_template: str = ""  # empty: CHATML_TEMPLATE


def tiny_kv_bytes_per_block(block_size: int = 16) -> int:
    """KV bytes per block of a default TinyModelSpec (2 layers, 2 KV heads of 16) in the KV dtype an
    executor with default flags picks on this CPU. Tests size a KV budget in blocks with it."""
    import torch

    from executor_svc.engine.model_runner import resolve_kv_cache_dtype, resolve_matmul
    from executor_svc.model.cpu_ops import CpuOps

    cpu = torch.device("cpu")
    matmul = resolve_matmul("auto", "auto", cpu, "auto")
    kv_dtype = resolve_kv_cache_dtype("auto", torch.float32, CpuOps, matmul, head_dim=16)
    return 2 * 2 * block_size * 2 * 16 * kv_dtype.itemsize


def _block_elements(qtype: GGMLQuantizationType) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def random_k_quant_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: GGMLQuantizationType) -> np.ndarray:
    """Random K-quant bytes [rows, cols / 256 * block_bytes] with finite, small scales."""
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    scale = lambda size: rng.uniform(0.001, 0.01, size=size).astype(np.float16).view(np.uint8)  # noqa: E731
    n = rows * (cols // block_elems)
    if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        # d then dmin lead the block.
        blocks[..., 0:2] = scale(n).reshape(rows, -1, 2)
        blocks[..., 2:4] = scale(n).reshape(rows, -1, 2)
    elif qtype == GGMLQuantizationType.Q6_K:
        # d is the last two bytes.
        blocks[..., -2:] = scale(n).reshape(rows, -1, 2)
    else:
        raise ValueError(f"not a K-quant: {qtype.name}")
    return blocks.reshape(rows, -1)


def add_tensor(writer: GGUFWriter, name: str, values: np.ndarray, qtype: GGMLQuantizationType, rng=None) -> None:
    """A tensor in `qtype`; vectors, and rows that are not whole blocks of it, stay float32 (as
    llama.cpp's converter keeps them). K-quants get random blocks (`rng` needed): the `gguf`
    package cannot quantize to them."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype == GGMLQuantizationType.F32 or values.ndim == 1 or values.shape[-1] % _block_elements(qtype):
        writer.add_tensor(name, values)
    elif qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K):
        rows = int(np.prod(values.shape[:-1]))
        blocks = random_k_quant_blocks(rng, rows, values.shape[-1], qtype)
        writer.add_tensor(name, blocks.reshape(*values.shape[:-1], -1), raw_dtype=qtype)
    elif qtype == GGMLQuantizationType.F16:
        writer.add_tensor(name, quants.quantize(values, qtype))
    else:
        writer.add_tensor(name, quants.quantize(values, qtype), raw_dtype=qtype)


def new_writer(
    path: Path,
    arch: str,
    *,
    context_length: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rope_theta: float,
    chat_template: str | None = None,
) -> GGUFWriter:
    """A writer holding what every tiny model's metadata has: its attention shape, RMSNorm eps, and
    the tiny BPE tokenizer; the caller adds the architecture's own keys and the tensors."""
    tokens, types, merges = tiny_vocab()
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(context_length)
    writer.add_embedding_length(hidden_size)
    writer.add_block_count(num_layers)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)
    return writer


def write_file(writer: GGUFWriter, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_model(path: Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    rng = np.random.default_rng(spec.seed)
    arch = spec.architecture
    head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
    vocab = len(tiny_vocab()[0])
    h, q, kv = spec.hidden_size, spec.num_heads * head_dim, spec.num_kv_heads * head_dim

    writer = new_writer(
        path,
        arch,
        context_length=spec.context_length,
        hidden_size=h,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=head_dim,
        rope_theta=spec.rope_theta,
        chat_template=spec.chat_template or CHATML_TEMPLATE,
    )
    writer.add_name(f"tiny-{arch}-{spec.tensor_type.name}")
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_rope_dimension_count(head_dim)

    def matrix(rows: int, cols: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols) * 4).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    qtype = spec.tensor_type
    # The embedding stays in a 32-element-block type even for K-quant models, as llama.cpp often does.
    embed_type = GGMLQuantizationType.Q8_0 if qtype != GGMLQuantizationType.F32 else qtype
    add_tensor(writer, "token_embd.weight", matrix(vocab, h, 4.0), embed_type, rng)
    for i in range(spec.num_layers):
        p = f"blk.{i}."
        add_tensor(writer, p + "attn_norm.weight", norm(h), qtype)
        add_tensor(writer, p + "attn_q.weight", matrix(q, h), qtype, rng)
        add_tensor(writer, p + "attn_k.weight", matrix(kv, h), qtype, rng)
        add_tensor(writer, p + "attn_v.weight", matrix(kv, h), qtype, rng)
        if arch == "qwen2":
            add_tensor(writer, p + "attn_q.bias", (0.1 * rng.standard_normal(q)).astype(np.float32), qtype)
            add_tensor(writer, p + "attn_k.bias", (0.1 * rng.standard_normal(kv)).astype(np.float32), qtype)
            add_tensor(writer, p + "attn_v.bias", (0.1 * rng.standard_normal(kv)).astype(np.float32), qtype)
        if arch == "qwen3":
            add_tensor(writer, p + "attn_q_norm.weight", norm(head_dim), qtype)
            add_tensor(writer, p + "attn_k_norm.weight", norm(head_dim), qtype)
        add_tensor(writer, p + "attn_output.weight", matrix(h, q), qtype, rng)
        add_tensor(writer, p + "ffn_norm.weight", norm(h), qtype)
        add_tensor(writer, p + "ffn_gate.weight", matrix(spec.intermediate_size, h), qtype, rng)
        add_tensor(writer, p + "ffn_up.weight", matrix(spec.intermediate_size, h), qtype, rng)
        add_tensor(writer, p + "ffn_down.weight", matrix(h, spec.intermediate_size), qtype, rng)
    add_tensor(writer, "output_norm.weight", norm(h), qtype)
    if not spec.tie_word_embeddings:
        add_tensor(writer, "output.weight", matrix(vocab, h, 4.0), embed_type, rng)
    return write_file(writer, path)


def k_quant_spec(qtype: GGMLQuantizationType, architecture: str = "llama") -> TinyModelSpec:
    """K-quant rows must be multiples of 256 elements."""
    return TinyModelSpec(
        architecture=architecture,
        tensor_type=qtype,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=512,
        head_dim=128 if architecture == "qwen3" else None,
    )


def qwen3_spec(qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> TinyModelSpec:
    """Qwen3's head_dim (128) is not hidden_size / num_heads, as in the real models."""
    return TinyModelSpec("qwen3", qtype, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=128, rope_theta=1e6)
