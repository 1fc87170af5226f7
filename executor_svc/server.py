"""The executor's gRPC servicer: a thin shell around the engine.

from_pb → engine → to_pb. Steps run one at a time on a worker thread so the
event loop keeps answering health checks while the model computes. Engine
exceptions become status codes; the engine stays usable for the next call.

The server listens while the executor starts (start_server): health says NOT_SERVING and
every ExecutorService call is UNAVAILABLE until the engine is built and calibrated (ready),
so a scheduler whose executor restarted can tell one that is on its way back from one that
is gone.

Exactly one scheduler drives the executor. A scheduler attaches with GetInfo
under its id (stable across its restarts); every attach releases whatever the
engine holds, since an attaching scheduler has lost its state (it restarted, or
gave up on a broken step). Another scheduler is refused with FAILED_PRECONDITION,
at GetInfo and at Step, unless it attaches with `take_over`: then the current one
is retired and its later calls are refused too, so two schedulers never fight.
A GetInfo without a scheduler id is a read-only query and changes nothing.

An overlapped scheduler keeps two steps in flight: a plan built ahead names the
step it follows (`planned_after_step_id`) and runs only once that step is done
(so two concurrent RPCs can never run out of order); if that step failed, it is
refused with ABORTED, since it was built on a state that never came to be.
"""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from executor_svc.engine.engine import Engine
from executor_svc.engine.step_messages import CostSample, StepRequest
from executor_svc.errors import OutOfKVBlocksError
from executor_svc.kv.kv_cache import bytes_per_block
from executor_svc.observability.step_interceptor import executor_interceptors
from service_common.bearer_keys import BearerKeyInterceptor, load_keys, server_port
from service_common.errors import InvalidRequestError
from swarmserve.executor.v1 import executor_pb2 as pb
from swarmserve.executor.v1 import executor_pb2_grpc as pb_grpc

log = structlog.get_logger()

STARTING_MESSAGE = (
    "the executor is starting (loading the model, calibrating): its health says NOT_SERVING until it serves"
)
STEP_ORDER_TIMEOUT_S = 30.0  # how long a plan built ahead waits for the step it follows to arrive

SERVICE_NAME = "swarmserve.executor.v1.ExecutorService"
SCHEDULER_TOKEN_REFUSAL = (
    "missing or wrong scheduler token: this executor serves only a scheduler started with "
    "--executor-token-file holding the token in its --scheduler-token-file"
)


