"""Optional API keys: with --api-key-file, every SchedulerService call must carry
`authorization: Bearer <key>` metadata for one of the file's keys, or it is refused
with UNAUTHENTICATED before its handler runs.

The standard health service stays open, so probes and orchestrators need no key.
The file holds one key per line (several, so keys can be rotated without downtime);
blank lines and lines starting with # are ignored. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

PROTECTED_PREFIX = "/swarmserve.scheduler.v1.SchedulerService/"
METADATA_KEY = "authorization"
UNAUTHENTICATED_MESSAGE = (
    "missing or unknown API key: this scheduler requires metadata 'authorization: Bearer <key>' "
    "with a key from its --api-key-file"
)


def load_api_keys(path: str) -> list[str]:
    """The keys in `path`; raises ValueError naming the file if it holds none."""
    lines = Path(path).read_text().splitlines()
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ValueError(f"the API key file {path} holds no key (one per line)")
    return keys


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: list[str]) -> None:
        self._keys = [key.encode() for key in keys]

    def _is_authorized(self, metadata) -> bool:
        for name, value in metadata or ():
            if name == METADATA_KEY and isinstance(value, str) and value.startswith("Bearer "):
                presented = value[len("Bearer ") :].strip().encode()
                # Every key is compared, so timing does not tell which one nearly matched.
                return sum(hmac.compare_digest(presented, key) for key in self._keys) > 0
        return False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(PROTECTED_PREFIX):
            return handler
        if self._is_authorized(handler_call_details.invocation_metadata):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape that only refuses."""

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    serializers = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, **serializers)
    return grpc.unary_unary_rpc_method_handler(refuse, **serializers)
