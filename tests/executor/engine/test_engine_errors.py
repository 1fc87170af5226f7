"""Bad input: each a clear exception naming the problem; the engine keeps serving."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from executor_svc.engine.engine import Engine, EngineConfig, ScheduledRequest, StepRequest
from executor_svc.engine.request_state import FinishReason, NewRequest
from executor_svc.errors import ModelLoadError, OutOfKVBlocksError, UnknownRequestError
from service_common.errors import InvalidRequestError
from service_common.sampling_params import SamplingParams
from tests.support.engine_driver import drive
from tests.support.tiny_gguf import TinyModelSpec

PROMPT = [40, 41, 42, 43, 44, 45]


@pytest.fixture(scope="module")
def tiny_path(tiny_gguf_path):
    return tiny_gguf_path(TinyModelSpec(context_length=64))


@pytest.fixture(scope="module")
def tiny_path_256(tiny_gguf_path):
    return tiny_gguf_path(TinyModelSpec(context_length=256))


@pytest.fixture()
def engine(tiny_path):
    return Engine(EngineConfig(model=str(tiny_path), kv_cache_bytes=1 << 20))


def assert_still_serves(engine):
    run = drive(engine, [NewRequest("after-error", PROMPT, max_new_tokens=3, ignore_eos=True)])
    assert len(run.tokens["after-error"]) == 3


# ------------------------------------------------------------------ model files


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="model file not found"):
        Engine(EngineConfig(model=str(tmp_path / "nope.gguf")))


def test_wrong_magic(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="not a GGUF file: it starts with b'GGML'"):
        Engine(EngineConfig(model=str(path)))


@pytest.mark.parametrize("keep", [8, 200, 0.5, -1])
def test_truncated_file(tmp_path, tiny_path, keep):
    data = tiny_path.read_bytes()
    cut = keep if isinstance(keep, int) and keep > 0 else int(len(data) * keep) if keep > 0 else len(data) - 1
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    with pytest.raises(ModelLoadError, match="truncated|not a readable GGUF"):
        Engine(EngineConfig(model=str(path)))


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "falcon.gguf"
    writer = GGUFWriter(str(path), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="architecture 'falcon' is not supported"):
        Engine(EngineConfig(model=str(path)))


def test_unsupported_tensor_type(tmp_path):
    from gguf import quants

    path = tmp_path / "q5.gguf"
    writer = GGUFWriter(str(path), "llama")
    data = quants.quantize(np.zeros((4, 32), dtype=np.float32), GGMLQuantizationType.Q5_0)
    writer.add_tensor("token_embd.weight", data, raw_dtype=GGMLQuantizationType.Q5_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="'token_embd.weight' has type Q5_0, which is not supported"):
        Engine(EngineConfig(model=str(path)))


# --------------------------------------------------------------------- requests


def test_prompt_longer_than_context(engine):
    with pytest.raises(
        InvalidRequestError,
        match=r"request 'long': the prompt is 64 tokens; the model's context is 64 tokens, which leaves no room to generate",
    ):
        engine.add_request(NewRequest("long", [40] * 64))
    assert_still_serves(engine)


def test_token_ids_outside_vocabulary(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(
        InvalidRequestError, match=rf"the prompt's token ids \[{vocab}, -1\] are outside the vocabulary \[0, {vocab}\)"
    ):
        engine.add_request(NewRequest("bad", [40, vocab, -1]))
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        engine.add_request(NewRequest("bad", [40], stop_token_ids=frozenset({vocab + 5})))
    assert not engine.has_request("bad")
    assert_still_serves(engine)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"num_logprobs": 100}, "num_logprobs"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(InvalidRequestError, match=rf"^sampling\.{field} must be"):
        SamplingParams(**kwargs)


def test_empty_prompt_duplicate_id_and_bad_max_new_tokens(engine):
    with pytest.raises(InvalidRequestError, match="request 'e': the prompt is empty"):
        engine.add_request(NewRequest("e", []))
    with pytest.raises(InvalidRequestError, match="max_new_tokens must be > 0"):
        engine.add_request(NewRequest("e", PROMPT, max_new_tokens=0))
    engine.add_request(NewRequest("dup", PROMPT))
    with pytest.raises(InvalidRequestError, match="'dup' is already in flight"):
        engine.add_request(NewRequest("dup", PROMPT))
    engine.release("dup")
    assert_still_serves(engine)


@pytest.mark.parametrize("retention_s", [float("inf"), float("nan"), -1.0])
def test_retention_must_be_finite(engine, retention_s):
    """Issue 12, item 8: an infinite retention would hold a session's blocks forever."""
    with pytest.raises(InvalidRequestError, match="retention_s must be a finite number >= 0"):
        engine.add_request(NewRequest("r", PROMPT, session_id="s", retention_s=retention_s))
    assert_still_serves(engine)


