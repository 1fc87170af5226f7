"""Losing the executor and getting it back: what the step loop does between executors.

Streams survive the executor: when a step finds it unreachable (it crashed or
restarted), the loop keeps every request and re-attaches; once the executor is
back, each request is sent again as its prompt plus the tokens already streamed,
and its stream goes on with no error and no repeated or missing text (greedy and
seeded sampling continue token for token: the executor's random numbers are keyed
by output position). New requests wait meanwhile. A restarted executor listens while
it loads and calibrates, its health NOT_SERVING: a sign of life that restarts the
wait, so streams wait however long a start takes on a busy machine. Only after
`executor_reconnect_timeout_s` with no sign of the executor do they end with UNAVAILABLE.

`ExecutorRecovery` holds what crosses the gap: the lost executor's requests (the
orphans), since when they wait, and the model they were generated with (another
model cannot continue them). It judges what a failed step means, attaches (a new
planner for the executor that answered, holding the orphans), and ends the streams
that cannot wait any longer. The step loop keeps the streams and the steps in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import structlog

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.cost_model import CostModel, StepTimeSample
from scheduler_svc.executor_link import ExecutorLink
from scheduler_svc.planner import Planner
from scheduler_svc.request import Request
from scheduler_svc.request_stream import RequestStream
from swarmserve.executor.v1 import executor_pb2 as epb

log = structlog.get_logger()

RECONNECT_BACKOFF_S = (0.1, 0.2, 0.5, 1.0)

# A step failing with one of these leaves the executor unreachable: its requests may wait for it.
# FAILED_PRECONDITION: the executor restarted (it does not know us) or another scheduler took
# it over; which one, the re-attach tells (see `ExecutorRecovery.attach`).
LOST_CODES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.FAILED_PRECONDITION,
)


def reconnect_backoff_s(attempt: int) -> float:
    """How long to wait after `attempt` failed attaches in a row."""
    return RECONNECT_BACKOFF_S[min(attempt, len(RECONNECT_BACKOFF_S) - 1)]


def _calibration_sample(c: epb.CostSample) -> StepTimeSample:
    """A start-up measurement in the terms of real steps (an older executor reports forward time only)."""
    if not c.num_requests:
        return StepTimeSample(c.num_tokens, c.num_attention_pairs, c.forward_s)
    return StepTimeSample(
        c.num_tokens, c.num_attention_pairs, c.step_s or c.forward_s, c.num_logits_rows, c.num_requests
    )


class ExecutorRecovery:
    """The step loop's executor across losses. `streams` is the loop's own table (read here);
    `fail_stream(request_id, code, message)` ends one of them."""

    def __init__(
        self,
        config: SchedulerConfig,
        link: ExecutorLink,
        streams: dict[str, RequestStream],
        fail_stream: Callable[[str, grpc.StatusCode, str], None],
    ) -> None:
        self.config = config
        self.link = link
        self._streams = streams
        self._fail_stream = fail_stream
        self.last_connect_error = ""
        self._orphans: list[Request] = []  # live requests of a lost executor, to send to the next one
        # When the executor was lost with requests in flight, or last seen starting again since.
        self._lost_since: float | None = None
        self._lost_model: tuple[str, int] | None = None  # (name, vocab size) they were generated with

    def connect_wait_s(self, grace_s: float) -> float:
        """How long a new request waits for the executor: `grace_s`, or while streams of a
        lost executor wait for it to come back, as long as they may still wait."""
        if self._lost_since is None:
            return grace_s
        return max(grace_s, self.config.executor_reconnect_timeout_s - (time.monotonic() - self._lost_since))

    async def attach(self) -> Planner | None:
        """Attach once: a planner for the executor that answered, holding the requests that waited
        for it; None if none did (`last_connect_error` says why)."""
        try:
            info = await self.link.attach()
        except grpc.aio.AioRpcError as exc:
            self.last_connect_error = f"{exc.code().name}: {exc.details()}"
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and self._orphans:
                # Another scheduler has the executor: the requests waiting for it will not get it back.
                self._end_orphans(
                    f"the executor at {self.link.address} refuses this scheduler ({self.last_connect_error})"
                )
            return None
        except Exception as exc:  # e.g. a tokenizer the scheduler cannot load: keep retrying, say why
            log.exception("attach_failed", executor=self.link.address)
            self.last_connect_error = f"{type(exc).__name__}: {exc}"
            self.link.detach()
            return None
        cost_model = CostModel(calibration=[_calibration_sample(c) for c in info.calibration if c.forward_s > 0])
        planner = Planner(
            self.config,
            info.kv_block_size,
            info.num_kv_blocks,
            info.max_num_batched_tokens,
            cost_model=cost_model,
            max_draft_tokens=info.max_draft_tokens,
            num_state_slots=info.num_state_slots,
            preferred_step_tokens=info.preferred_step_tokens,
        )
        planner.num_free_blocks = info.num_free_kv_blocks
        self.last_connect_error = ""
        self._resubmit_orphans(planner, info)
        log.info(
            "executor_attached",
            executor=self.link.address,
            model=info.model_name,
            kv_blocks=info.num_kv_blocks,
            step_tokens=planner.token_budget,
            released_leftovers=info.num_released_requests,
        )
        return planner

    def judge(self, exc: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str] | None:
        """A step failed on the executor: None if its requests may wait for the executor's return
        (unreachable or restarted, and reconnecting is on), else the status and message they end with
        (refused: a bug, bad state, another scheduler took over)."""
        code = exc.code()
        log.error("step_failed", code=code.name, details=exc.details())
        lost = code in LOST_CODES
        if lost and self.config.executor_reconnect_timeout_s > 0:
            return None
        status = grpc.StatusCode.UNAVAILABLE if lost else grpc.StatusCode.INTERNAL
        message = (
            f"the executor at {self.link.address} failed a step ({code.name}: {exc.details()}); the request was lost"
        )
        return status, message

    def wait_for_return(self, requests: list[Request]) -> None:
        """The executor is lost: keep its live requests (streaming still) for the next attach."""
        info = self.link.info
        self._orphans = requests
        self._lost_since = time.monotonic()
        self._lost_model = (info.model_name, info.vocab_size) if info is not None else None
        log.warning("executor_lost", executor=self.link.address, requests_waiting=len(requests))

    def forget_orphans(self) -> None:
        """Every stream is being ended (the executor is reset): no request waits any longer."""
        self._orphans, self._lost_since = [], None

    async def executor_is_starting(self) -> bool:
        """Whether the lost executor's process is starting again (listening, health NOT_SERVING
        while it loads and calibrates): a sign of life. The reconnect window counts from the last
        one, so the streams wait however long a start takes on a busy machine, and end only when
        the executor stays unreachable for `executor_reconnect_timeout_s`."""
        if self._lost_since is None or not await self.link.is_starting():
            return False
        if time.monotonic() - self._lost_since > 1.0:  # log once in a while, not at every poll
            log.info("executor_starting", executor=self.link.address, requests_waiting=len(self._orphans))
        self._lost_since = time.monotonic()
        return True

    def give_up_if_waited_too_long(self) -> None:
        """Still no executor: once the streams have waited long enough, end them."""
        if self._lost_since is None:
            return
        waited = time.monotonic() - self._lost_since
        if waited < self.config.executor_reconnect_timeout_s:
            return
        self._end_orphans(
            f"the executor at {self.link.address} has been unreachable for {waited:.0f} s and has not come back "
            f"({self.last_connect_error or 'unreachable'}; executor_reconnect_timeout_s="
            f"{self.config.executor_reconnect_timeout_s:g})"
        )

    def _resubmit_orphans(self, planner: Planner, info: epb.GetInfoResponse) -> None:
        """Re-attached after losing the executor: queue its requests (still streaming) again."""
        orphans, self._orphans, self._lost_since = self._orphans, [], None
        live = [r for r in orphans if (s := self._streams.get(r.request_id)) is not None and s.request is r]
        if not live:
            return
        if self._lost_model != (info.model_name, info.vocab_size):
            for request in live:
                self._fail_stream(
                    request.request_id,
                    grpc.StatusCode.UNAVAILABLE,
                    f"the executor came back with another model ({info.model_name}); the request was lost",
                )
            return
        for request in live:
            planner.add(request)
        log.info("requests_resubmitted", num_requests=len(live))

    def _end_orphans(self, reason: str) -> None:
        """The requests waiting for a lost executor will not get one: end their streams."""
        self._orphans, self._lost_since = [], None
        for request_id in list(self._streams):
            self._fail_stream(request_id, grpc.StatusCode.UNAVAILABLE, f"{reason}; the request was lost")
