"""Refusals over HTTP, in each API's shape and status, from real servers on loopback:
401 without a key from --api-key-file (either header), 429 when the queue is full,
503 while the executor is down; /health stays open and tells the truth. Each refusal,
over HTTP or gRPC, leaves exactly one `request_refused` line in the scheduler's log."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from swarmserve.scheduler.v1 import scheduler_pb2 as pb  # noqa: E402
from swarmserve.scheduler.v1 import scheduler_pb2_grpc as pb_grpc  # noqa: E402
from tests.support.http_stack import http_stack, refusal_lines  # noqa: E402

KEY = "sk-test-key"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(f"# one per line\n{KEY}\n")
    s = http_stack(
        tmp_path_factory, "--api-key-file", str(keys), "--max-running-requests", "1", "--max-queued-requests", "1",
        "--executor-reconnect-timeout-s", "1",  # new requests wait no longer for a lost executor
        # A token per call: the queue test's running request (900 tokens) lasts seconds, well past its checks.
        "--max-decode-runs", "1",
    )  # fmt: skip
    yield s
    s.stop()


def test_a_missing_or_wrong_key_is_refused_with_401(stack):
    with openai.OpenAI(base_url=stack.http_url + "/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as refused:
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        assert refused.value.body["type"] == "authentication_error"
    missing = httpx.post(stack.http_url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert missing.status_code == 401 and "--api-key-file" in missing.json()["error"]["message"]
    with anthropic.Anthropic(base_url=stack.http_url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            client.messages.create(model="m", messages=MESSAGES, max_tokens=2)
        assert refused.value.body["error"]["type"] == "authentication_error"
    assert httpx.get(stack.http_url + "/health").status_code == 200  # open, like gRPC health

    with openai.OpenAI(base_url=stack.http_url + "/v1", api_key=KEY, max_retries=0) as client:
        assert client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2).usage.completion_tokens == 2
    with anthropic.Anthropic(base_url=stack.http_url, api_key=KEY, max_retries=0) as client:  # sends x-api-key
        assert client.messages.create(model="m", messages=MESSAGES, max_tokens=2).usage.output_tokens == 2


def test_each_refusal_leaves_one_log_line_naming_the_field_as_the_client_spelled_it(stack):
    headers = {"authorization": f"Bearer {KEY}"}
    chat = stack.http_url + "/v1/chat/completions"
    cases = [  # (url, body, status, field, the message's start)
        (stack.http_url + "/v1/messages", {"model": "m", "messages": MESSAGES}, 400, "max_tokens", "max_tokens:"),
        (chat, {"model": "m", "messages": MESSAGES, "tool_choice": "required"}, 400, "tool_choice", "tool_choice:"),
        (chat, {"model": "m", "messages": MESSAGES, "max_tokens": 64000}, 400, "max_tokens", "max_tokens=64000"),
        (chat, {"model": "m", "messages": MESSAGES, "max_completion_tokens": 64000}, 400, "max_completion_tokens",
         "max_completion_tokens=64000"),
        (stack.http_url + "/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 64000}, 400,
         "max_output_tokens", "max_output_tokens=64000"),
    ]  # fmt: skip
    for url, body, status, field, start in cases:
        before = len(refusal_lines(stack))
        reply = httpx.post(url, json=body, headers=headers)
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert error["message"].startswith(start) and "max_new_tokens" not in error["message"]
        new = refusal_lines(stack)[before:]
        assert len(new) == 1, new
        assert (new[0]["route"], new[0]["status"], new[0]["field"]) == (url.removeprefix(stack.http_url), status, field)
        assert new[0]["message"].startswith(start) and new[0]["level"] == "info"

    before = len(refusal_lines(stack))
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        stub = pb_grpc.SchedulerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(
                stub.Generate(
                    pb.GenerateRequest(text="hi", max_new_tokens=64000), metadata=[("authorization", f"Bearer {KEY}")]
                )
            )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    new = refusal_lines(stack)[before:]
    assert len(new) == 1 and new[0]["status"] == "INVALID_ARGUMENT" and new[0]["field"] == "max_new_tokens"
    assert new[0]["route"] == "/swarmserve.scheduler.v1.SchedulerService/Generate"


def test_a_full_queue_is_429(stack):
    """One request runs (--max-running-requests 1), one waits (--max-queued-requests 1): the next is refused.

    The holders go one after the other: the second is sent once the first has streamed a token
    (it runs), so it is the one that waits, never refused for arriving before the first was admitted."""
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 900, "ignore_eos": True, "stream": True}
    headers = {"authorization": f"Bearer {KEY}"}
    stop = threading.Event()

    def hold(ready: threading.Event, until_a_token: bool):
        with httpx.stream(
            "POST", stack.http_url + "/v1/chat/completions", json=body, headers=headers, timeout=60
        ) as response:
            assert response.status_code == 200
            if until_a_token:  # the first chunk only names the role; the next ones carry tokens
                lines = response.iter_lines()  # held: a closed line iterator would close the response (an abort)
                next(line for line in lines if line.startswith("data:") and '"role"' not in line)
            ready.set()
            stop.wait(30)

    running, waiting = threading.Event(), threading.Event()
    holders = [
        threading.Thread(target=hold, args=(running, True)),
        threading.Thread(target=hold, args=(waiting, False)),
    ]
    try:
        holders[0].start()
        assert running.wait(30), "the first request never streamed a token"
        holders[1].start()
        assert waiting.wait(30), "the second request was not queued"
        before = len(refusal_lines(stack))
        with openai.OpenAI(base_url=stack.http_url + "/v1", api_key=KEY, max_retries=0) as client:
            with pytest.raises(openai.RateLimitError) as refused:
                client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        assert "queue is full" in refused.value.body["message"]
        with anthropic.Anthropic(base_url=stack.http_url, api_key=KEY, max_retries=0) as client:
            with pytest.raises(anthropic.RateLimitError):
                client.messages.create(model="m", messages=MESSAGES, max_tokens=2)
        assert [(line["route"], line["status"]) for line in refusal_lines(stack)[before:]] == [
            ("/v1/chat/completions", 429),
            ("/v1/messages", 429),
        ]
    finally:
        stop.set()
        for t in holders:
            if t.ident is not None:  # started
                t.join()


def test_a_down_executor_is_503_and_health_says_so(stack):
    stack.kill_executor()
    deadline = time.monotonic() + 10
    while httpx.get(stack.http_url + "/health").status_code != 503:
        assert time.monotonic() < deadline, "/health still says ok with the executor gone"
        time.sleep(0.1)
    with openai.OpenAI(base_url=stack.http_url + "/v1", api_key=KEY, max_retries=0) as client:
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert refused.value.status_code == 503 and "executor" in refused.value.body["message"]
    with anthropic.Anthropic(base_url=stack.http_url, api_key=KEY, max_retries=0) as client:
        with pytest.raises(anthropic.APIStatusError) as refused:
            client.messages.create(model="m", messages=MESSAGES, max_tokens=2)
    assert refused.value.status_code == 503 and refused.value.body["error"]["type"] == "overloaded_error"