def test_plan_naming_unknown_request_changes_nothing(engine):
    engine.add_request(NewRequest("known", PROMPT, max_new_tokens=2, ignore_eos=True))
    free_before = engine.kv.num_free_blocks
    with pytest.raises(UnknownRequestError, match="unknown request id 'ghost'"):
        engine.step(StepRequest(scheduled=[ScheduledRequest("known", 6), ScheduledRequest("ghost", 1)]))
    with pytest.raises(UnknownRequestError, match="cannot preempt unknown request id 'ghost'"):
        engine.step(StepRequest(preempted=["ghost"]))
    assert engine.kv.num_free_blocks == free_before
    assert engine.get_request("known").num_computed_tokens == 0
    out = engine.step(StepRequest(scheduled=[ScheduledRequest("known", 6)]))
    assert len(out.outputs[0].new_token_ids) == 1


def test_plan_computing_more_tokens_than_known(engine):
    engine.add_request(NewRequest("r", PROMPT))
    with pytest.raises(InvalidRequestError, match="cannot compute 7 tokens, only 6 are not yet in KV"):
        engine.step(StepRequest(scheduled=[ScheduledRequest("r", 7)]))
    with pytest.raises(InvalidRequestError, match="num_tokens must be > 0"):
        engine.step(StepRequest(scheduled=[ScheduledRequest("r", 0)]))
    with pytest.raises(InvalidRequestError, match="scheduled twice"):
        engine.step(StepRequest(scheduled=[ScheduledRequest("r", 1), ScheduledRequest("r", 1)]))
    assert_still_serves(engine)


def test_out_of_kv_blocks_computes_nothing(tiny_path):
    # 4 usable blocks of 16 tokens.
    from executor_svc.kv.kv_cache import bytes_per_block

    probe = Engine(EngineConfig(model=str(tiny_path), kv_cache_bytes=1 << 20))
    per_block = bytes_per_block(probe.model_config, 16, probe.model_runner.kv_dtype)
    engine = Engine(EngineConfig(model=str(tiny_path), kv_cache_bytes=5 * per_block))
    assert engine.kv.num_usable_blocks == 4
    engine.add_request(NewRequest("a", [40] * 40))
    engine.add_request(NewRequest("b", [41] * 40))
    with pytest.raises(OutOfKVBlocksError, match="needs 6 new KV blocks but only 4 are free"):
        engine.step(StepRequest(scheduled=[ScheduledRequest("a", 40), ScheduledRequest("b", 40)]))
    assert engine.kv.num_free_blocks == 4
    # All or nothing: a refused plan does not even add its new requests.
    with pytest.raises(OutOfKVBlocksError):
        engine.step(
            StepRequest(
                new_requests=[NewRequest("c", [42] * 50)],
                scheduled=[ScheduledRequest("c", 50), ScheduledRequest("a", 40)],
            )
        )
    assert not engine.has_request("c")
    out = engine.step(StepRequest(scheduled=[ScheduledRequest("a", 40)]))
    assert out.outputs[0].num_computed_tokens == 40 and out.num_free_blocks == 1


# ------------------------------------------------------------ finish and preempt


