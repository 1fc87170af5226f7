"""ModelRunner: the start-up choices (device, dtype, matmul, kernels), the model and KV cache it sets
up on a tiny GGUF, a step's prepare and forward on them, and calibration's timed scratch steps."""

from __future__ import annotations

import pytest
import torch

from executor_svc.config import EngineConfig
from executor_svc.cpu_kernels import load
from executor_svc.engine.model_runner import (
    ModelRunner,
    preferred_step_tokens,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
    resolve_matmul,
    resolve_ops,
)
from executor_svc.kv.kv_cache import bytes_per_block
from executor_svc.model.cpu_ops import CpuOps, attention_on_tiles
from executor_svc.model.ragged_batch import RequestSlice
from executor_svc.weights.weight_format import has_int8_dot, has_int16_dot
from tests.support.tiny_gguf import TinyModelSpec

CPU = torch.device("cpu")
GPU = torch.device("cuda")  # only named here: nothing runs on it
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts what happens without a GPU")


@pytest.fixture(scope="module")
def runner(tiny_gguf_path):
    return ModelRunner(EngineConfig(model=str(tiny_gguf_path(TinyModelSpec())), kv_cache_bytes=4 << 20))


# ------------------------------------------------------------ start-up choices


@no_gpu
def test_auto_picks_the_cpu_without_a_gpu_and_a_gpu_asked_for_is_a_clear_error():
    assert resolve_device("auto") == CPU
    with pytest.raises(ValueError, match="'cuda' asked for, but torch sees no CUDA/ROCm device"):
        resolve_device("cuda")


def test_auto_dtype_is_bfloat16_on_a_gpu_and_float32_on_the_cpu():
    assert resolve_dtype("auto", GPU) is torch.bfloat16
    assert resolve_dtype("auto", CPU) is torch.float32
    assert resolve_dtype("bfloat16", CPU) is torch.bfloat16


def test_auto_matmul_is_int16_only_with_the_cpu_kernels_and_never_in_the_float32_reference():
    assert resolve_matmul("auto", "auto", CPU, "cpu") == ("int16" if has_int16_dot() else "exact")
    assert resolve_matmul("auto", "float32", CPU, "cpu") == "exact"
    assert resolve_matmul("auto", "auto", CPU, "torch") == "exact"
    assert resolve_matmul("auto", "auto", GPU, "auto") == "exact"
    assert resolve_matmul("exact", "auto", GPU, "triton") == "exact"


def test_auto_kv_cache_is_float16_only_on_the_cpus_default_path():
    from executor_svc.model.torch_ops import TorchOps

    assert resolve_kv_cache_dtype("auto", torch.float32, CpuOps, "int16", 64) == torch.float16
    assert resolve_kv_cache_dtype("auto", torch.float32, CpuOps, "int8", 64) == torch.float16
    kernels = load()
    if attention_on_tiles(64):  # an AMX CPU: --matmul bf16's attention on the tiles, over a bfloat16 cache
        assert resolve_kv_cache_dtype("auto", torch.float32, CpuOps, "bf16", 64) == torch.bfloat16
        # heads the tiles do not take would get its slower bfloat16 dot products: float16 stays
        assert resolve_kv_cache_dtype("auto", torch.float32, CpuOps, "bf16", 128) == torch.float16
    elif kernels.has_bf16_dot_products():  # Zen 4: VDPBF16PS attention beats the float16 cache's kernel
        for head_dim in (64, 128):
            assert resolve_kv_cache_dtype("auto", torch.float32, CpuOps, "bf16", head_dim) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32, CpuOps, "exact", 64) == torch.float32  # --dtype float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, CpuOps, "exact", 64) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32, TorchOps, "exact", 64) == torch.float32
    assert resolve_kv_cache_dtype("float32", torch.float32, CpuOps, "int16", 64) == torch.float32
    with pytest.raises(ValueError, match=r"only the C\+\+ CPU kernels"):
        resolve_kv_cache_dtype("float16", torch.float32, TorchOps, "exact", 64)


def test_a_matmul_the_kernels_cannot_run_is_refused():
    for matmul in ("int16", "int8", "bf16"):
        with pytest.raises(ValueError, match=f"--matmul {matmul} runs with the C\\+\\+ CPU kernels"):
            resolve_matmul(matmul, "auto", CPU, "torch")
    with pytest.raises(ValueError, match="matmul must be one of"):
        resolve_matmul("int4", "auto", CPU, "cpu")


def test_int8_is_taken_only_when_asked_for_and_the_cpu_has_avx512_vnni(monkeypatch):
    """`auto` never picks int8 (its top-1 agreement is below the bar); asked for, it runs where the
    kernel build has it and is refused by name, with the way out, where it has not."""
    import executor_svc.weights.weight_format as weight_format

    assert resolve_matmul("auto", "auto", CPU, "cpu") != "int8"
    if has_int8_dot():
        assert resolve_matmul("int8", "auto", CPU, "cpu") == "int8"
    monkeypatch.setattr(weight_format, "has_int8_dot", lambda: False)  # a CPU without AVX512-VNNI
    with pytest.raises(ValueError, match="--matmul int8 needs a CPU with AVX512-VNNI .* use --matmul int16"):
        resolve_matmul("int8", "auto", CPU, "cpu")


def test_the_step_size_it_prefers_follows_its_matmul():
    """`--matmul bf16`'s prompt chunks are fast enough that a step's fixed costs weigh: 1,024 tokens a
    step; the others 256 (longer steps made the swarm's TTFT worse there)."""
    assert preferred_step_tokens("bf16") == 1024
    assert preferred_step_tokens("int16") == preferred_step_tokens("int8") == preferred_step_tokens("exact") == 256


