"""Sends the scheduler's API key (`authorization: Bearer <key>`) with every call on a channel."""

from __future__ import annotations

from service_common.bearer_keys import bearer_key_interceptors


def api_key_interceptors(api_key: str) -> list:
    return bearer_key_interceptors(api_key)