def test_finish_reasons(engine):
    greedy = drive(engine, [NewRequest("probe", PROMPT, max_new_tokens=6, ignore_eos=True)]).tokens["probe"]
    stop_at = greedy[3]
    run = drive(
        engine, [NewRequest("stop", PROMPT, max_new_tokens=6, stop_token_ids=frozenset({stop_at}), ignore_eos=True)]
    )
    assert run.tokens["stop"] == greedy[: greedy.index(stop_at) + 1]
    assert run.finish_reasons["stop"] == FinishReason.STOP_TOKEN
    # EOS ends a request unless ignore_eos; pretend the first sampled token is EOS.
    eos_engine_ids = engine.eos_token_ids
    engine.eos_token_ids = frozenset({greedy[0]})
    try:
        assert drive(engine, [NewRequest("eos", PROMPT, max_new_tokens=6)]).finish_reasons["eos"] == FinishReason.EOS
        kept = drive(engine, [NewRequest("keep", PROMPT, max_new_tokens=6, ignore_eos=True)])
        assert kept.tokens["keep"] == greedy and kept.finish_reasons["keep"] == FinishReason.LENGTH
    finally:
        engine.eos_token_ids = eos_engine_ids
    # The context (64) fills up before max_new_tokens.
    full = drive(engine, [NewRequest("full", [40] * 60, max_new_tokens=50, ignore_eos=True)])
    assert full.finish_reasons["full"] == FinishReason.CONTEXT_FULL and len(full.tokens["full"]) == 4
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=7)])
def test_preempt_and_recompute_gives_the_same_tokens(engine, sampling):
    expected = drive(engine, [NewRequest("x", PROMPT, sampling, max_new_tokens=10, ignore_eos=True)]).tokens["x"]
    engine.add_request(NewRequest("y", PROMPT, sampling, max_new_tokens=10, ignore_eos=True))
    tokens = engine.step(StepRequest(scheduled=[ScheduledRequest("y", len(PROMPT))])).outputs[0].new_token_ids
    for _ in range(4):
        tokens += engine.step(StepRequest(scheduled=[ScheduledRequest("y", 1)])).outputs[0].new_token_ids
    engine.step(StepRequest(preempted=["y"]))
    state = engine.get_request("y")
    assert state.num_computed_tokens == 0 and engine.kv.block_ids(state.request_id) == []
    # Recompute prompt + output in chunks of 4, then keep decoding.
    while True:
        pending = state.num_pending_tokens
        out = engine.step(StepRequest(scheduled=[ScheduledRequest("y", min(4, pending))])).outputs[0]
        tokens += out.new_token_ids
        if out.finish_reason:
            break
    assert tokens == expected


# ------------------------------------------------- validated before anything changes (item 9)


def test_an_id_both_released_and_preempted_is_refused_with_nothing_changed(engine):
    engine.add_request(NewRequest("twice", PROMPT, max_new_tokens=4, ignore_eos=True))
    engine.step(StepRequest(scheduled=[ScheduledRequest("twice", len(PROMPT))]))
    free = engine.kv.num_free_blocks
    for released, preempted in ((["twice"], ["twice"]), (["twice", "twice"], []), ([], ["twice", "twice"])):
        with pytest.raises(InvalidRequestError, match="listed more than once"):
            engine.step(StepRequest(released=released, preempted=preempted))
        assert engine.has_request("twice") and engine.kv.num_free_blocks == free
    engine.release("twice")
    assert_still_serves(engine)


def test_a_prefix_hit_on_blocks_the_same_plan_releases_is_counted_before_anything_changes(tiny_path_256):
    """The released request's cached blocks count as freed and, reused by the hit, as taken
    again: counting only the first made the plan pass validation and fail half-applied."""
    probe = Engine(EngineConfig(model=str(tiny_path_256), kv_cache_bytes=1 << 20))
    bytes_per_block = probe.kv.cache.tensor.nbytes // (probe.kv.num_usable_blocks + 1)
    engine = Engine(EngineConfig(model=str(tiny_path_256), kv_cache_bytes=8 * bytes_per_block))
    block = engine.kv.block_size
    assert engine.kv.num_usable_blocks == 7
    owner = list(range(40, 40 + 2 * block + 1))  # 2 full blocks (cached) + 1 token: 3 blocks
    filler = [200] * (3 * block)  # 3 blocks
    engine.step(
        StepRequest(
            new_requests=[NewRequest("owner", owner, max_new_tokens=4), NewRequest("filler", filler, max_new_tokens=4)],
            scheduled=[ScheduledRequest("owner", len(owner)), ScheduledRequest("filler", len(filler))],
        )
    )
    assert engine.kv.num_free_blocks == 1
    # Reuses owner's 2 cached blocks and needs 3 more: after owner's 3 go back, 4 are free, 5 are taken.
    reuser = NewRequest("reuser", owner[: 2 * block] + [100] * (2 * block + 8), max_new_tokens=4)
    with pytest.raises(OutOfKVBlocksError):
        engine.step(
            StepRequest(
                released=["owner"], new_requests=[reuser], scheduled=[ScheduledRequest("reuser", 4 * block + 8)]
            )
        )
    assert engine.has_request("owner") and not engine.has_request("reuser")
    assert engine.kv.num_free_blocks == 1


def test_a_resubmitted_request_must_have_something_left_to_generate(engine):
    with pytest.raises(InvalidRequestError, match="3 tokens already generated, max_new_tokens=3"):
        engine.add_request(NewRequest("done", PROMPT, max_new_tokens=3, output_token_ids=(1, 2, 3)))
    with pytest.raises(InvalidRequestError, match=r"output_token_ids \[1000000\] are outside the vocabulary"):
        engine.add_request(NewRequest("bad", PROMPT, max_new_tokens=3, output_token_ids=(10**6,)))
    assert_still_serves(engine)
