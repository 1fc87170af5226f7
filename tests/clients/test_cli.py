"""The client's and the CLI's pure parts: requests built from kwargs, events from responses,
flags, output formatting, the serve commands. No server, no sockets (the end-to-end
tests against the real services live elsewhere)."""

from __future__ import annotations

import json
import sys

import grpc
import pytest

from clients import AsyncSwarmClient, Completion, FinishEvent, SwarmClient, SwarmServeError, TokenEvent, Usage
from clients.cli import parse_args, request_kwargs
from clients.cli_output import (
    completion_to_json,
    decode_tokens_per_second,
    format_error,
    format_serve_banner,
    format_summary,
)
from clients.completion import collect_completion
from clients.events import TokenLogprob, TopLogprob, event_from_pb, finish_reason_name
from clients.generate_request import build_generate_request
from clients.serve import (
    ChildExit,
    ServeConfig,
    ServeReady,
    connect_address,
    describe_exit,
    executor_command,
    scheduler_command,
)
from swarmserve.scheduler.v1 import scheduler_pb2 as pb

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed")


# --- the request built from client kwargs ---


def test_each_prompt_source_selects_its_oneof_arm():
    assert build_generate_request("hi").WhichOneof("prompt") == "text"
    assert build_generate_request(token_ids=[1, 2]).token_ids.ids == [1, 2]
    chat = build_generate_request(messages=[{"role": "user", "content": "hi"}])
    assert chat.WhichOneof("prompt") == "chat"
    assert [(m.role, m.content) for m in chat.chat.messages] == [("user", "hi")]


def test_empty_prompts_still_select_their_arm_so_the_server_can_say_what_is_wrong():
    assert build_generate_request("").WhichOneof("prompt") == "text"
    assert build_generate_request(token_ids=[]).WhichOneof("prompt") == "token_ids"
    assert build_generate_request(messages=[]).WhichOneof("prompt") == "chat"


@pytest.mark.parametrize(
    "sources",
    [
        {},
        {"prompt": "a", "token_ids": [1]},
        {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
        {"token_ids": [1], "messages": []},
    ],
)
def test_exactly_one_prompt_source(sources):
    with pytest.raises(ValueError, match="exactly one of prompt, token_ids or messages"):
        build_generate_request(**sources)


def test_unset_sampling_fields_stay_unset():
    request = build_generate_request("hi")
    assert not request.HasField("sampling")
    assert not request.HasField("max_new_tokens")
    request = build_generate_request("hi", top_k=5)
    assert request.sampling.top_k == 5
    assert [f for f in SAMPLING_FIELDS if request.sampling.HasField(f)] == ["top_k"]


def test_zero_values_are_set_not_dropped():
    request = build_generate_request("hi", temperature=0.0, seed=0, max_new_tokens=0, min_p=0.0)
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    assert request.sampling.HasField("seed") and request.sampling.HasField("min_p")
    assert request.HasField("max_new_tokens") and request.max_new_tokens == 0


def test_every_kwarg_reaches_its_field():
    request = build_generate_request(
        "hi",
        max_new_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=123,
        stop=["\n\n", "END"],
        stop_token_ids=[2],
        ignore_eos=True,
        num_logprobs=3,
        include_special_tokens=True,
        request_id="r1",
    )
    assert request.request_id == "r1"
    assert request.max_new_tokens == 7
    assert request.sampling.temperature == 0.5 and request.sampling.top_k == 40 and request.sampling.seed == 123
    assert request.sampling.top_p == pytest.approx(0.9) and request.sampling.min_p == pytest.approx(0.05)
    assert list(request.stop) == ["\n\n", "END"] and list(request.stop_token_ids) == [2]
    assert request.ignore_eos and request.include_special_tokens and request.num_logprobs == 3


def test_defaults_leave_the_request_empty_but_for_the_prompt():
    assert build_generate_request("hi") == pb.GenerateRequest(text="hi")


def test_a_single_stop_string_is_one_stop_string():
    assert list(build_generate_request("hi", stop="\n").stop) == ["\n"]


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user"}],
        [{"role": "user", "content": "hi", "name": "bob"}],
        ["hi"],
        [{"role": "user", "content": 3}],
    ],
)
def test_malformed_chat_messages_are_rejected(messages):
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        build_generate_request(messages=messages)


