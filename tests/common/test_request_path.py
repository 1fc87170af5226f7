"""A request's options survive the whole path: the client's GenerateRequest → intake → the
planner's plan → the executor's StepRequest on the wire → the engine's request state; and
both services refuse bad contents in the same words.

Driven by `dataclasses.fields(SamplingParams)`, so a sampling option added to the shared
params type is covered without touching this file, and fails here until the one proto
message carries it. `test_a_new_sampling_option_needs_only_the_proto_and_the_params_type`
proves that by adding one: to a copy of sampling.proto and of the params type, nothing else.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from executor_svc.engine.step_messages import StepRequest
from executor_svc.weights.gguf_file import open_gguf
from executor_svc.weights.tokenizer import load_tokenizer
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.intake import ModelLimits, intake
from scheduler_svc.planner import Planner
from service_common.errors import InvalidRequestError
from service_common.sampling_params import SamplingParams
from service_common.structured_output import StructuredOutput
from swarmserve.common.v1 import sampling_pb2 as common_pb
from swarmserve.executor.v1 import executor_pb2 as epb
from swarmserve.scheduler.v1 import scheduler_pb2 as spb
from tests.support.tiny_gguf import TinyModelSpec

ROOT = Path(__file__).resolve().parents[2]
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
    """The client's message with every sampling option set in its sampling message."""
    msg = spb.GenerateRequest(token_ids=spb.TokenIds(ids=[5, 6, 7, 8, 9]), max_new_tokens=4)
    for f in dataclasses.fields(SamplingParams):
        setattr(msg.sampling, f.name, getattr(sampling, f.name))
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


@pytest.fixture(scope="module")
def engine(make_tiny_engine):
    return make_tiny_engine(SPEC, kv_cache_bytes=4 << 20)


def test_the_one_sampling_message_has_exactly_the_dataclass_fields():
    proto_fields = {f.name for f in common_pb.SamplingParams.DESCRIPTOR.fields}
    assert proto_fields == {f.name for f in dataclasses.fields(SamplingParams)}
    # Both hops carry that one message (not copies of it that could drift apart).
    assert all(f.has_presence for f in common_pb.SamplingParams.DESCRIPTOR.fields)  # unset: the server's default
    for hop in (spb.GenerateRequest, epb.NewRequest):
        assert hop.DESCRIPTOR.fields_by_name["sampling"].message_type is common_pb.SamplingParams.DESCRIPTOR
        assert hop.DESCRIPTOR.fields_by_name["structured_output"].message_type is common_pb.StructuredOutput.DESCRIPTOR


def test_every_sampling_option_reaches_the_engine(limits, engine):
    sampling = non_default_sampling()
    msg = generate_request(sampling)
    msg.structured_output.json_object = True
    config = SchedulerConfig()
    request = intake(msg, limits, config).request
    assert request.sampling == sampling

    planner = Planner(config, engine.kv.block_size, engine.kv.num_free_blocks, engine.config.max_num_batched_tokens)
    planner.add(request)
    plan = planner.schedule(now=0.0)
    assert [r.executor_request_id for r in plan.new_requests] == [request.executor_request_id]
    wire = epb.StepRequest.FromString(plan.to_pb().SerializeToString())
    engine.step(StepRequest.from_pb(wire))

    state = engine.get_request(request.executor_request_id)
    for f in dataclasses.fields(SamplingParams):
        assert getattr(state.sampling, f.name) == getattr(sampling, f.name), (
            f"SamplingParams.{f.name} was lost on the way"
        )
    assert state.new.structured_output == StructuredOutput("json_object")
    assert (state.new.prompt_token_ids, state.new.max_new_tokens) == ([5, 6, 7, 8, 9], 4)
    engine.release(request.executor_request_id)


def test_the_public_num_logprobs_beside_sampling_still_counts(limits):
    msg = spb.GenerateRequest(token_ids=spb.TokenIds(ids=[5, 6]), num_logprobs=3)
    assert intake(msg, limits, SchedulerConfig()).request.sampling.num_logprobs == 3
    msg.sampling.num_logprobs = 2  # the one inside the sampling message wins
    assert intake(msg, limits, SchedulerConfig()).request.sampling.num_logprobs == 2


def test_an_unset_seed_stays_unset_until_the_engine_draws_one():
    msg = SamplingParams(temperature=0.5).to_pb()
    assert not msg.HasField("seed")
    assert SamplingParams.from_pb(common_pb.SamplingParams.FromString(msg.SerializeToString())).seed is None


def test_unset_public_options_take_the_servers_defaults():
    defaults = SamplingParams(temperature=1.0, num_logprobs=3)
    assert SamplingParams.from_pb(spb.SamplingParams(top_k=4), defaults) == SamplingParams(
        temperature=1.0, top_k=4, num_logprobs=3
    )


