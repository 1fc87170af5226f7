"""`TritonOps` as a drop-in for `TorchOps`: same interface, same model outputs, under the interpreter."""

from __future__ import annotations

import inspect
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.kernels import triton_available  # noqa: E402
from executor_svc.kernels.triton_ops import TritonOps  # noqa: E402
from executor_svc.kv.kv_cache import KVCache  # noqa: E402
from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice  # noqa: E402
from executor_svc.model.torch_ops import TorchOps  # noqa: E402
from executor_svc.model.transformer import Transformer  # noqa: E402
from executor_svc.tools.random_model import model_config, random_weights  # noqa: E402

BLOCK_SIZE = 16
CPU = torch.device("cpu")


def test_triton_is_available_under_the_interpreter():
    assert triton_available()


def test_same_methods_and_parameters_as_torch_ops():
    public = [name for name in vars(TorchOps) if not name.startswith("_") and callable(getattr(TorchOps, name))]
    assert public
    for name in public:
        torch_params = list(inspect.signature(getattr(TorchOps, name)).parameters)
        triton_params = list(inspect.signature(getattr(TritonOps, name)).parameters)
        assert triton_params == torch_params, name


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["llama", "qwen3", "qwen2"])
def test_model_steps_match_torch_ops(variant):
    """Two steps of a tiny random model: prefills from empty KV, then a decode, a verify run and a chunk."""
    config = model_config(
        variant,
        num_layers=2,
        hidden_size=64,
        intermediate_size=96,
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=100,
        context_length=256,
        has_qk_norm=variant == "qwen3",
        has_qkv_bias=variant == "qwen2",
    )
    weights = random_weights(config, torch.float32, CPU, seed=0)
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 100, (n,), generator=gen).tolist() for n in (24, 9, 40)]
    tables = [[1, 2], [3], [4, 5, 6]]
    steps = [
        # (request, start position, number of tokens, number of logits)
        [(0, 0, 20, 1), (1, 0, 5, 1), (2, 0, 1, 1)],
        [(0, 20, 1, 1), (1, 5, 4, 4), (2, 1, 17, 0)],
    ]
    outputs = {}
    for ops in (TorchOps(), TritonOps(query_tile_tokens=4, kv_tile_keys=16)):
        model = Transformer(config, weights, CPU, ops=ops)
        kv_cache = KVCache(config, num_blocks=8, block_size=BLOCK_SIZE, dtype=torch.float32, device=CPU)
        logits = []
        for step in steps:
            slices = [RequestSlice(tokens[r][s : s + n], s, tables[r], k) for r, s, n, k in step]
            batch = RaggedBatch.build(slices, BLOCK_SIZE, CPU, row_multiple=4)
            logits.append(model.forward(batch, kv_cache))
        outputs[ops.name] = logits, kv_cache.tensor
    (torch_logits, torch_kv), (triton_logits, triton_kv) = outputs["torch"], outputs["triton"]
    for ours, ref in zip(triton_logits, torch_logits):
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(triton_kv, torch_kv, rtol=1e-5, atol=1e-5)