def test_bf16_is_taken_only_when_asked_for_and_the_cpu_has_avx512_bf16(monkeypatch):
    """`auto` never picks bf16 (decodes are slower, and it is not the exact-integer path); asked for,
    it runs where AVX512-BF16 is (the AMX tiles or VDPBF16PS) and is refused by name, with the way
    out, where it is not."""
    import executor_svc.weights.weight_format as weight_format

    assert resolve_matmul("auto", "auto", CPU, "cpu") != "bf16"
    if weight_format.has_bf16_dot():
        assert resolve_matmul("bf16", "auto", CPU, "cpu") == "bf16"
    monkeypatch.setattr(weight_format, "has_bf16_dot", lambda: False)  # a CPU without AVX512-BF16
    assert not weight_format.has_matmul("bf16") and weight_format.has_matmul("exact")
    with pytest.raises(ValueError, match="--matmul bf16 needs AVX512-BF16 .* use --matmul int16"):
        resolve_matmul("bf16", "auto", CPU, "cpu")


def test_the_cpp_kernels_asked_for_on_a_gpu_are_refused():
    # (which kernels `auto` and `torch` pick: tests/executor/kernels/test_kernels_engine.py)
    with pytest.raises(ValueError, match="kernels='cpu' runs on the CPU"):
        resolve_ops("cpu", GPU)


# ---------------------------------------------------------------- the runner


@no_gpu
def test_the_runner_loads_the_model_and_sizes_its_kv_cache_within_the_budget(runner):
    assert (runner.device, runner.dtype) == (CPU, torch.float32)
    assert isinstance(runner.ops, CpuOps)
    assert runner.model_config.num_layers == TinyModelSpec().num_layers
    assert runner.tokenizer.eos_token_ids
    assert runner.weight_bytes == runner.model.weights.num_bytes > 0
    per_block = bytes_per_block(runner.model_config, runner.kv.block_size, runner.kv_dtype)
    assert 0 < runner.kv.num_usable_blocks * per_block <= 4 << 20
    assert runner.decode_graphs is None  # graphs are captured on a GPU only


def test_packed_cpu_weights_need_no_row_padding_even_batch_invariant(runner):
    """On the CPU every matmul weight stays packed (F32 too), and its kernels are row-invariant by
    construction: a batch-invariant step is not padded to a row multiple."""
    assert runner.config.batch_invariant and runner.model.weights.is_packed
    with runner.kv.scratch(1, 3) as [(block_ids, slot)]:
        batch = runner.prepare([RequestSlice([5, 6, 7], 0, block_ids, 1, slot)])
    assert (batch.num_tokens, batch.num_padded_tokens) == (3, 3)


def test_forward_gives_one_logits_row_per_sampled_position(runner):
    with runner.kv.scratch(2, 8) as held:
        (prefill_blocks, s0), (verify_blocks, s1) = held
        # a prompt's last chunk (one row), and a decode verifying two drafts (three rows)
        pieces = [RequestSlice([3, 4, 5], 0, prefill_blocks, 1, s0), RequestSlice([8, 9, 10], 4, verify_blocks, 3, s1)]
        logits = runner.forward(runner.prepare(pieces))
    assert logits.shape == (4, runner.model_config.vocab_size)


def test_forward_reads_back_the_kv_it_wrote(runner):
    """A prompt computed in two chunks (the second attending to the first's KV in the runner's
    cache) gives the logits of computing it in one pass."""
    prompt = [11, 12, 13, 14, 15, 16, 17]
    with runner.kv.scratch(1, len(prompt)) as [(block_ids, slot)]:
        whole = runner.forward(runner.prepare([RequestSlice(prompt, 0, block_ids, 1, slot)]))
    with runner.kv.scratch(1, len(prompt)) as [(block_ids, slot)]:
        runner.forward(runner.prepare([RequestSlice(prompt[:4], 0, block_ids, 0, slot)]))
        chunked = runner.forward(runner.prepare([RequestSlice(prompt[4:], 4, block_ids, 1, slot)]))
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------- calibration


def test_time_step_times_scratch_requests_and_gives_their_kv_back(runner):
    num_free = runner.kv.num_free_blocks
    sample = runner.time_step(context_len=16, num_tokens=4, num_logits=4, num_requests=2, reps=2)
    # Each request's 4 rows after 16 cached tokens attend 17 + 18 + 19 + 20 = 74 keys.
    assert (sample.num_tokens, sample.num_attention_pairs, sample.num_logits_rows, sample.num_requests) == (
        8,
        148,
        8,
        2,
    )
    assert 0 < sample.forward_s <= sample.step_s
    assert runner.kv.num_free_blocks == num_free


def test_time_step_is_none_when_the_scratch_requests_do_not_fit(runner):
    assert runner.time_step(0, 1, 1, num_requests=runner.kv.num_usable_blocks + 1) is None


def test_calibration_samples_every_shape_of_the_grid(runner):
    samples = runner.calibrate(token_counts=(1, 4), context_lens=(0, 32), batch_sizes=(2,))
    shapes = [(s.num_tokens, s.num_attention_pairs, s.num_logits_rows, s.num_requests) for s in samples]
    # per context: T tokens with one logits row, B decodes, one request verifying T − 1 drafts;
    # the attention pairs of 4 rows after 32 cached tokens: 33 + 34 + 35 + 36 = 138
    assert shapes == [
        (1, 1, 1, 1), (4, 10, 1, 1), (2, 2, 2, 2), (4, 10, 4, 1),
        (1, 33, 1, 1), (4, 138, 1, 1), (2, 66, 2, 2), (4, 138, 4, 1),
    ]  # fmt: skip
    assert all(s.forward_s > 0 for s in samples)
