"""The executor's gRPC servicer: a thin shell around the engine.

from_pb → engine → to_pb. Steps run one at a time on a worker thread so the
event loop keeps answering health checks while the model computes. Engine
exceptions become status codes; the engine stays usable for the next call.

Exactly one scheduler drives the executor. A scheduler attaches with GetInfo
under its id (stable across its restarts); every attach releases whatever the
engine holds, since an attaching scheduler has lost its state (it restarted, or
gave up on a broken step). Another scheduler is refused with FAILED_PRECONDITION,
at GetInfo and at Step, unless it attaches with `take_over`: then the current one
is retired and its later calls are refused too, so two schedulers never fight.
A GetInfo without a scheduler id is a read-only query and changes nothing.
"""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from swarmserve.executor.v1 import executor_pb2 as pb
from swarmserve.executor.v1 import executor_pb2_grpc as pb_grpc

from executor_svc.bearer_keys import BearerKeyInterceptor, load_keys, server_port
from executor_svc.convert import cost_samples_to_pb, plan_from_pb, step_output_to_pb
from executor_svc.engine import CostSample, Engine
from executor_svc.errors import InvalidRequestError, OutOfKVBlocksError
from executor_svc.observability.step_interceptor import executor_interceptors

log = structlog.get_logger()

SERVICE_NAME = "swarmserve.executor.v1.ExecutorService"
SCHEDULER_TOKEN_REFUSAL = (
    "missing or wrong scheduler token: this executor serves only a scheduler started with "
    "--executor-token-file holding the token in its --scheduler-token-file"
)


class ExecutorServicer(pb_grpc.ExecutorServiceServicer):
    def __init__(self, engine: Engine, calibration: list[CostSample] = ()) -> None:
        self.engine = engine
        self.calibration = cost_samples_to_pb(list(calibration))
        self.executor_id = uuid.uuid4().hex
        self._scheduler_id = ""
        self._retired_scheduler_ids: set[str] = set()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._lock = asyncio.Lock()

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    def _attach_scheduler(self, scheduler_id: str) -> int:
        """Make `scheduler_id` the current scheduler and release everything the engine holds
        (its own leftovers, or a replaced scheduler's requests); returns how many."""
        leftovers = self.engine.request_ids
        for request_id in leftovers:
            self.engine.release(request_id)
        self._retired_scheduler_ids.discard(scheduler_id)  # a retired scheduler taking the executor back
        if self._scheduler_id and self._scheduler_id != scheduler_id:
            self._retired_scheduler_ids.add(self._scheduler_id)
            log.warning("scheduler_taken_over", retired_scheduler_id=self._scheduler_id, scheduler_id=scheduler_id)
        log.info("scheduler_attached", scheduler_id=scheduler_id, released_requests=len(leftovers))
        self._scheduler_id = scheduler_id
        return len(leftovers)

    def _refusal(self, scheduler_id: str) -> str | None:
        """Why a call from `scheduler_id` (not attaching with take_over) is refused, or None."""
        if scheduler_id in self._retired_scheduler_ids:
            return (
                f"scheduler {scheduler_id!r} was replaced by scheduler {self._scheduler_id!r} (take-over); "
                "restart it with --take-over to take the executor back"
            )
        if self._scheduler_id and scheduler_id != self._scheduler_id:
            return (
                f"this executor is driven by scheduler {self._scheduler_id!r}; one executor serves one scheduler. "
                "Start this scheduler with --take-over to replace it"
            )
        return None

    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.GetInfoResponse:
        async with self._lock:
            released = 0
            if request.scheduler_id:
                refusal = self._refusal(request.scheduler_id)
                if refusal is not None and not request.take_over:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
                released = await self._run(self._attach_scheduler, request.scheduler_id)
        engine, config, tok = self.engine, self.engine.model_config, self.engine.tokenizer
        return pb.GetInfoResponse(
            model_name=config.name,
            architecture=config.architecture,
            context_length=config.context_length,
            vocab_size=config.vocab_size,
            eos_token_ids=list(tok.eos_token_ids),
            bos_token_id=tok.bos_token_id,
            add_bos_token=tok.add_bos_token,
            bos_token=tok.bos_token or "",
            eos_token=tok.eos_token or "",
            tokenizer_json=tok.to_json(),
            chat_template=tok.chat_template or "",
            kv_block_size=engine.kv_cache.block_size,
            num_kv_blocks=engine.kv_cache.num_usable_blocks,
            num_free_kv_blocks=engine.kv_cache.num_free_blocks,
            max_num_batched_tokens=engine.config.max_num_batched_tokens,
            dtype=str(engine.dtype).removeprefix("torch."),
            weight_bytes=engine.weight_bytes,
            device=str(engine.device),
            executor_id=self.executor_id,
            num_released_requests=released,
            max_draft_tokens=engine.config.max_draft_tokens,
            calibration=self.calibration,
        )

    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepResponse:
        if not request.scheduler_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "scheduler_id is required")
        async with self._lock:
            refusal = self._refusal(request.scheduler_id)
            if refusal is None and not self._scheduler_id:
                refusal = f"scheduler {request.scheduler_id!r} has not attached (GetInfo) to this executor; it may have restarted"
            if refusal is not None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
            try:
                plan = plan_from_pb(request)
                output = await self._run(self.engine.step, plan)
            except OutOfKVBlocksError as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            except InvalidRequestError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except Exception as exc:  # a bug, not bad input: say so, keep serving
                log.exception("step_failed", step_id=request.step_id)
                await context.abort(grpc.StatusCode.INTERNAL, f"step {request.step_id} failed: {type(exc).__name__}: {exc}")
        return step_output_to_pb(request.step_id, output)


def _interceptors(tracer, metrics, scheduler_token_file: str | None) -> list:
    interceptors = list(executor_interceptors(tracer, metrics))
    if scheduler_token_file:  # refuse before anything else
        keys = load_keys(scheduler_token_file, "scheduler token")
        interceptors.insert(0, BearerKeyInterceptor(keys, SERVICE_NAME, SCHEDULER_TOKEN_REFUSAL))
    return interceptors


async def serve(
    engine: Engine,
    listen: str,
    calibration: list[CostSample] = (),
    *,
    tracer=None,
    metrics=None,
    scheduler_token_file: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> grpc.aio.Server:
    """Start the executor's gRPC server (service + standard health) and return it.

    `tracer` (OpenTelemetry) and `metrics` (ExecutorMetrics) are optional: without them
    no interceptor is installed at all.
    """
    if metrics is not None:
        metrics.watch(engine)
    server = grpc.aio.server(
        interceptors=_interceptors(tracer, metrics, scheduler_token_file) or None,
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
        ]
    )
    pb_grpc.add_ExecutorServiceServicer_to_server(ExecutorServicer(engine, calibration), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server_port(server, listen, tls_cert, tls_key)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    server.bound_port = port  # type: ignore[attr-defined]
    return server
