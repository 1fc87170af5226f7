"""The Triton SiLU·mul against `TorchOps.silu_mul`, under the interpreter."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.kernels.silu_mul import silu_mul  # noqa: E402
from executor_svc.model.torch_ops import TorchOps  # noqa: E402

# exp differs from torch's in the last bit; bfloat16 also meets the interpreter's truncating cast.
TOLERANCES = {
    torch.float32: dict(rtol=2e-6, atol=1e-6),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("intermediate", [1536, 100, 2500])  # one block, a partial block, several blocks
def test_matches_torch(dtype, intermediate):
    gen = torch.Generator().manual_seed(intermediate)
    gate_up = (4 * torch.randn(5, 2 * intermediate, generator=gen)).to(dtype)
    out = silu_mul(gate_up)
    ref = TorchOps().silu_mul(gate_up)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(100) is inf, as on a GPU
def test_extreme_gates_stay_finite():
    gate_up = torch.tensor([[-100.0, 100.0, 0.0, 2.0, 3.0, 4.0]])
    torch.testing.assert_close(silu_mul(gate_up), TorchOps().silu_mul(gate_up))


def test_a_row_strided_view_and_bad_arguments():
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(4, 300, generator=gen)
    gate_up = wide[:, :200]  # row stride 300
    torch.testing.assert_close(silu_mul(gate_up), TorchOps().silu_mul(gate_up), **TOLERANCES[torch.float32])
    with pytest.raises(ValueError, match="odd"):
        silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="stride"):
        silu_mul(torch.randn(8, 4).t())