def test_a_value_the_field_cannot_hold_fails_before_sending():
    with pytest.raises(ValueError):
        build_generate_request("hi", max_new_tokens=-1)


def test_generate_validates_before_any_rpc_and_needs_no_loop():
    client = AsyncSwarmClient("127.0.0.1:1")  # nothing listens there; nothing is dialled
    with pytest.raises(ValueError):
        client.generate()
    with pytest.raises(ValueError):
        client.chat([{"role": "user"}])
    stream = client.generate("hi", request_id="mine")
    assert stream.request_id == "mine"


def test_sync_client_validates_eagerly_and_closes_cleanly():
    client = SwarmClient("127.0.0.1:1")
    with pytest.raises(ValueError):
        client.generate(prompt="a", token_ids=[1])
    client.close()
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.server_info()


# --- events from responses ---


def test_finish_reason_names():
    assert finish_reason_name(pb.FINISH_REASON_EOS) == "eos"
    assert finish_reason_name(pb.FINISH_REASON_STOP_STRING) == "stop_string"
    assert finish_reason_name(pb.FINISH_REASON_CONTEXT_FULL) == "context_full"
    assert finish_reason_name(99) == "unknown_99"


def test_delta_becomes_a_token_event():
    response = pb.GenerateResponse(
        request_id="r",
        delta=pb.TokenDelta(
            token_ids=[5, 6],
            text="ab",
            logprobs=[
                pb.TokenLogprob(token_id=5, logprob=-0.5, top_logprobs=[pb.TopLogprob(token_id=5, logprob=-0.5)])
            ],
        ),
    )
    assert event_from_pb(response) == TokenEvent(
        token_ids=(5, 6), text="ab", logprobs=(TokenLogprob(5, -0.5, (TopLogprob(5, -0.5),)),)
    )


def test_final_becomes_a_finish_event():
    final = pb.GenerateFinal(
        finish_reason=pb.FINISH_REASON_STOP_STRING,
        usage=pb.Usage(prompt_tokens=3, completion_tokens=4, ttft_s=0.5),
        stop_string="\n",
    )
    event = event_from_pb(pb.GenerateResponse(request_id="r", final=final))
    assert event == FinishEvent("stop_string", Usage(prompt_tokens=3, completion_tokens=4, ttft_s=0.5), "\n")
    no_stop = event_from_pb(pb.GenerateResponse(final=pb.GenerateFinal(finish_reason=pb.FINISH_REASON_LENGTH)))
    assert no_stop.stop_string is None and no_stop.usage == Usage()


def test_a_response_without_an_event_is_skipped():
    assert event_from_pb(pb.GenerateResponse(request_id="r")) is None


def test_collect_completion_concatenates_deltas():
    events = [
        TokenEvent((1, 2), "he"),
        TokenEvent((3,), ""),  # text may lag the tokens
        TokenEvent((), "llo"),
        FinishEvent("eos", Usage(completion_tokens=3)),
    ]
    completion = collect_completion("r", events)
    assert completion == Completion("r", (1, 2, 3), "hello", "eos", Usage(completion_tokens=3))


def test_collect_completion_needs_a_finish_event():
    with pytest.raises(ValueError, match="FinishEvent"):
        collect_completion("r", [TokenEvent((1,), "a")])


# --- errors ---


def test_swarmserve_error_reads_like_the_server_said_it():
    error = SwarmServeError(grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0")
    assert isinstance(error, Exception)
    assert str(error) == "INVALID_ARGUMENT: temperature must be >= 0"
    assert format_error(error) == "error: INVALID_ARGUMENT: temperature must be >= 0"
    assert str(SwarmServeError(grpc.StatusCode.CANCELLED, "")) == "CANCELLED"


def test_swarmserve_error_from_an_aio_rpc_error():
    rpc_error = grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="queue is full (64 requests)",
    )
    error = SwarmServeError.from_rpc_error(rpc_error)
    assert error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.message == "queue is full (64 requests)"


