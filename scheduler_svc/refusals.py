"""One log line per refused request, whichever door it came through.

A client that prints only "API Error: 400" (Claude Code, most agent frameworks) leaves
its user nothing to read but the server's log, so every refusal writes exactly one
`request_refused` line at info level: the route, the status, the field as the client
spelled it (the HTTP body's on HTTP, the proto's on gRPC) and the message, never the
body. The HTTP app logs at its error handlers, the gRPC servicer where it aborts;
admission, which both share, does not, so no refusal is logged twice.
"""

from __future__ import annotations

import re

import structlog

from swarmserve.scheduler.v1 import scheduler_pb2 as pb

log = structlog.get_logger()

# A message that starts with a field path: `max_new_tokens=...`, `sampling.top_p must ...`, `chat.messages[2] ...`.
_LEADING_PATH = re.compile(r"^([a-z_]+(?:\[\d+\])*(?:\.[a-z_]+(?:\[\d+\])*)*)(?=[=:\s]|$)")


def log_refusal(route: str, status: int | str, field: str | None, message: str) -> None:
    log.info("request_refused", route=route, status=status, field=field, message=message)


def grpc_field(message: str) -> str | None:
    """The GenerateRequest field a refusal's message starts with, if it names one."""
    match = _LEADING_PATH.match(message)
    if match is None:
        return None
    path = match.group(1)
    top = re.split(r"[.\[]", path, maxsplit=1)[0]
    return path if top in pb.GenerateRequest.DESCRIPTOR.fields_by_name else None
