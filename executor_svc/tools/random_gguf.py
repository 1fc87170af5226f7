"""GGUF files of random weights at a real model's shape, for serving a model nobody has to download.

`write_random_gguf(path, QWEN3_8B)` writes what `swarmserve serve --model path` loads: every
tensor under llama.cpp's name and in the type llama.cpp's Q4_K_M rule gives it (Q4_K, with
Q6_K for `attn_v` and `ffn_down` in the layers `use_more_bits` picks, and for `output`; the
tiny --dry-run shapes are Q8_0 throughout), the architecture's metadata, a byte-level BPE
tokenizer padded to the model's vocabulary and a ChatML template. The weights are `random_model.random_gguf_rows` (activations stay O(1)
through any number of layers), so the bytes a step streams, the kernels' shapes and the KV and
state sizes are the real model's, and greedy decoding is a meaningful comparison between two
implementations on the same file; the text is noise.

Tensors are generated and written one at a time: a 5 GB file never sits in memory whole.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from executor_svc.tools.random_model import random_gguf_rows

Q8_0, Q4_K, Q6_K = 8, 12, 14  # GGML type ids
QUANTS = ("Q4_K_M", "Q8_0")  # llama.cpp's mix, or one type everywhere (what the interpreter runs fast)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN_ID, EOS_TOKEN_ID = 1, 2
MERGES = ("Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s")
CHATML_TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)
LM_HEAD_SCALE = 4.0  # logits ~ N(0, 16): the top two of 150K tokens are ~0.8 apart, not a near-tie each step


@dataclass(frozen=True)
class GgufShape:
    """A model's shape as its config.json gives it; `full_attention_interval` > 0 makes it a
    Qwen3.5 hybrid (every interval-th layer full attention, gated; the others Gated DeltaNet)."""

    name: str
    architecture: str  # qwen3 | qwen35
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rope_theta: float = 1e6
    full_attention_interval: int = 0
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_head_dim: int = 0
    conv_kernel: int = 4
    partial_rotary_factor: float = 1.0
    quant: str = "Q4_K_M"

    def __post_init__(self) -> None:
        if self.quant not in QUANTS:
            raise ValueError(f"quant must be one of {QUANTS}, got {self.quant!r}")
        if self.architecture not in ("qwen3", "qwen35"):
            raise ValueError(f"architecture must be qwen3 or qwen35, got {self.architecture!r}")
        if (self.architecture == "qwen35") != (self.full_attention_interval > 0):
            raise ValueError("a qwen35 shape has a full_attention_interval, a qwen3 one none")
        if self.vocab_size < len(SPECIAL_TOKENS) + 256 + len(MERGES):
            raise ValueError(f"vocab_size {self.vocab_size} is smaller than the tokenizer's base vocabulary")
        block = 256 if self.quant == "Q4_K_M" else 32
        for cols in (self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim, self.value_dim):
            if cols % block:
                raise ValueError(f"{self.quant} rows are whole {block}-value blocks; {self.name} has a row of {cols}")

    @property
    def is_hybrid(self) -> bool:
        return self.full_attention_interval > 0

    @property
    def value_dim(self) -> int:
        return self.linear_value_heads * self.linear_head_dim if self.is_hybrid else self.hidden_size

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_heads * self.linear_head_dim + self.value_dim

    def is_recurrent(self, layer: int) -> bool:
        return self.is_hybrid and (layer + 1) % self.full_attention_interval != 0


# Qwen/Qwen3-8B's config.json.
QWEN3_8B = GgufShape(
    name="qwen3-8b",
    architecture="qwen3",
    num_layers=36,
    hidden_size=4096,
    intermediate_size=12288,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=151936,
    context_length=40960,
)
# Qwen3.5-9B's text model: 32 layers, every 4th full (gated) attention with 16 query and 4 KV heads
# of 256 and RoPE on the first quarter; the rest Gated DeltaNet with 16 key / 32 value heads of 128.
QWEN35_9B = GgufShape(
    name="qwen35-9b",
    architecture="qwen35",
    num_layers=32,
    hidden_size=4096,
    intermediate_size=12288,
    num_heads=16,
    num_kv_heads=4,
    head_dim=256,
    vocab_size=248320,
    context_length=262144,
    rope_theta=1e7,
    full_attention_interval=4,
    linear_key_heads=16,
    linear_value_heads=32,
    linear_head_dim=128,
    partial_rotary_factor=0.25,
)
# The same architectures, tiny and in Q8_0 (the interpreter runs a K-quant matmul ~10x slower), for --dry-run.
TINY_QWEN3 = GgufShape(
    name="tiny-qwen3",
    architecture="qwen3",
    num_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    vocab_size=320,
    context_length=1024,
    quant="Q8_0",
)
TINY_QWEN35 = GgufShape(
    name="tiny-qwen35",
    architecture="qwen35",
    num_layers=4,
    hidden_size=64,
    intermediate_size=128,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    vocab_size=320,
    context_length=1024,
    full_attention_interval=4,
    linear_key_heads=1,
    linear_value_heads=2,
    linear_head_dim=16,
    partial_rotary_factor=0.25,
    quant="Q8_0",
)


def uses_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order: [rows, cols]
    tensor_type: int | None  # a GGML type of random rows; None: float32 values from `values`
    values: Callable[[], np.ndarray] | None = None
    scale: float = 1.0


def _tensors(shape: GgufShape, rng: np.random.Generator) -> Iterator[_Tensor]:
    """Every tensor of the model in file order, with its type and how to make its values."""
    h, d = shape.hidden_size, shape.head_dim
    base, more_bits_type, head_type = (Q4_K, Q6_K, Q6_K) if shape.quant == "Q4_K_M" else (Q8_0, Q8_0, Q8_0)

    def norm(name: str, n: int) -> _Tensor:
        return _Tensor(name, (n,), None, lambda: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    def uniform(name: str, n: int, low: float, high: float) -> _Tensor:
        return _Tensor(name, (n,), None, lambda: rng.uniform(low, high, n).astype(np.float32))

    yield _Tensor("token_embd.weight", (shape.vocab_size, h), base)
    for i in range(shape.num_layers):
        p = f"blk.{i}."
        more_bits = more_bits_type if uses_more_bits(i, shape.num_layers) else base
        yield norm(p + "attn_norm.weight", h)
        if shape.is_recurrent(i):
            heads, key_dim = shape.linear_value_heads, shape.linear_key_heads * shape.linear_head_dim
            conv_dim = 2 * key_dim + shape.value_dim
            yield _Tensor(p + "attn_qkv.weight", (conv_dim, h), base)
            yield _Tensor(p + "attn_gate.weight", (shape.value_dim, h), base)
            yield _Tensor(p + "ssm_beta.weight", (heads, h), base)
            yield _Tensor(p + "ssm_alpha.weight", (heads, h), base)
            conv = (conv_dim, shape.conv_kernel)
            yield _Tensor(p + "ssm_conv1d.weight", conv, None, lambda: (0.5 * rng.standard_normal(conv)).astype("f4"))
            yield uniform(p + "ssm_dt.bias", heads, -1.0, 1.0)
            yield uniform(p + "ssm_a", heads, -8.0, -0.5)  # -exp(A_log): every head decays
            yield norm(p + "ssm_norm.weight", shape.linear_head_dim)
            yield _Tensor(p + "ssm_out.weight", (h, shape.value_dim), base)
        else:
            q_rows = shape.num_heads * d
            yield _Tensor(p + "attn_q.weight", (2 * q_rows if shape.is_hybrid else q_rows, h), base)
            yield _Tensor(p + "attn_k.weight", (shape.num_kv_heads * d, h), base)
            yield _Tensor(p + "attn_v.weight", (shape.num_kv_heads * d, h), more_bits)
            yield norm(p + "attn_q_norm.weight", d)
            yield norm(p + "attn_k_norm.weight", d)
            yield _Tensor(p + "attn_output.weight", (h, q_rows), base)
        yield norm(p + ("post_attention_norm" if shape.is_hybrid else "ffn_norm") + ".weight", h)
        yield _Tensor(p + "ffn_gate.weight", (shape.intermediate_size, h), base)
        yield _Tensor(p + "ffn_up.weight", (shape.intermediate_size, h), base)
        yield _Tensor(p + "ffn_down.weight", (h, shape.intermediate_size), more_bits)
    yield norm("output_norm.weight", h)
    yield _Tensor("output.weight", (shape.vocab_size, h), head_type, scale=LM_HEAD_SCALE)


def vocabulary(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): the control tokens, GPT-2's 256 byte characters, one token
    per merge, then fillers (`x<n>`, never produced by encoding, decoded as their letters) up to
    `vocab_size`, so every id the model can emit has a text."""
    from gguf import TokenType

    byte_chars = _byte_alphabet()
    tokens = [*SPECIAL_TOKENS, *byte_chars, *(m.replace(" ", "") for m in MERGES)]
    tokens += [f"x{n}" for n in range(vocab_size - len(tokens))]
    types = [int(TokenType.CONTROL)] * len(SPECIAL_TOKENS) + [int(TokenType.NORMAL)] * (
        vocab_size - len(SPECIAL_TOKENS)
    )
    return tokens, types, list(MERGES)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _add_metadata(writer, shape: GgufShape) -> None:
    arch = shape.architecture
    tokens, types, merges = vocabulary(shape.vocab_size)
    writer.add_name(f"random-{shape.name}")
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(int(shape.head_dim * shape.partial_rotary_factor))
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(shape.vocab_size)
    if arch == "qwen35":
        writer.add_ssm_conv_kernel(shape.conv_kernel)
        writer.add_ssm_state_size(shape.linear_head_dim)
        writer.add_ssm_group_count(shape.linear_key_heads)
        writer.add_ssm_time_step_rank(shape.linear_value_heads)
        writer.add_ssm_inner_size(shape.value_dim)
        writer.add_full_attention_interval(shape.full_attention_interval)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_TOKEN_ID)
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def write_random_gguf(path: Path, shape: GgufShape, seed: int = 0, device: torch.device | None = None) -> Path:
    """Write the model (see the module docstring) to `path`; random rows are drawn on `device`
    (a GPU draws 5 GB in well under a second) and copied out tensor by tensor."""
    from gguf import GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    device = device or torch.device("cpu")
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = list(_tensors(shape, rng))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(path.suffix + ".partial")  # a cut-short write never passes for a model
    writer = GGUFWriter(str(partial), shape.architecture)
    _add_metadata(writer, shape)
    for t in tensors:
        if t.tensor_type is None:
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), 4 * int(np.prod(t.shape)))
        else:
            block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.tensor_type)]
            rows, cols = t.shape
            byte_shape = (rows, cols // block_elems * block_bytes)
            writer.add_tensor_info(
                t.name, byte_shape, np.dtype(np.uint8), rows * byte_shape[1], GGMLQuantizationType(t.tensor_type)
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors:
        if t.tensor_type is None:
            writer.write_tensor_data(t.values())
        else:
            rows, cols = t.shape
            writer.write_tensor_data(random_gguf_rows(rows, cols, t.tensor_type, gen, device, t.scale).cpu().numpy())
    writer.close()
    partial.replace(path)
    return path


WRITER_VERSION = 1  # bump when what write_random_gguf writes changes: the cached files' names change with it


def model_file_name(shape: GgufShape, seed: int) -> str:
    """A file name that changes with everything the file's bytes depend on (to reuse a file written before)."""
    digest = hashlib.blake2b(repr((shape, seed, WRITER_VERSION)).encode(), digest_size=4).hexdigest()
    return f"random-{shape.name}-{shape.quant}-{digest}.gguf"


def gguf_file_bytes(shape: GgufShape) -> int:
    """The tensor bytes `write_random_gguf` writes for `shape` (the file is this plus metadata)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    total = 0
    for t in _tensors(shape, np.random.default_rng(0)):
        if t.tensor_type is None:
            total += 4 * int(np.prod(t.shape))
        else:
            block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.tensor_type)]
            total += t.shape[0] * t.shape[1] // block_elems * block_bytes
    return total