def engine_thread_pool() -> ThreadPoolExecutor:
    """The single thread that builds the engine and runs every step.

    The CPU kernels parallelize with OpenMP, which keeps one thread team per calling
    thread; two calling threads (say, the main thread that loaded and calibrated the
    engine, and a worker that runs the steps) leave two teams contending for the same
    cores, which measured 2x slower per decode step on 2 cores. So everything that
    computes goes through this one thread.
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")


class ExecutorServicer(pb_grpc.ExecutorServiceServicer):
    def __init__(
        self,
        engine: Engine | None,
        calibration: list[CostSample] = (),
        engine_thread: ThreadPoolExecutor | None = None,
    ) -> None:
        self.engine = engine  # None while the executor starts: every call is UNAVAILABLE until `ready`
        self.calibration = [c.to_pb() for c in calibration]
        self.executor_id = uuid.uuid4().hex
        self._scheduler_id = ""
        self._retired_scheduler_ids: set[str] = set()
        # The engine's one thread (see `engine_thread`): pass the one that built the engine.
        self._worker = engine_thread or engine_thread_pool()
        self._lock = asyncio.Lock()
        # The current scheduler's steps as they end (plans built ahead wait for the one they follow).
        self._step_done = asyncio.Condition()
        self._last_step_id = 0
        self._failed_step_ids: set[int] = set()

    def ready(self, engine: Engine, calibration: list[CostSample]) -> None:
        """The engine is built and calibrated: serve it."""
        self.calibration = [c.to_pb() for c in calibration]
        self.engine = engine

    async def _refuse_while_starting(self, context: grpc.aio.ServicerContext) -> None:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, STARTING_MESSAGE)

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
        self._last_step_id = 0
        self._failed_step_ids.clear()
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
        await self._refuse_while_starting(context)
        async with self._lock:
            released = 0
            if request.scheduler_id:
                refusal = self._refusal(request.scheduler_id)
                if refusal is not None and not request.take_over:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
                released = await self._run(self._attach_scheduler, request.scheduler_id)
        engine, config, tok = self.engine, self.engine.model_config, self.engine.tokenizer
        return pb.GetInfoResponse(
            model_name=engine.config.served_model_name or engine.model_runner.model_path.stem,
            model_title=config.name,
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
            kv_block_size=engine.kv.block_size,
            num_kv_blocks=engine.kv.num_usable_blocks,
            num_free_kv_blocks=engine.kv.num_free_blocks,
            max_num_batched_tokens=engine.config.max_num_batched_tokens,
            preferred_step_tokens=engine.model_runner.preferred_step_tokens,
            dtype=str(engine.model_runner.dtype).removeprefix("torch."),
            weight_bytes=engine.model_runner.weight_bytes,
            matmul=engine.model_runner.matmul,
            num_state_slots=engine.kv.state_pool.num_slots if engine.kv.state_pool else 0,
            num_free_state_slots=engine.kv.state_pool.num_free_slots if engine.kv.state_pool else 0,
            state_bytes_per_request=engine.kv.state_pool.bytes_per_slot if engine.kv.state_pool else 0,
            num_state_snapshots=engine.kv.state_pool.num_snapshots if engine.kv.state_pool else 0,
            kv_bytes_per_block=bytes_per_block(config, engine.kv.block_size, engine.model_runner.dtype),
            device=str(engine.model_runner.device),
            executor_id=self.executor_id,
            num_released_requests=released,
            max_draft_tokens=engine.config.max_draft_tokens,
            calibration=self.calibration,
        )

    async def _wait_for_step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> None:
        """Hold a plan built ahead until the step it follows is done; refuse it if that step failed."""
        after = request.planned_after_step_id
        if not after or request.scheduler_id != self._scheduler_id:
            return
        async with self._step_done:
            try:
                await asyncio.wait_for(
                    self._step_done.wait_for(lambda: self._last_step_id >= after), STEP_ORDER_TIMEOUT_S
                )
            except asyncio.TimeoutError:
                await context.abort(
                    grpc.StatusCode.ABORTED, f"step {request.step_id} follows step {after}, which never arrived"
                )
        if after in self._failed_step_ids:
            await context.abort(
                grpc.StatusCode.ABORTED, f"step {request.step_id} was planned after step {after}, which failed"
            )

    async def _step_ended(self, request: pb.StepRequest, is_ok: bool) -> None:
        if request.scheduler_id != self._scheduler_id:
            return
        async with self._step_done:
            self._last_step_id = max(self._last_step_id, request.step_id)
            if not is_ok:
                self._failed_step_ids.add(request.step_id)
            self._step_done.notify_all()

    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepResponse:
        if not request.scheduler_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "scheduler_id is required")
        await self._refuse_while_starting(context)
        is_ok = False
        try:
            await self._wait_for_step(request, context)
            output = await self._step(request, context)
            is_ok = True
        finally:
            # As soon as the engine is done: the next plan runs while this answer is encoded and sent.
            await self._step_ended(request, is_ok)
        return output.to_pb(request.step_id)

    async def _step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext):
        async with self._lock:
            refusal = self._refusal(request.scheduler_id)
            if refusal is None and not self._scheduler_id:
                refusal = f"scheduler {request.scheduler_id!r} has not attached (GetInfo) to this executor; it may have restarted"
            if refusal is not None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
            try:
                return await self._run(self.engine.step, StepRequest.from_pb(request))
            except OutOfKVBlocksError as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            except InvalidRequestError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except Exception as exc:  # a bug, not bad input: say so, keep serving
                log.exception("step_failed", step_id=request.step_id)
                await context.abort(
                    grpc.StatusCode.INTERNAL, f"step {request.step_id} failed: {type(exc).__name__}: {exc}"
                )


def _interceptors(tracer, metrics, scheduler_token_file: str | None) -> list:
    interceptors = list(executor_interceptors(tracer, metrics))
    if scheduler_token_file:  # refuse before anything else
        keys = load_keys(scheduler_token_file, "scheduler token")
        interceptors.insert(0, BearerKeyInterceptor(keys, SERVICE_NAME, SCHEDULER_TOKEN_REFUSAL))
    return interceptors


@dataclass
class StartingServer:
    """The executor's gRPC server, listening while the engine is built: health NOT_SERVING and
    every ExecutorService call UNAVAILABLE until `ready`. A scheduler that finds it so knows the
    executor is on its way back, and keeps its streams waiting (see scheduler_svc/executor_recovery.py)."""

    server: grpc.aio.Server
    servicer: ExecutorServicer
    health: health.aio.HealthServicer
    metrics: object = None

    async def ready(self, engine: Engine, calibration: list[CostSample] = ()) -> None:
        if self.metrics is not None:
            self.metrics.watch(engine)
        self.servicer.ready(engine, calibration)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)


async def start_server(
    listen: str,
    *,
    tracer=None,
    metrics=None,
    scheduler_token_file: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    engine_thread: ThreadPoolExecutor | None = None,
) -> StartingServer:
    """Start the executor's gRPC server (service + standard health) before its engine exists.

    `engine_thread` should be the `engine_thread_pool()` that builds the engine. `tracer`
    (OpenTelemetry) and `metrics` (ExecutorMetrics) are optional: without them no
    interceptor is installed at all.
    """
    server = grpc.aio.server(
        interceptors=_interceptors(tracer, metrics, scheduler_token_file) or None,
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
        ],
    )
    servicer = ExecutorServicer(None, engine_thread=engine_thread)
    pb_grpc.add_ExecutorServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server_port(server, listen, tls_cert, tls_key)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    server.bound_port = port  # type: ignore[attr-defined]
    return StartingServer(server, servicer, health_servicer, metrics)


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
    engine_thread: ThreadPoolExecutor | None = None,
) -> grpc.aio.Server:
    """Start the executor's gRPC server for a built engine, SERVING at once, and return it
    (`start_server` then `ready`)."""
    starting = await start_server(
        listen,
        tracer=tracer,
        metrics=metrics,
        scheduler_token_file=scheduler_token_file,
        tls_cert=tls_cert,
        tls_key=tls_key,
        engine_thread=engine_thread,
    )
    await starting.ready(engine, calibration)
    return starting.server
