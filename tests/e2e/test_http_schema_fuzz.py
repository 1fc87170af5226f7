"""schemathesis against the HTTP API's own OpenAPI schema, on a live server: generated
bodies (valid and not) never get a 5xx, and the server still serves afterwards."""

from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402

from tests.support.http_stack import http_stack  # noqa: E402


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # Short default answers: most generated bodies name no max_tokens.
    s = http_stack(tmp_path_factory, "--default-max-new-tokens", "2", "--max-choices", "2")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api(stack):
    return schemathesis.openapi.from_url(stack.http_url + "/openapi.json")


def test_generated_requests_never_get_a_5xx_and_the_server_lives(stack, api):
    operations = [op.ok() for op in api.get_all_operations()]
    assert {o.path for o in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}
    failures, statuses = [], []
    for operation in operations:

        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(
            case=st.one_of(
                operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)
            )
        )
        def fuzz(case):
            response = case.call(base_url=stack.http_url, timeout=30)
            statuses.append(response.status_code)
            if response.status_code >= 500:
                failures.append((case.operation.label, case.body, response.status_code, response.text[:300]))
            case.validate_response(response, checks=[not_a_server_error])

        try:
            fuzz()
        except Exception as exc:  # collect, so one endpoint's finding does not hide another's
            failures.append((operation.label, repr(exc)[:500]))
    assert not failures, failures
    assert len(statuses) >= 5 * len(operations) and 400 in statuses and 200 in statuses
    assert httpx.get(stack.http_url + "/health").json() == {"status": "ok"}
    reply = httpx.post(
        stack.http_url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert reply.status_code == 200
