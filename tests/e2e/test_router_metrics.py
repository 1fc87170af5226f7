"""The load gateways route on, scraped from a running scheduler under load: the gauges the
Gateway API inference extension reads under vLLM's names on the HTTP port's /metrics,
and SMG's /v1/loads, both agreeing with our own gauges in the same moment."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

openai = pytest.importorskip("openai")

from tests.support.http_stack import http_stack  # noqa: E402

MAX_RUNNING = 2
NUM_STREAMS = 4  # two run, two wait
ROUTER_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = http_stack(tmp_path_factory, "--max-running-requests", str(MAX_RUNNING))
    yield s
    s.stop()


def scrape(url: str) -> dict[str, tuple[str, float, dict]]:
    """name -> (type, value, labels) of each single-sample family on `url`/metrics."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        samples = [s for s in family.samples if s.name == family.name]
        if len(samples) == 1:
            out[family.name] = (family.type, samples[0].value, samples[0].labels)
    return out


def _stream(base_url: str, index: int, started: threading.Event, errors: list) -> None:
    try:
        with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            stream = client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": f"agent {index}: keep going"}],
                max_tokens=160,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in stream:
                started.set()
    except Exception as error:  # noqa: BLE001 - reported by the test
        errors.append(error)


def test_router_gauges_and_smg_loads_follow_the_queue(stack):
    idle = scrape(stack.http_url)
    model_name = httpx.get(stack.http_url + "/v1/models").json()["data"][0]["id"]
    for name in ROUTER_GAUGES:
        kind, value, labels = idle[name]
        assert kind == "gauge" and labels == {"model_name": model_name}
        assert value == 0, f"{name} is {value} with nothing running"

    started, errors = threading.Event(), []
    threads = [threading.Thread(target=_stream, args=(stack.http_url, i, started, errors)) for i in range(NUM_STREAMS)]
    for thread in threads:
        thread.start()
    seen = None
    deadline = time.monotonic() + 60
    while seen is None and time.monotonic() < deadline and any(t.is_alive() for t in threads):
        now = scrape(stack.http_url)
        full = (
            now["vllm:num_requests_running"][1] == MAX_RUNNING
            and now["vllm:num_requests_waiting"][1] == NUM_STREAMS - MAX_RUNNING
        )
        # The KV gauges are the executor's last report: wait for one since the running requests were admitted.
        if full and now["swarmserve_scheduler_kv_blocks_used"][1] > 0:
            seen = now
            loads = httpx.get(stack.http_url + "/v1/loads").json()
        time.sleep(0.01)
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert seen is not None, "never saw two requests running (in the executor's KV report) and two waiting"

    # The router gauges are our own gauges under vLLM's names, read at the same moment.
    assert seen["vllm:num_requests_running"][1] == seen["swarmserve_scheduler_running_requests"][1]
    assert seen["vllm:num_requests_waiting"][1] == seen["swarmserve_scheduler_queue_depth"][1]
    used, free = seen["swarmserve_scheduler_kv_blocks_used"][1], seen["swarmserve_scheduler_kv_blocks_free"][1]
    assert seen["vllm:kv_cache_usage_perc"][1] == pytest.approx(used / (used + free))
    assert 0 < used / (used + free) < 1

    # SMG's load report: one rank; its queue moves with the same requests (read a moment later).
    (rank,) = loads["loads"]
    assert loads["dp_rank_count"] == 1 and rank["dp_rank"] == 0
    assert rank["num_running_reqs"] + rank["num_waiting_reqs"] == rank["num_total_reqs"] > 0
    assert rank["max_total_num_tokens"] == (used + free) * 16 and 0 < rank["token_usage"] < 1

    after = scrape(stack.http_url)
    assert [after[name][1] for name in ROUTER_GAUGES[:2]] == [0, 0]
