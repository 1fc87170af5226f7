"""The step loop: plan → send → finish → apply → stream, once per step, for as long as there is work.

One asyncio task runs it. Generate handlers only enqueue requests and read their
streams, so a slow client never slows a step; what else they read of the loop,
they read through `view` (loop_view.py), never through the planner or the link.

Each step calls the planner twice (planner.py's contract): `schedule` builds the
plan, `update_from_output` folds the executor's answer in; a failed step calls
`fail_step`. Losing the executor and getting it back (the streams wait for it) is
executor_recovery.py.

With `--async-scheduling` the loop keeps two steps in flight (overlapped
scheduling): as soon as plan N is sent, plan N+1 is built from the state N is
expected to leave (see planner.py) and sent too, so the executor starts N+1 the
moment N is done, and the scheduler's own time (planning, protobufs, the RPC,
applying results, streaming) hides under the executor's. Results are applied
strictly in step order. What N+1 planned for a request that N finished (EOS,
length, a stop string the scheduler found, an abort) is skipped by the executor
or discarded here: no token past a request's end is ever streamed.

A plan of decodes only, with no request waiting, may run several times in one
call (`--max-decode-runs`, see `Planner._max_runs`): the executor answers with
every run's tokens at once, so one round trip and one pass of this loop serve
several tokens per request.

The loop is supervised: a step that raises (a bug, or an answer that cannot be
applied) ends only that step's requests, with INTERNAL, and the loop goes on. If
the task ends anyway, every stream is failed and `is_serving` turns False, which
health reports as NOT_SERVING: never a silent hang behind a SERVING health check.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections import deque
from dataclasses import dataclass

import grpc
import structlog

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.executor_link import ExecutorLink
from scheduler_svc.executor_recovery import ExecutorRecovery, reconnect_backoff_s
from scheduler_svc.loop_view import LoopView
from scheduler_svc.planner import Plan, Planner, RequestResult, RequestUpdate, StepFailure
from scheduler_svc.request_stream import RequestStream
from scheduler_svc.step_record import StepRecord, step_request_records
from scheduler_svc.telemetry import StepScope, Telemetry
from service_common.finish_reason import FinishReason
from swarmserve.executor.v1 import executor_pb2 as epb

log = structlog.get_logger()


@dataclass
class StepInFlight:
    """A plan sent to the executor whose result has not been applied yet."""

    plan: Plan
    call: asyncio.Future  # the Step RPC
    start_s: float
    scope: StepScope  # entered in `context` at send, left when the result is in
    context: contextvars.Context  # the step's own context: its span and log bindings never leak into the next step's
    client_ids: dict[str, str]  # executor id -> the client's id, decided at send


class StepLoop:
    def __init__(self, config: SchedulerConfig, link: ExecutorLink, telemetry: Telemetry | None = None) -> None:
        self.config = config
        self.link = link
        self.telemetry = telemetry or Telemetry()
        self.planner: Planner | None = None  # one per attach: sized to the executor that answered
        self.streams: dict[str, RequestStream] = {}
        self.recovery = ExecutorRecovery(config, link, self.streams, self._fail_stream)
        self.view = LoopView(link, lambda: self.planner)
        self.history: deque[StepRecord] = deque(maxlen=4096)
        self.num_steps = 0
        self.num_generated_tokens = 0
        self._wake = asyncio.Event()
        self._connected = asyncio.Event()
        self.stopped_reason = ""  # set when the loop task has ended: no step will ever run again
        self.is_draining = False  # shutting down: no new requests, those in flight finish
        self.in_flight: deque[StepInFlight] = deque()  # oldest first; at most max_steps_in_flight
        # Answers whose times the cost model has not yet learnt from (see `_observe_costs`).
        self._unobserved: deque[epb.StepResponse] = deque()
        self.max_steps_in_flight = 2 if config.async_scheduling else 1

    # ----------------------------------------------------------- for handlers

    @property
    def is_connected(self) -> bool:
        return self.link.is_connected and self.planner is not None

    @property
    def is_serving(self) -> bool:
        """Attached, the loop task alive to run steps, and taking new requests."""
        return self.is_connected and not self.stopped_reason and not self.is_draining

    @property
    def last_connect_error(self) -> str:
        """Why the last attach failed ("" once attached)."""
        return self.recovery.last_connect_error

    def start_draining(self) -> None:
        self.is_draining = True
        self._connected.set()  # wake handlers waiting for the executor: they are refused now

    async def wait_drained(self) -> None:
        """Until no request is in flight."""
        while self.streams:
            await asyncio.sleep(0.05)

    def request_id_conflict(self, request_id: str) -> str | None:
        """Why a client's request id cannot be used now (a message), or None if it can."""
        if request_id in self.streams:
            return f"request id {request_id!r} is already in flight"
        if self.planner is not None and self.planner.is_releasing(request_id):
            return (
                f"request id {request_id!r} has just ended and the executor has not released it yet; "
                "retry in a moment, or use a new id"
            )
        return None

    def connect_wait_s(self, grace_s: float) -> float:
        """How long a new request waits for the executor (see ExecutorRecovery.connect_wait_s)."""
        return self.recovery.connect_wait_s(grace_s)

    async def wait_connected(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def submit(self, stream: RequestStream) -> None:
        """Queue a validated request (the caller checked capacity and connection)."""
        assert self.planner is not None
        self.planner.add(stream.request)
        self.streams[stream.request_id] = stream
        self._wake.set()

    def abort(self, request_id: str) -> bool:
        """Stop a request (by the client's id): it is released at the next step; its stream ends as aborted."""
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return False
        if self.planner is not None:
            self.planner.abort(stream.request.executor_request_id)
        stream.finish(FinishReason.ABORTED)
        self._wake.set()
        return True

    # ------------------------------------------------------------------ loop

    async def run(self) -> None:
        try:
            await self._run_supervised()
        except BaseException as exc:
            self._stopped(exc)
            raise

    async def _run_supervised(self) -> None:
        attempt = 0
        while True:
            if not self.is_connected:
                attempt = await self._reconnect(attempt)
            elif not self.planner.has_work and not self.in_flight:
                await self._idle()
            else:
                await self._advance()

    async def _idle(self) -> None:
        """Nothing to plan: wait for work, or for the executor's connection to drop. Without a step
        in flight no RPC would fail, so /health would say ok with the executor gone; a dropped
        connection detaches, and the loop re-attaches at once if the executor is still there (a
        channel that merely went idle)."""
        self._wake.clear()
        woken = asyncio.ensure_future(self._wake.wait())
        dropped = asyncio.ensure_future(self.link.wait_until_disconnected())
        try:
            done, _ = await asyncio.wait({woken, dropped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            dropped.cancel()
        if dropped in done and woken not in done and self.is_connected:
            log.info("executor_connection_dropped", executor=self.link.address)
            self._detach()

    async def _reconnect(self, attempt: int) -> int:
        """Try to attach once, backing off after a failure; returns the attempts failed so far."""
        planner = await self.recovery.attach()
        if planner is not None:
            self.planner = planner
            self._unobserved.clear()  # another executor's times, or this one's before it restarted
            self._connected.set()
            return 0
        self._connected.clear()
        if await self.recovery.executor_is_starting():
            attempt = 0  # about to serve: poll at the shortest interval
        self.recovery.give_up_if_waited_too_long()
        await asyncio.sleep(reconnect_backoff_s(attempt))
        return attempt + 1

    async def _advance(self) -> None:
        """One move of the pipeline: send the next plan while there is room in flight, else
        wait for the oldest step and fold its result in (or, with nothing to do, wait briefly)."""
        planner = self.planner
        plan = None
        try:
            if len(self.in_flight) < self.max_steps_in_flight and planner.has_work:
                plan = self._schedule()
                if plan is not None and not plan.is_empty:
                    await self._send(plan)
                    return  # fill the pipeline before waiting on it
                if not self.in_flight:  # nothing to do until a request arrives (or a prefill can be admitted)
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), 0.05)
                    except asyncio.TimeoutError:
                        pass
                    return
            plan = self.in_flight[0].plan
            self._observe_costs()  # while the executor runs that step
            await self._finish_step()
        except Exception as exc:  # a bug, or a result that cannot be applied: contain it
            self._step_crashed(plan, exc)

    def _schedule(self) -> Plan | None:
        """The planner's next plan (built ahead when steps are in flight, and in flight from now on);
        fails the streams of requests it had to give up on."""
        plan = self.planner.schedule(time.monotonic())
        for failure in plan.failures if plan is not None else ():
            self._fail_stream(failure.request.request_id, grpc.StatusCode.RESOURCE_EXHAUSTED, failure.message)
        return plan

    async def _send(self, plan: Plan) -> None:
        """Send `plan` (the RPC runs as its own task) and queue it to be finished in order."""
        # Client ids name the timeline's tracks; decided now, before results change the requests.
        client_ids = {s.request_id: self.planner.requests[s.request_id].request_id for s in plan.scheduled}
        start = time.monotonic()
        context = contextvars.copy_context()
        scope = context.run(self.telemetry.begin_step, plan)
        context.run(scope.__enter__)  # the step's span (if tracing) is current: the RPC's metadata carries it
        call = context.run(asyncio.ensure_future, self.link.step(plan.to_pb()))
        self.in_flight.append(StepInFlight(plan, call, start, scope, context, client_ids))
        await asyncio.sleep(0)  # let the RPC go out before the next plan is built

    async def _finish_step(self) -> None:
        """Wait for the oldest step in flight and fold its result in."""
        step = self.in_flight[0]
        try:
            response = await step.call
        except grpc.aio.AioRpcError as exc:
            self.in_flight.popleft()
            step.context.run(self._step_failed, step, exc)
            self._lose_executor(step.plan, exc)
            return
        self.in_flight.popleft()
        step.context.run(self._finish_in_context, step, response)

    def _finish_in_context(self, step: StepInFlight, response: epb.StepResponse) -> None:
        step.scope.__exit__(None, None, None)
        try:
            self._apply_step(step.plan, response, step.start_s, step.plan.decode_ids, step.client_ids, step.scope)
        except Exception as exc:
            self.telemetry.step_failed(step.scope, exc)
            raise

    def _step_failed(self, step: StepInFlight, exc: Exception) -> None:
        step.scope.__exit__(None, None, None)
        self.telemetry.step_failed(step.scope, exc)

    def _cancel_in_flight(self) -> None:
        """Drop every step still in flight (the executor is being re-attached): their results would not apply."""
        while self.in_flight:
            step = self.in_flight.popleft()
            step.call.cancel()
            step.context.run(self._step_failed, step, asyncio.CancelledError("the executor is being re-attached"))

    def _apply_step(
        self,
        plan: Plan,
        response: epb.StepResponse,
        start: float,
        decode_ids: set[str],
        client_ids: dict[str, str],
        step_scope,
    ) -> None:
        """Fold the executor's answer in: cost model, planner state, client streams, the step history."""
        end = time.monotonic()
        results = [RequestResult.from_pb(r) for r in response.results]
        self.num_steps += 1
        self._unobserved.append(response)
        updates = self.planner.update_from_output(plan, results, response.num_free_kv_blocks, end)
        self._stream_updates(updates, end)
        self.num_generated_tokens += sum(len(u.new_token_ids) for u in updates)  # the tokens output
        self.history.append(self._step_record(plan, response, results, start, end, decode_ids, client_ids))
        self.telemetry.end_step(step_scope, self.history[-1], updates)

    def _observe_costs(self) -> None:
        """Refine the cost model with the measured executor times of the steps answered since the
        last call. The loop calls it once the next step is on its way, so a refit (a least-squares
        solve, ~0.3 ms here) runs beside the executor instead of between its steps; the plan sent
        meanwhile was priced without the newest step, as a plan built ahead always is."""
        while self._unobserved:
            response = self._unobserved.popleft()
            t = response.timings
            if response.num_computed_tokens and t.forward_s > 0:
                runs = max(1, response.num_runs)  # the counts and times are sums over the runs: observe their mean run
                self.planner.cost_model.observe(
                    response.num_computed_tokens / runs,
                    response.num_attention_pairs / runs,
                    (t.prepare_s + t.forward_s + t.sample_s) / runs,
                    response.num_logits_rows / runs
                    if response.num_requests
                    else 1,  # 0 requests: an executor that does not say
                    max(1.0, response.num_requests / runs),
                )

    def _stream_updates(self, updates: list[RequestUpdate], end: float) -> None:
        """New tokens to each request's client stream; end the streams of finished requests (a stop
        string found in the text ends one here)."""
        for update in updates:
            stream = self.streams.get(update.request.request_id)
            if stream is None or stream.request is not update.request:
                continue
            reason = update.finish_reason
            if update.new_token_ids:
                num_output = stream.push_tokens(update.new_token_ids, update.logprobs)
                if stream.has_stopped:
                    self._end_at_stop_string(update, num_output, end)
                    reason = FinishReason.STOP_STRING
            if reason is not None:
                stream.finish(reason)
                del self.streams[stream.request_id]

    def _end_at_stop_string(self, update: RequestUpdate, num_output: int, end: float) -> None:
        """A stop string matched: the request ends with the token that completed it. Tokens the
        step brought after that token are not output: neither kept nor counted."""
        request = update.request
        num_dropped = len(update.new_token_ids) - num_output
        if num_dropped:
            del request.output_token_ids[-num_dropped:]
            del update.new_token_ids[num_output:]
        if update.finish_reason is None:  # else the executor ended it in the same step
            self.planner.finish(request)
            request.finish_time = end

    @staticmethod
    def _step_record(
        plan: Plan,
        response: epb.StepResponse,
        results: list[RequestResult],
        start: float,
        end: float,
        decode_ids: set[str],
        client_ids: dict[str, str],
    ) -> StepRecord:
        t = response.timings
        runs = max(1, response.num_runs)
        records = step_request_records(plan.scheduled, decode_ids, results, client_ids)
        return StepRecord(
            step_id=plan.step_id,
            start_s=start,
            wall_s=end - start,
            num_requests=len(plan.scheduled),
            num_prefill_tokens=plan.num_scheduled_tokens - len(decode_ids),
            num_decode_tokens=sum(
                r.num_runs for r in results if r.request_id in decode_ids
            ),  # one per run (drafts aside)
            num_new_requests=len(plan.new_requests),
            num_preempted=len(plan.preempted),
            num_free_kv_blocks=response.num_free_kv_blocks,
            executor_forward_s=t.forward_s,
            executor_total_s=t.prepare_s + t.forward_s + t.sample_s,
            request_ids=tuple(client_ids[s.request_id] for s in plan.scheduled),
            num_draft_tokens=sum(r.num_draft_tokens for r in records),
            num_drafted_tokens=sum(r.num_drafted_tokens for r in results),
            num_accepted_tokens=sum(r.num_accepted_tokens for r in results),
            num_free_tokens=plan.num_free_tokens,
            predicted_step_s=plan.predicted_step_s * runs,
            executor_prepare_s=t.prepare_s,
            executor_sample_s=t.sample_s,
            requests=records,
            num_runs=runs,
            draft_depth=sum(r.draft_depth for r in records),
            num_draft_leaves=sum(r.num_draft_leaves for r in records),
        )

    # -------------------------------------------------------------- failures

    def _lose_executor(self, plan: Plan, exc: grpc.aio.AioRpcError) -> None:
        """The executor failed `plan`'s step. Its requests wait for the executor to come back, or
        end (ExecutorRecovery.judge says which); either way the loop re-attaches."""
        ending = self.recovery.judge(exc)
        if ending is not None:
            self._reset(*ending)
            return
        self._cancel_in_flight()  # a step planned after the failed one cannot run either
        self.recovery.wait_for_return(self.planner.fail_step(plan, StepFailure.EXECUTOR_LOST))
        self._detach()

    def _step_crashed(self, plan: Plan | None, exc: Exception) -> None:
        """A step raised: end its own requests with INTERNAL; the others go on.

        Releasing is idempotent on the executor (an unknown id is a no-op), so
        releasing the step's requests next step is right whether or not the plan
        reached the executor; the plan's own releases are sent again in case it did
        not. Without a plan (`schedule` itself raised) the planner may be left
        half-way, so everything is ended and the loop re-attaches under a new
        incarnation, which makes the executor drop all it held.
        """
        step = plan.step_id if plan is not None else None
        log.error("step_crashed", step_id=step, error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        message = (
            f"the scheduler failed step {step} ({type(exc).__name__}: {exc}); the request was ended. "
            "This is a bug: please report it with the scheduler's log"
        )
        if plan is None or self.planner is None:
            self._reset(grpc.StatusCode.INTERNAL, message)
            return
        is_in_flight = any(s.plan is plan for s in self.in_flight)
        self.planner.fail_step(plan, StepFailure.RAISED_IN_FLIGHT if is_in_flight else StepFailure.RAISED)
        # By the streams, not by what fail_step ended: applying the answer may have ended a request
        # the planner knows as finished, and whose stream had not been told yet.
        affected = plan.executor_request_ids
        for stream in [s for s in self.streams.values() if s.request.executor_request_id in affected]:
            self._fail_stream(stream.request_id, grpc.StatusCode.INTERNAL, message)
        self._wake.set()

    def _reset(self, code: grpc.StatusCode, message: str) -> None:
        """End every request in flight and re-attach under a new incarnation."""
        self.recovery.forget_orphans()
        self._cancel_in_flight()
        if self.planner is not None:
            self.planner.fail_step(None, StepFailure.EXECUTOR_RESET)
        for request_id in list(self.streams):
            self._fail_stream(request_id, code, message)
        self._detach()

    def _detach(self) -> None:
        """Forget the executor and its planner: the loop re-attaches."""
        self.planner = None
        self.link.detach()
        self._connected.clear()

    def _stopped(self, exc: BaseException) -> None:
        """The loop task is ending (cancelled at shutdown, or a bug the supervisor could not contain)."""
        if isinstance(exc, asyncio.CancelledError):
            self.stopped_reason = "the scheduler is shutting down"
            code = grpc.StatusCode.UNAVAILABLE
        else:
            log.critical("step_loop_died", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
            self.stopped_reason = f"the scheduler's step loop stopped ({type(exc).__name__}: {exc})"
            code = grpc.StatusCode.INTERNAL
        self._connected.set()  # wake handlers waiting for a connection: they see `stopped_reason`
        self._cancel_in_flight()
        for request_id in list(self.streams):
            self._fail_stream(request_id, code, f"{self.stopped_reason}; the request was lost")

    def _fail_stream(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.fail(code, message)
