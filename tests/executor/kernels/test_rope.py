"""The Triton RoPE against `TorchOps.rope`, in and out of place, under the interpreter."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.kernels.rope import apply_rope  # noqa: E402
from executor_svc.model.torch_ops import TorchOps  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]
# float32 and float16 round exactly where torch does. bfloat16 only up to the interpreter,
# which truncates float32 → bfloat16 instead of rounding to nearest even (the GPU rounds).
TOLERANCES = {
    torch.float32: dict(rtol=0, atol=0),
    torch.float16: dict(rtol=0, atol=0),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def tables(num_tokens, head_dim, gen):
    """cos/sin of real positions, float32 [T, head_dim // 2], as `rope_tables` builds them."""
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("num_heads,head_dim", [(3, 64), (2, 128), (5, 80)])
def test_matches_torch(dtype, num_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(7, num_heads, head_dim, generator=gen).to(dtype)
    cos, sin = tables(7, head_dim, gen)
    out = apply_rope(x, cos, sin)
    torch.testing.assert_close(out, TorchOps().rope(x, cos, sin), **TOLERANCES[dtype])


def test_in_place_on_a_strided_qkv_view():
    """q and k rotated where they sit in the fused QKV output; v and the other rows untouched."""
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_heads, num_kv_heads, head_dim = 6, 4, 2, 64
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen)
    cos, sin = tables(num_tokens, head_dim, gen)
    q = qkv[:, :q_size].view(-1, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(-1, num_kv_heads, head_dim)
    ref_q, ref_k = TorchOps().rope(q, cos, sin), TorchOps().rope(k, cos, sin)
    v_before = qkv[:, q_size + kv_size :].clone()
    assert apply_rope(q, cos, sin, out=q) is q
    apply_rope(k, cos, sin, out=k)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(qkv[:, q_size + kv_size :], v_before)


def test_out_of_place_leaves_x_alone():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 64, generator=gen)
    saved = x.clone()
    cos, sin = tables(3, 64, gen)
    out = apply_rope(x, cos, sin)
    assert out.is_contiguous() and out.data_ptr() != x.data_ptr()
    assert torch.equal(x, saved)


def test_rejects_bad_arguments():
    x = torch.randn(3, 2, 64)
    cos = torch.randn(3, 32)
    with pytest.raises(ValueError, match="cos shape"):
        apply_rope(x, cos[:2], cos)
    with pytest.raises(ValueError, match="even"):
        apply_rope(torch.randn(3, 2, 63), cos, cos)
    with pytest.raises(ValueError, match="out shape"):
        apply_rope(x, cos, cos, out=torch.empty(3, 1, 64))
    with pytest.raises(ValueError, match="stride"):
        apply_rope(x.transpose(1, 2).contiguous().transpose(1, 2), cos, cos)