def test_format_error_for_other_exceptions():
    assert format_error(TimeoutError("not SERVING after 5s")) == "error: not SERVING after 5s"
    assert format_error(TimeoutError()) == "error: TimeoutError"


# --- CLI output ---

COMPLETION = Completion(
    request_id="r1",
    token_ids=(1, 2, 3),
    text="abc",
    finish_reason="length",
    usage=Usage(prompt_tokens=5, completion_tokens=3, ttft_s=0.25, total_time_s=0.45, queue_time_s=0.0),
)


def test_json_output_has_the_documented_keys_and_round_trips():
    obj = json.loads(json.dumps(completion_to_json(COMPLETION)))
    assert set(obj) == {"request_id", "token_ids", "text", "finish_reason", "stop_string", "usage"}
    assert obj["token_ids"] == [1, 2, 3] and obj["text"] == "abc" and obj["finish_reason"] == "length"
    assert obj["request_id"] == "r1" and obj["stop_string"] is None
    assert set(obj["usage"]) == set(Usage.__dataclass_fields__)
    assert obj["usage"]["prompt_tokens"] == 5


def test_decode_rate_excludes_the_first_token():
    # 2 tokens after the first, in 0.45 - 0.25 = 0.2 s.
    assert decode_tokens_per_second(COMPLETION.usage) == pytest.approx(10.0)
    assert decode_tokens_per_second(Usage(completion_tokens=1, ttft_s=0.1, total_time_s=0.1)) is None
    assert decode_tokens_per_second(Usage(completion_tokens=5, ttft_s=0.1, total_time_s=0.1)) is None


def test_summary_line():
    line = format_summary(COMPLETION)
    assert "\n" not in line
    assert (
        line
        == "finish=length tokens=3 prompt_tokens=5 cached_tokens=0 ttft=0.250s tok/s=10.0 total=0.450s request_id=r1"
    )


def test_summary_mentions_the_stop_string_and_speculation_when_there_is_some():
    completion = Completion(
        "r",
        (1,),
        "a",
        "stop_string",
        Usage(completion_tokens=1, drafted_tokens=8, accepted_tokens=6, num_preemptions=2),
        "\n\n",
    )
    line = format_summary(completion)
    assert line.startswith("finish=stop_string('\\n\\n') tokens=1")
    assert "tok/s" not in line
    assert "accepted=6/8" in line and "preemptions=2" in line


def test_serve_banner_lists_every_address():
    ready = ServeReady("127.0.0.1:50052", "127.0.0.1:50051", "SmolLM2")
    assert format_serve_banner(ready.model_name, ready.addresses(ServeConfig())) == (
        "swarmserve: serving SmolLM2\n  executor   grpc://127.0.0.1:50052\n  scheduler  grpc://127.0.0.1:50051"
    )
    with_http = ServeReady("127.0.0.1:50052", "127.0.0.1:50051", "SmolLM2", http_url="http://127.0.0.1:8000")
    config = ServeConfig(executor_listen="0.0.0.0:50052", metrics_port=9100)
    assert with_http.addresses(config)[2:] == [
        ("OpenAI/Anthropic HTTP API", "http://127.0.0.1:8000/v1"),
        ("scheduler metrics", "http://127.0.0.1:9100/metrics"),
        ("executor metrics", "http://127.0.0.1:9101/metrics"),
    ]


# --- CLI arguments ---


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_request_flag_defaults(command):
    args = parse_args([command, "hi"] if command == "generate" else [command])
    assert args.server == "127.0.0.1:50051"
    assert args.timeout is None and args.json is False and args.stop == []
    assert request_kwargs(args) == {
        "max_new_tokens": None,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "min_p": None,
        "seed": None,
        "stop": [],
        "ignore_eos": False,
        "include_special_tokens": False,
        "request_id": None,
        "structured_output": None,
    }


