"""The Triton RMSNorm and fused residual-add RMSNorm against `TorchOps`, under the interpreter."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.kernels.rms_norm import add_rms_norm, rms_norm  # noqa: E402
from executor_svc.model.torch_ops import TorchOps  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]
# Half precision: the mean of squares sums in another order, which may move a result by one ulp.
# bfloat16 allows two more: triton's interpreter truncates float32 → bfloat16 where the GPU
# (and torch) round to nearest even, and this kernel rounds twice, as the reference does.
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=2.4e-2, atol=2.4e-2),
}
RESIDUAL_TOLERANCES = {  # one rounding of an exact float32 sum
    torch.float32: dict(rtol=0, atol=0),
    torch.float16: dict(rtol=0, atol=0),
    torch.bfloat16: dict(rtol=8e-3, atol=0),
}
EPS = 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("hidden", [576, 64, 1000])
def test_rms_norm_matches_torch(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = (3 * torch.randn(7, hidden, generator=gen)).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    out = rms_norm(x, weight, EPS)
    ref = TorchOps().rms_norm(x, weight, EPS)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_per_head_norm_of_a_strided_qkv_view(dtype):
    """qwen3's q/k norm: rows of head_dim read straight out of the fused QKV output."""
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 4, 2, 64
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    weight = torch.randn(head_dim, generator=gen).to(dtype)
    torch.testing.assert_close(rms_norm(q, weight, EPS), TorchOps().rms_norm(q, weight, EPS), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_add_rms_norm_matches_torch(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 576, generator=gen).to(dtype)
    residual = (4 * torch.randn(9, 576, generator=gen)).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    normed, new_residual = add_rms_norm(x, residual, weight, EPS)
    ref_normed, ref_residual = TorchOps().add_rms_norm(x, residual, weight, EPS)
    torch.testing.assert_close(new_residual, ref_residual, **RESIDUAL_TOLERANCES[dtype])
    assert normed.dtype == ref_normed.dtype
    torch.testing.assert_close(normed, ref_normed, **TOLERANCES[dtype])


def test_float32_weight_promotes_like_torch():
    x = torch.randn(3, 64).bfloat16()
    weight = torch.rand(64)
    out = rms_norm(x, weight, EPS)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, TorchOps().rms_norm(x, weight, EPS), **TOLERANCES[torch.bfloat16])


def test_inputs_are_not_modified_and_empty_input_is_fine():
    x = torch.randn(4, 64)
    residual = torch.randn(4, 64)
    saved = x.clone(), residual.clone()
    add_rms_norm(x, residual, torch.ones(64), EPS)
    assert torch.equal(x, saved[0]) and torch.equal(residual, saved[1])
    assert rms_norm(torch.empty(0, 64), torch.ones(64), EPS).shape == (0, 64)


def test_rejects_bad_arguments():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="weight has"):
        rms_norm(x, torch.ones(32), EPS)
    with pytest.raises(ValueError, match="stride"):
        rms_norm(x.t(), torch.ones(4), EPS)
    with pytest.raises(ValueError, match="residual shape"):
        add_rms_norm(x, torch.randn(4, 32), torch.ones(64), EPS)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x.double(), torch.ones(64), EPS)
