"""Access to the services, shared by both: bearer keys on gRPC (the scheduler's API keys,
clients → scheduler; the shared token, scheduler → executor) and TLS listening ports.

Server side, `BearerKeyInterceptor` refuses every call to the protected service whose
metadata lacks `authorization: Bearer <key>` for one of the keys, with UNAUTHENTICATED,
before its handler runs; the standard health service is never protected, so probes need
no key. Client side, `bearer_key_interceptors` sends a key with every call of a channel.
Key files hold one key per line (several, so keys rotate without downtime); blank lines
and lines starting with # are ignored. Keys are compared in constant time. Torch-free:
the scheduler imports it too.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

METADATA_KEY = "authorization"


def load_keys(path: str, what: str) -> list[str]:
    """The keys in `path`; raises ValueError naming the file (and `what` it is for) if it holds none."""
    lines = Path(path).read_text().splitlines()
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ValueError(f"the {what} file {path} holds no key (one per line)")
    return keys


class BearerKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: list[str], protected_service: str, refusal: str) -> None:
        self._keys = [key.encode() for key in keys]
        self._prefix = f"/{protected_service}/"
        self._refusal = refusal

    def is_authorized(self, metadata) -> bool:
        for name, value in metadata or ():
            if name == METADATA_KEY and isinstance(value, str) and value.startswith("Bearer "):
                presented = value[len("Bearer ") :].strip().encode()
                # Every key is compared, so timing does not tell which one nearly matched.
                return sum(hmac.compare_digest(presented, key) for key in self._keys) > 0
        return False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefix):
            return handler
        if self.is_authorized(handler_call_details.invocation_metadata):
            return handler
        return self._refusing(handler)

    def _refusing(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """A handler of the same shape that only refuses."""
        refusal = self._refusal

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)

        serializers = dict(
            request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(refuse, **serializers)
        return grpc.unary_unary_rpc_method_handler(refuse, **serializers)


def _with_key(details: grpc.aio.ClientCallDetails, metadatum: tuple[str, str]) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails(
        details.method,
        details.timeout,
        grpc.aio.Metadata(*(details.metadata or ()), metadatum),
        details.credentials,
        details.wait_for_ready,
    )


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, metadatum: tuple[str, str]) -> None:
        self._metadatum = metadatum

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_key(client_call_details, self._metadatum), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, metadatum: tuple[str, str]) -> None:
        self._metadatum = metadatum

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_key(client_call_details, self._metadatum), request)


def bearer_key_interceptors(key: str) -> list:
    """One interceptor per call shape: grpc.aio files an interceptor under one shape only,
    so a single class serving both would leave streaming calls without the key."""
    metadatum = (METADATA_KEY, f"Bearer {key}")
    return [_UnaryUnary(metadatum), _UnaryStream(metadatum)]


def server_port(server: grpc.aio.Server, listen: str, tls_cert: str | None, tls_key: str | None) -> int:
    """Listen on `listen`: with TLS when given a certificate and key (PEM files), else in the clear."""
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    if tls_cert:
        credentials = grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())])
        return server.add_secure_port(listen, credentials)
    return server.add_insecure_port(listen)
