"""Refusals over HTTP, in each API's shape and status, from real servers on loopback:
401 without a key from --api-key-file (either header), 429 when the queue is full,
503 while the executor is down; /health stays open and tells the truth."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from tests.http_stack import http_stack  # noqa: E402

KEY = "sk-test-key"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(f"# one per line\n{KEY}\n")
    s = http_stack(
        tmp_path_factory, "--api-key-file", str(keys), "--max-running-requests", "1", "--max-queued-requests", "1",
        "--executor-reconnect-timeout-s", "1",  # new requests wait no longer for a lost executor
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


def test_a_full_queue_is_429(stack):
    """One request runs (--max-running-requests 1), one waits (--max-queued-requests 1): the next is refused."""
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 900, "ignore_eos": True, "stream": True}
    headers = {"authorization": f"Bearer {KEY}"}
    started = threading.Barrier(3)
    stop = threading.Event()

    def hold():
        with httpx.stream("POST", stack.http_url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as response:
            assert response.status_code == 200
            started.wait()
            stop.wait(30)

    holders = [threading.Thread(target=hold) for _ in range(2)]
    for t in holders:
        t.start()
    try:
        started.wait(30)
        with openai.OpenAI(base_url=stack.http_url + "/v1", api_key=KEY, max_retries=0) as client:
            with pytest.raises(openai.RateLimitError) as refused:
                client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        assert "queue is full" in refused.value.body["message"]
        with anthropic.Anthropic(base_url=stack.http_url, api_key=KEY, max_retries=0) as client:
            with pytest.raises(anthropic.RateLimitError):
                client.messages.create(model="m", messages=MESSAGES, max_tokens=2)
    finally:
        stop.set()
        for t in holders:
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
