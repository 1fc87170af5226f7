"""The scheduler's gRPC servicer: validate, enqueue, stream; cancellation frees the request.

A Generate call returns as soon as it is refused (INVALID_ARGUMENT,
ALREADY_EXISTS, RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE while the
executor is unreachable); otherwise it streams until the request ends. If the
client goes away or its deadline passes, the handler is cancelled and the
request is released at the next step, mid-prefill or mid-decode.
"""

from __future__ import annotations

import asyncio
import socket

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from scheduler_svc.admission import Refused, admit, release
from scheduler_svc.api_keys import api_key_interceptor
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.executor_link import ExecutorLink
from scheduler_svc.refusals import grpc_field, log_refusal
from scheduler_svc.request_limits import LimitExceeded, check_id
from scheduler_svc.request_stream import StreamError
from scheduler_svc.step_loop import StepLoop
from scheduler_svc.telemetry import Telemetry
from scheduler_svc.timeline import timeline_to_pb
from service_common.bearer_keys import bearer_key_interceptors, load_keys, server_port
from swarmserve.scheduler.v1 import scheduler_pb2 as pb
from swarmserve.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

log = structlog.get_logger()

SERVICE_NAME = "swarmserve.scheduler.v1.SchedulerService"
GENERATE_ROUTE = f"/{SERVICE_NAME}/Generate"


class SchedulerServicer(pb_grpc.SchedulerServiceServicer):
    def __init__(self, config: SchedulerConfig, loop: StepLoop) -> None:
        self.config = config
        self.loop = loop

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        loop = self.loop
        try:
            stream = await admit(loop, self.config, request, context.invocation_metadata())
        except Refused as exc:
            log_refusal(GENERATE_ROUTE, exc.code.name, grpc_field(exc.message), exc.message)
            await context.abort(exc.code, exc.message)
        structlog.contextvars.bind_contextvars(request_id=stream.request_id)
        try:
            while True:
                event = await stream.events.get()
                if isinstance(event, StreamError):
                    await context.abort(event.code, event.message)
                yield event
                if event.HasField("final"):
                    return
        finally:
            release(loop, stream)
            structlog.contextvars.unbind_contextvars("request_id")

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        try:
            check_id("request_id", request.request_id, self.config)
        except LimitExceeded as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.AbortResponse(was_found=self.loop.abort(request.request_id))

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        loop, view, info = self.loop, self.loop.view, self.loop.view.info
        return pb.GetServerInfoResponse(
            model_name=info.model_name if info else "",
            context_length=info.context_length if info else 0,
            vocab_size=info.vocab_size if info else 0,
            executor_address=self.config.executor,
            is_executor_connected=loop.is_connected,
            batching=self.config.batching,
            max_running_requests=self.config.max_running_requests,
            max_queued_requests=self.config.max_queued_requests,
            num_running_requests=view.num_running,
            num_queued_requests=view.num_waiting,
            num_free_kv_blocks=view.num_free_blocks,
            num_kv_blocks=view.num_kv_blocks,
            kv_block_size=view.block_size,
            chat_template=info.chat_template if info else "",
            num_steps=loop.num_steps,
            num_generated_tokens=loop.num_generated_tokens,
            dtype=info.dtype if info else "",
            device=info.device if info else "",
            weight_bytes=info.weight_bytes if info else 0,
            matmul=info.matmul if info else "",
        )

    async def GetTimeline(
        self, request: pb.GetTimelineRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetTimelineResponse:
        return timeline_to_pb(
            self.loop.history, request.max_steps, self.loop.view.num_kv_blocks, self.loop.history.maxlen or 0
        )


async def _track_health(loop: StepLoop, health_servicer: health.aio.HealthServicer) -> None:
    """SERVING while the executor is attached and the step loop runs, NOT_SERVING otherwise."""
    last = None
    while True:
        status = (
            health_pb2.HealthCheckResponse.SERVING if loop.is_serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        if status != last:
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, status)
            last = status
        await asyncio.sleep(0.1)


def _executor_token_interceptors(config: SchedulerConfig) -> list:
    """Send the executor's shared token (the file's first key) with every call to it."""
    if not config.executor_token_file:
        return []
    return bearer_key_interceptors(load_keys(config.executor_token_file, "executor token")[0])


async def serve(
    config: SchedulerConfig, *, tracer=None, metrics=None
) -> tuple[grpc.aio.Server, StepLoop, list[asyncio.Task]]:
    """Start the scheduler: its gRPC server, the step loop and the health tracker, and with
    `config.http_listen` the HTTP API (its `HttpServer` is `server.http_server`).

    `tracer` (OpenTelemetry) and `metrics` (SchedulerMetrics) are optional: without them
    no interceptor is installed and no span is made.
    """
    telemetry = Telemetry(tracer, metrics)
    interceptors = list(telemetry.server_interceptors)
    if config.api_key_file:
        interceptors.insert(0, api_key_interceptor(config.api_key_file))  # refuse before anything else
    link = ExecutorLink(
        config.executor,
        config.connect_timeout_s,
        config.executor_timeout_s,
        [*telemetry.client_interceptors, *_executor_token_interceptors(config)],
        scheduler_id=config.scheduler_id or f"{socket.gethostname()}/{config.listen}",
        ca_file=config.executor_ca,
        take_over=config.take_over,
    )
    loop = StepLoop(config, link, telemetry)
    if metrics is not None:
        metrics.watch(loop)
    server = grpc.aio.server(
        interceptors=interceptors or None,
        options=[
            ("grpc.so_reuseport", 0),  # a taken port must fail, not be shared
            ("grpc.max_receive_message_length", config.max_message_bytes),
        ],
    )
    pb_grpc.add_SchedulerServiceServicer_to_server(SchedulerServicer(config, loop), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server_port(server, config.listen, config.tls_cert, config.tls_key)
    if port == 0:
        raise OSError(f"cannot listen on {config.listen}")
    await server.start()
    server.bound_port = port  # type: ignore[attr-defined]
    tasks = [
        asyncio.create_task(loop.run(), name="step-loop"),
        asyncio.create_task(_track_health(loop, health_servicer)),
    ]
    server.http_server = None  # type: ignore[attr-defined]
    if config.http_listen:
        # Imported here: FastAPI and uvicorn load only when HTTP is on.
        from scheduler_svc.http_api.server import HttpServer

        try:
            http = HttpServer(config, loop, metrics)
        except OSError:
            await server.stop(None)
            for task in tasks:
                task.cancel()
            raise
        tasks.append(http.start())
        server.http_server = http  # type: ignore[attr-defined]
    return server, loop, tasks