def test_request_flags_reach_the_client_kwargs():
    args = parse_args(
        "generate hi --server h:1 --max-new-tokens 8 --temperature 0 --top-p 0.9 --top-k 4 --seed 7 "
        "--ignore-eos --stop a --stop b --json --timeout 2.5".split()
    )
    kwargs = request_kwargs(args)
    assert (args.server, args.json, args.timeout) == ("h:1", True, 2.5)
    assert kwargs["max_new_tokens"] == 8 and kwargs["temperature"] == 0.0 and kwargs["top_k"] == 4
    assert kwargs["top_p"] == 0.9 and kwargs["seed"] == 7 and kwargs["ignore_eos"] is True
    assert kwargs["stop"] == ["a", "b"]
    # Every kwarg is one build_generate_request accepts.
    build_generate_request("hi", **kwargs)


def test_grammar_flags_reach_the_request(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    kwargs = request_kwargs(parse_args(["generate", "hi", "--json-schema", str(schema)]))
    request = build_generate_request("hi", **kwargs)
    assert request.structured_output.json_schema == schema.read_text()
    assert (
        build_generate_request("hi", **request_kwargs(parse_args(["chat", "--regex", "a+"]))).structured_output.regex
        == "a+"
    )
    assert build_generate_request(
        "hi", **request_kwargs(parse_args(["chat", "--json-object"]))
    ).structured_output.json_object
    lark = tmp_path / "g.lark"
    lark.write_text('start: "yes" | "no"')
    assert request_kwargs(parse_args(["chat", "--lark", str(lark)]))["structured_output"] == {"lark": lark.read_text()}
    assert build_generate_request(
        "hi", structured_output={"json_schema": {"type": "object"}}
    ).structured_output.json_schema == ('{"type": "object"}')
    for bad in ({}, {"json_object": False}, {"regex": 1}, {"json_schema": "{}", "regex": "a"}, {"yaml": "x"}):
        with pytest.raises(ValueError, match="structured_output"):
            build_generate_request("hi", structured_output=bad)


def test_grammar_flags_are_exclusive_and_files_must_exist(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        parse_args(["generate", "hi", "--json-object", "--regex", "a"])
    assert exit.value.code == 2
    with pytest.raises(SystemExit) as exit:
        parse_args(["generate", "hi", "--json-schema", str(tmp_path / "missing.json")])
    assert exit.value.code == 2 and "cannot read the grammar file" in capsys.readouterr().err


def test_generate_takes_a_prompt_or_token_ids():
    assert parse_args(["generate", "--token-ids", "1, 2,3"]).token_ids == [1, 2, 3]
    assert parse_args(["generate", "-"]).prompt == "-"


@pytest.mark.parametrize(
    "argv",
    [
        ["generate"],
        ["generate", "hi", "--token-ids", "1"],
        ["generate", "--token-ids", "1,x"],
        ["generate", "hi", "--max-new-tokens", "-1"],
        ["generate", "hi", "--seed", "-3"],
        ["generate", "hi", "--timeout", "0"],
        ["chat", "extra-positional"],
        ["serve", "--batching", "fifo"],
        ["serve", "--log-format", "xml"],
        ["serve", "--executor-listen", "nohost"],
        ["serve", "--executor-listen", "127.0.0.1:5", "--scheduler-listen", "127.0.0.1:5"],
        ["serve", "--max-running-requests", "0"],
        [],
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().out == ""


def test_chat_flags():
    args = parse_args(["chat", "--system", "be brief", "--message", "hi", "--temperature", "0.2"])
    assert (args.system, args.message, args.temperature) == ("be brief", "hi", 0.2)
    assert parse_args(["chat"]).system is None and parse_args(["chat"]).message is None


def test_serve_flag_defaults():
    config = parse_args(["serve"]).config
    assert config == ServeConfig()
    assert (config.executor_listen, config.scheduler_listen, config.model) == (
        "127.0.0.1:50052",
        "127.0.0.1:50051",
        "default",
    )
    assert config.executor_args == config.scheduler_args == ()


def test_serve_passes_each_service_flag_to_the_service_that_defines_it():
    config = parse_args(
        "serve --executor-listen 0.0.0.0:6002 --scheduler-listen 127.0.0.1:6001 --model m.gguf --dtype bfloat16 "
        "--kv-cache-gb=2.5 --no-prefix-caching --batching static --spec off --max-num-batched-tokens 1024 "
        "--log-format console --decode-latency-target-ms 40 --no-async-scheduling".split()
    ).config
    assert config.executor_listen == "0.0.0.0:6002" and config.scheduler_listen == "127.0.0.1:6001"
    assert config.executor_args == (
        "--model", "m.gguf", "--dtype", "bfloat16", "--kv-cache-gb=2.5", "--no-prefix-caching",
        "--max-num-batched-tokens", "1024", "--log-format", "console",
    )  # fmt: skip
    assert config.scheduler_args == (
        "--batching", "static", "--spec", "off", "--max-num-batched-tokens", "1024", "--log-format", "console",
        "--decode-latency-target-ms", "40", "--no-async-scheduling",
    )  # fmt: skip
    assert config.model == "m.gguf"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--no-such-flag"], "neither"),
        (["--listen", "127.0.0.1:1"], "--executor-listen"),
        (["--executor", "127.0.0.1:1"], "own executor"),
        (["--tls-cert", "c.pem"], "TLS"),
        (["--spec"], "needs a value"),
        (["stray"], "unexpected"),
    ],
)
def test_serve_refuses_flags_it_cannot_pass_on(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["serve", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_checks_each_service_s_flags_before_starting_anything(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["serve", "--kv-cache-gb", "lots"])
    assert exit_info.value.code == 2
    assert "swarmserve-executor: error: argument --kv-cache-gb" in capsys.readouterr().err


# --- serve: the child commands ---


def test_children_get_only_the_flags_that_were_given():
    config = ServeConfig()
    assert executor_command(config, "py") == ["py", "-m", "executor_svc.main", "--listen", "127.0.0.1:50052"]
    assert scheduler_command(config, "py") == [
        "py", "-m", "scheduler_svc.main", "--listen", "127.0.0.1:50051", "--http-listen", "127.0.0.1:8000",
        "--executor", "127.0.0.1:50052",
    ]  # fmt: skip
    no_http = scheduler_command(ServeConfig(http_listen=""), "py")
    assert "--http-listen" not in no_http
    with pytest.raises(ValueError, match="http_listen"):
        ServeConfig(http_listen="8000")


def test_children_get_their_own_flags():
    config = ServeConfig(
        executor_listen="0.0.0.0:6002",
        scheduler_listen="127.0.0.1:6001",
        http_listen="0.0.0.0:6003",
        executor_args=("--model", "m.gguf", "--threads", "4"),
        scheduler_args=("--max-queued-requests", "0"),
    )
    executor = executor_command(config, "py")
    scheduler = scheduler_command(config, "py")
    assert executor == [
        "py",
        "-m",
        "executor_svc.main",
        "--listen",
        "0.0.0.0:6002",
        "--model",
        "m.gguf",
        "--threads",
        "4",
    ]
    assert scheduler == [
        "py", "-m", "scheduler_svc.main", "--listen", "127.0.0.1:6001", "--http-listen", "0.0.0.0:6003",
        "--executor", "127.0.0.1:6002",  # the wildcard listen address, made dialable
        "--max-queued-requests", "0",
    ]  # fmt: skip


def test_children_run_on_this_interpreter_by_default():
    assert executor_command(ServeConfig())[0] == sys.executable


def test_connect_address():
    assert connect_address("127.0.0.1:50051") == "127.0.0.1:50051"
    assert connect_address("0.0.0.0:50051") == "127.0.0.1:50051"
    assert connect_address("[::]:50051") == "[::1]:50051"
    assert connect_address("localhost:1") == "localhost:1"


def test_describe_exit():
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-9) == "was killed by SIGKILL"
    assert ChildExit("scheduler", 1).describe() == "scheduler exited with code 1"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"executor_listen": "50052"},
        {"scheduler_listen": "host:notaport"},
        {"executor_listen": "127.0.0.1:1", "scheduler_listen": "127.0.0.1:1"},
        {"metrics_port": 65535},
        {"startup_timeout_s": 0},
        {"shutdown_grace_s": -1},
    ],
)
def test_serve_config_rejects(kwargs):
    with pytest.raises(ValueError):
        ServeConfig(**kwargs)
