"""Count the RPCs a server ends with a status other than OK, by method and status code.

A server interceptor, so the servicers stay free of metrics: it wraps each handler,
and reads the status the handler left on its context (`context.abort` raises after
setting it) or UNKNOWN for an exception that set none. A stream the client abandons
(cancel, deadline) counts as CANCELLED.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect

import grpc

RPC_ERROR_LABELS = ("method", "code")


def _code_of(context, default: grpc.StatusCode) -> grpc.StatusCode:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    # Some grpcio versions keep the raw integer status.
    return next((c for c in grpc.StatusCode if c.value[0] == code), default)


class RpcErrorsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, counter) -> None:
        self._counter = counter  # a prometheus_client Counter labelled RPC_ERROR_LABELS

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        if code != grpc.StatusCode.OK:
            self._counter.labels(method, code.name).inc()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(method, handler.unary_unary))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._unary_stream(method, handler.unary_stream))
        return handler  # neither service has client-streaming methods

    def _unary(self, method: str, behavior):
        async def counted(request, context):
            try:
                response = await behavior(request, context)
            except asyncio.CancelledError:
                self._count(method, grpc.StatusCode.CANCELLED)
                raise
            except Exception:
                self._count(method, _code_of(context, grpc.StatusCode.UNKNOWN))
                raise
            if context.code() is not None:  # set_code without raising
                self._count(method, _code_of(context, grpc.StatusCode.OK))
            return response

        return counted

    def _unary_stream(self, method: str, behavior):
        if not inspect.isasyncgenfunction(behavior):
            return self._unary(method, behavior)  # a coroutine writing with context.write (health Watch)

        async def counted(request, context):
            try:
                # aclosing: the handler's own cleanup runs now, not when the generator is collected.
                async with contextlib.aclosing(behavior(request, context)) as stream:
                    async for response in stream:
                        yield response
            except (asyncio.CancelledError, GeneratorExit):
                self._count(method, grpc.StatusCode.CANCELLED)
                raise
            except Exception:
                self._count(method, _code_of(context, grpc.StatusCode.UNKNOWN))
                raise
            if context.code() is not None:
                self._count(method, _code_of(context, grpc.StatusCode.OK))

        return counted
