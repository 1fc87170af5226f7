"""A request's options survive the whole path: the client's GenerateRequest → intake → the
planner's plan → the executor's StepRequest on the wire → the engine's request state.

Driven by `dataclasses.fields(SamplingParams)`, so a sampling option added to the shared
params type is covered without touching this file, and fails here until both protos carry it.
"""

from __future__ import annotations

import dataclasses

import pytest
from swarmserve.executor.v1 import executor_pb2 as epb
from swarmserve.scheduler.v1 import scheduler_pb2 as spb

from executor_svc.convert import step_request_from_pb
from executor_svc.gguf_file import open_gguf
from executor_svc.tokenizer import load_tokenizer
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.intake import ModelLimits, intake
from scheduler_svc.planner import Planner
from scheduler_svc.step_loop import plan_to_pb
from service_common.sampling_params import SamplingParams
from tests.tiny_gguf import TinyModelSpec

SPEC = TinyModelSpec(context_length=256)
# A valid value unlike the default for each field type; a new field of another type must add one here.
NON_DEFAULT = {"float": 0.5, "int": 7, "int | None": 7, "bool": True}


def non_default_sampling() -> SamplingParams:
    values = {}
    for f in dataclasses.fields(SamplingParams):
        if f.type not in NON_DEFAULT:
            raise AssertionError(f"SamplingParams.{f.name}: add a test value for type {f.type!r} to NON_DEFAULT")
        values[f.name] = NON_DEFAULT[f.type]
    sampling = SamplingParams(**values)
    defaults = SamplingParams()
    assert all(getattr(sampling, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(SamplingParams))
    return sampling


def generate_request(sampling: SamplingParams) -> spb.GenerateRequest:
    """The client's message with every sampling option set: in its sampling message, or beside it."""
    msg = spb.GenerateRequest(token_ids=spb.TokenIds(ids=[5, 6, 7, 8, 9]), max_new_tokens=4)
    for f in dataclasses.fields(SamplingParams):
        target = msg.sampling if f.name in msg.sampling.DESCRIPTOR.fields_by_name else msg
        assert f.name in target.DESCRIPTOR.fields_by_name, f"SamplingParams.{f.name} is not in the public GenerateRequest"
        setattr(target, f.name, getattr(sampling, f.name))
    return msg


@pytest.fixture(scope="module")
def limits(tiny_gguf_path) -> ModelLimits:
    info = load_tokenizer(open_gguf(tiny_gguf_path(SPEC)))
    return ModelLimits(
        tokenizer=info.tokenizer,
        chat_template=info.chat_template,
        bos_token=info.bos_token or "",
        eos_token=info.eos_token or "",
        context_length=SPEC.context_length,
        vocab_size=info.tokenizer.get_vocab_size(),
    )


def test_every_sampling_option_reaches_the_engine(limits, make_tiny_engine):
    sampling = non_default_sampling()
    config = SchedulerConfig()
    request = intake(generate_request(sampling), limits, config).request
    assert request.sampling == sampling

    engine = make_tiny_engine(SPEC, kv_cache_bytes=4 << 20)
    planner = Planner(config, engine.kv.block_size, engine.kv.num_free_blocks, engine.config.max_num_batched_tokens)
    planner.add(request)
    plan = planner.schedule()
    assert [r.executor_request_id for r in plan.new_requests] == [request.executor_request_id]
    wire = epb.StepRequest.FromString(plan_to_pb(plan).SerializeToString())
    engine.step(step_request_from_pb(wire))

    state = engine.get_request(request.executor_request_id)
    for f in dataclasses.fields(SamplingParams):
        assert getattr(state.sampling, f.name) == getattr(sampling, f.name), f"SamplingParams.{f.name} was lost on the way"


def test_an_unset_seed_stays_unset_until_the_engine_draws_one():
    msg = SamplingParams(temperature=0.5).to_pb(epb.SamplingParams)
    assert not msg.HasField("seed")
    assert SamplingParams.from_pb(epb.SamplingParams.FromString(msg.SerializeToString())).seed is None


def test_unset_public_options_take_the_servers_defaults():
    defaults = SamplingParams(temperature=1.0, num_logprobs=3)
    assert SamplingParams.from_pb(spb.SamplingParams(top_k=4), defaults) == SamplingParams(temperature=1.0, top_k=4, num_logprobs=3)