VOCAB = 10**6  # beyond any test model's vocabulary
# Bad contents as a client sends them, and as a scheduler's plan would carry them.
REFUSED_BY_BOTH = {
    "max_new_tokens is 0": ({"max_new_tokens": 0}, {"max_new_tokens": 0}),
    "prompt token outside the vocabulary": (
        {"token_ids": spb.TokenIds(ids=[5, VOCAB])},
        {"prompt_token_ids": [5, VOCAB]},
    ),
    "stop token outside the vocabulary": ({"stop_token_ids": [VOCAB]}, {"stop_token_ids": [VOCAB]}),
    "no room to generate": (
        {"token_ids": spb.TokenIds(ids=[5] * SPEC.context_length)},
        {"prompt_token_ids": [5] * SPEC.context_length},
    ),
    "infinite retention": ({"session_id": "s", "retention_s": math.inf}, {"session_id": "s", "retention_s": math.inf}),
    "temperature below 0": (
        {"sampling": spb.SamplingParams(temperature=-1.0)},
        {"sampling": epb.SamplingParams(temperature=-1.0)},
    ),
    "top_p of 0": ({"sampling": spb.SamplingParams(top_p=0.0)}, {"sampling": epb.SamplingParams(top_p=0.0)}),
    "json_object false": (
        {"structured_output": spb.StructuredOutput(json_object=False)},
        {"structured_output": epb.StructuredOutput(json_object=False)},
    ),
    "a schema that is not JSON": (
        {"structured_output": spb.StructuredOutput(json_schema="{oops")},
        {"structured_output": epb.StructuredOutput(json_schema="{oops")},
    ),
}


@pytest.mark.parametrize("case", REFUSED_BY_BOTH)
def test_both_services_refuse_bad_contents_in_the_same_words(limits, engine, case):
    client_fields, plan_fields = REFUSED_BY_BOTH[case]
    msg = spb.GenerateRequest(**{"token_ids": spb.TokenIds(ids=[5, 6, 7]), "max_new_tokens": 4, **client_fields})
    with pytest.raises(InvalidRequestError) as by_scheduler:
        intake(msg, limits, SchedulerConfig())

    new = epb.NewRequest(
        **{
            "request_id": "r",
            "prompt_token_ids": [5, 6, 7],
            "max_new_tokens": 4,
            "sampling": SamplingParams().to_pb(),
            **plan_fields,
        }
    )
    with pytest.raises(InvalidRequestError) as by_executor:
        engine.step(StepRequest.from_pb(epb.StepRequest(new_requests=[new])))
    # A request's contents are checked once built, naming it; options as they are read off the wire.
    assert str(by_executor.value) in (str(by_scheduler.value), f"request 'r': {by_scheduler.value}")
    assert not engine.has_request("r")


def _with_new_option(source: str, anchor: str, line: str) -> str:
    assert source.count(anchor) == 1, anchor
    return source.replace(anchor, line + anchor)


@pytest.mark.slow
def test_a_new_sampling_option_needs_only_the_proto_and_the_params_type(tmp_path):
    """Add an option to copies of the two files a new option touches (the sampler, the third,
    is where it would take effect, not how it travels), then run this module's path tests on
    them: every other file, the converters included, must carry it unchanged."""
    protos = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", protos, ignore=shutil.ignore_patterns("*_pb2*.py", "*_pb2.pyi", "__pycache__"))
    proto = protos / "swarmserve/common/v1/sampling.proto"
    proto.write_text(
        _with_new_option(proto.read_text(), "}\n\n// Output constrained", "  optional float new_test_option = 99;\n")
    )
    packages = tmp_path / "packages"
    shutil.copytree(ROOT / "service_common", packages / "service_common", ignore=shutil.ignore_patterns("__pycache__"))
    params = packages / "service_common/sampling_params.py"
    params.write_text(
        _with_new_option(params.read_text(), "\n    def __post_init__", "    new_test_option: float = 0.0\n")
    )
    import grpc_tools
    from grpc_tools import protoc

    sources = [str(p.relative_to(protos)) for p in protos.rglob("*.proto")]
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        f"--proto_path={protos}",
        f"--proto_path={include}",
        f"--python_out={protos}",
        f"--grpc_python_out={protos}",
    ]
    assert protoc.main(["protoc", *args, *sources]) == 0

    script = (
        "import dataclasses, sys, pytest\n"
        "from service_common.sampling_params import SamplingParams\n"
        "from swarmserve.common.v1 import sampling_pb2\n"
        "assert 'new_test_option' in {f.name for f in dataclasses.fields(SamplingParams)}\n"
        "assert 'new_test_option' in sampling_pb2.SamplingParams.DESCRIPTOR.fields_by_name\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-k', 'sampling_message or reaches_the_engine', sys.argv[1]]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [protos, packages, ROOT / "protos", ROOT]))}
    run = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__))],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert re.search(r"\b2 passed\b", run.stdout), run.stdout[-2000:]


def test_the_http_bodies_pass_options_of_the_same_name_through():
    from scheduler_svc.http_api.anthropic_schema import MessagesRequest
    from scheduler_svc.http_api.front import param_for_refusal, sampling
    from scheduler_svc.http_api.openai_schema import ChatCompletionRequest

    messages = [{"role": "user", "content": "hi"}]
    chat = ChatCompletionRequest(model="m", messages=messages, temperature=0.5, top_p=0.5, top_k=7, min_p=0.5, seed=7)
    assert SamplingParams.from_pb(sampling(chat, index=1)) == SamplingParams(
        temperature=0.5, top_p=0.5, top_k=7, min_p=0.5, seed=8
    )
    # A body that lacks an option, or leaves it unset, leaves it to the server's default.
    anthropic = MessagesRequest(model="m", max_tokens=4, messages=messages, top_k=3)
    assert sampling(anthropic).ListFields() == [(common_pb.SamplingParams.DESCRIPTOR.fields_by_name["top_k"], 3)]
    # Refusals name the HTTP field: its own name, or the one it is renamed to.
    assert param_for_refusal("sampling.min_p must be in [0, 1], got 2.0") == "min_p"
    assert param_for_refusal("sampling.num_logprobs must be in [0, 20], got 25") == "top_logprobs"
