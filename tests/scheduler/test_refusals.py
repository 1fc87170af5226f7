"""refusals.grpc_field: the GenerateRequest field a refusal's message starts with, for its log line."""

from __future__ import annotations

from scheduler_svc.refusals import grpc_field


def test_the_field_a_refusal_names_is_found_and_prose_is_not_a_field():
    assert grpc_field("max_new_tokens=64000 is beyond the context: ...") == "max_new_tokens"
    assert grpc_field("sampling.top_p must be in (0, 1], got 2.0") == "sampling.top_p"
    assert (
        grpc_field("chat.messages[2].tool_calls[0].arguments is not valid JSON")
        == "chat.messages[2].tool_calls[0].arguments"
    )
    assert grpc_field("the prompt is 1270 tokens; the model's context is 1024 tokens") is None
    assert grpc_field("the queue is full (3 requests waiting)") is None
