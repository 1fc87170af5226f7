"""The step loop without sockets or a model: its executor link answers plans the way the engine
accounts for them (tests/scheduler/test_planner.py's FakeExecutor, over the executor's messages),
and its planner records who calls it.

- Each step calls the planner in two places, `schedule` and `update_from_output`, with
  one step in flight or two; every plan scheduled is answered, in order.
- A step the executor fails as unreachable (it restarted) goes to the planner as one
  `fail_step`; the streams wait for the executor and go on token for token.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.planner import Plan, Planner, StepFailure
from scheduler_svc.request import Request
from scheduler_svc.request_stream import RequestStream, StreamError
from scheduler_svc.step_loop import StepLoop
from service_common.sampling_params import SamplingParams
from swarmserve.executor.v1 import executor_pb2 as epb

TIMEOUT_S = 10.0  # any wait here is milliseconds when things work; this only turns a hang into a failure
BLOCK = 4
VOCAB = 64
TOKENIZER = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))


def token_at(position: int) -> int:
    """The fake model's token at a sequence position: any executor, any batch, the same token."""
    return 10 + position % (VOCAB - 10)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeLink:
    """An ExecutorLink whose executor runs in this process and computes no model: tokens, KV blocks
    and finishes as the engine accounts for them. `restart_at_step(n)`: the n-th Step call fails
    UNAVAILABLE and the executor comes back empty, as a restarted one does."""

    address = "fake-executor"

    def __init__(self, num_kv_blocks: int = 1000) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.info: epb.GetInfoResponse | None = None
        self.limits = None
        self.sent: list[epb.StepRequest] = []
        self.num_attaches = 0
        self._restart_at = 0
        self._forget()

    @property
    def is_connected(self) -> bool:
        return self.info is not None

    def restart_at_step(self, n: int) -> None:
        self._restart_at = n

    async def wait_until_disconnected(self) -> None:
        """A fake connection never drops on its own: its failures come from steps."""
        await asyncio.Event().wait()

    async def attach(self) -> epb.GetInfoResponse:
        self.num_attaches += 1
        self._forget()  # an attach releases whatever the executor held
        self.info = epb.GetInfoResponse(
            model_name="fake",
            vocab_size=VOCAB,
            context_length=4096,
            kv_block_size=BLOCK,
            num_kv_blocks=self.num_kv_blocks,
            num_free_kv_blocks=self.num_kv_blocks,
            max_num_batched_tokens=64,
            executor_id=f"fake-{self.num_attaches}",
        )
        return self.info

    def detach(self) -> None:
        self.info = None

    async def step(self, request: epb.StepRequest) -> epb.StepResponse:
        self.sent.append(request)
        await asyncio.sleep(0)  # answered later, as over a socket: a second plan can be built meanwhile
        if len(self.sent) == self._restart_at:
            self._forget()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "the executor restarted")
        return self._run(request)

    def _forget(self) -> None:
        self.known: dict[str, int] = {}  # tokens the executor holds for a request (prompt + output)
        self.computed: dict[str, int] = {}
        self.outputs: dict[str, int] = {}
        self.max_new: dict[str, int] = {}
        self.blocks: dict[str, int] = {}

    def _run(self, request: epb.StepRequest) -> epb.StepResponse:
        for rid in [*request.released, *request.preempted]:
            self.blocks.pop(rid, None)
            self.computed[rid] = 0
        for rid in request.released:
            self.known.pop(rid, None)
        for new in request.new_requests:
            self.known[new.request_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.computed[new.request_id] = 0
            self.outputs[new.request_id] = len(new.output_token_ids)
            self.max_new[new.request_id] = new.max_new_tokens
        results = []
        for s in request.scheduled:
            rid, n = s.request_id, s.num_tokens
            if request.planned_after_step_id:  # built ahead: clamped to what is left, finished ones skipped
                if rid not in self.known:
                    continue
                n = min(n, self.known[rid] - self.computed[rid])
            elif rid not in self.known or self.computed[rid] + n > self.known[rid]:
                raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"{rid}: {n} tokens is past what it holds")
            self.computed[rid] += n
            self.blocks[rid] = math.ceil(self.computed[rid] / BLOCK)
            result = epb.RequestResult(request_id=rid, num_computed_tokens=self.computed[rid])
            if self.computed[rid] == self.known[rid]:  # its last known token computed: it samples one
                result.new_token_ids.append(token_at(self.known[rid]))
                self.known[rid] += 1
                self.outputs[rid] += 1
                if self.outputs[rid] == self.max_new[rid]:
                    result.finish_reason = epb.FINISH_REASON_LENGTH
                    del self.known[rid], self.blocks[rid]
            result.num_exclusive_kv_blocks = self.blocks.get(rid, 0)
            results.append(result)
        return epb.StepResponse(
            step_id=request.step_id,
            results=results,
            num_free_kv_blocks=self.num_kv_blocks - sum(self.blocks.values()),
            num_runs=1,
        )


class CallRecorder:
    """The planner, recording every method called on it (name, arguments, what it returned)."""

    def __init__(self, planner: Planner) -> None:
        self._planner = planner
        self.calls: list[tuple[str, tuple, object]] = []

    def __getattr__(self, name: str):
        value = getattr(self._planner, name)
        if not callable(value):
            return value

        def record(*args, **kwargs):
            returned = value(*args, **kwargs)
            self.calls.append((name, args, returned))
            return returned

        return record

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]


def submit(loop: StepLoop, request_id: str, num_prompt_tokens: int, max_new_tokens: int) -> RequestStream:
    prompt = [token_at(i) for i in range(num_prompt_tokens)]
    request = Request(
        request_id,
        prompt,
        SamplingParams(),
        max_new_tokens,
        ignore_eos=True,
        executor_request_id=f"{request_id}-1",
    )
    stream = RequestStream(request, TOKENIZER, [], include_special_tokens=False)
    loop.submit(stream)
    return stream


async def tokens_of(stream: RequestStream) -> list[int]:
    """The stream's tokens once it has ended; raises if it failed."""
    tokens = []
    while True:
        event = await stream.events.get()
        if isinstance(event, StreamError):
            raise AssertionError(f"{stream.request_id} failed: {event.code.name}: {event.message}")
        if event.HasField("final"):
            return tokens
        tokens.extend(event.delta.token_ids)


async def serve(loop: StepLoop, requests: dict[str, tuple[int, int]]) -> tuple[CallRecorder, dict[str, list[int]]]:
    """Run the loop until `requests` (id -> (prompt tokens, max new tokens)) have ended; returns
    the first planner's recorder and each request's tokens."""
    task = asyncio.create_task(loop.run())
    try:
        assert await loop.wait_connected(TIMEOUT_S)
        recorder = CallRecorder(loop.planner)
        loop.planner = recorder
        streams = {rid: submit(loop, rid, *sizes) for rid, sizes in requests.items()}
        tokens = await asyncio.wait_for(asyncio.gather(*(tokens_of(s) for s in streams.values())), TIMEOUT_S)
        return recorder, dict(zip(streams, tokens, strict=True))
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


REQUESTS = {"a": (5, 9), "b": (13, 6), "c": (30, 12)}  # prompts over several 16-token chunks, and decodes


def expected_tokens() -> dict[str, list[int]]:
    return {rid: [token_at(p + i) for i in range(n)] for rid, (p, n) in REQUESTS.items()}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
def test_each_step_calls_the_planner_in_two_places(async_scheduling):
    config = SchedulerConfig(async_scheduling=async_scheduling, max_num_batched_tokens=16, spec="off")
    link = FakeLink()
    loop = StepLoop(config, link)
    recorder, tokens = asyncio.run(serve(loop, REQUESTS))

    assert tokens == expected_tokens()
    # Beside the three submissions (`add`), the loop called `schedule` and `update_from_output` only.
    names = [name for name in recorder.names() if name != "add"]
    assert recorder.names().count("add") == len(REQUESTS)
    assert set(names) == {"schedule", "update_from_output"}
    # Every plan it sent was scheduled once and answered once, in the order it was scheduled.
    scheduled = [p for name, _, p in recorder.calls if name == "schedule" and p is not None and not p.is_empty]
    answered = [args[0] for name, args, _ in recorder.calls if name == "update_from_output"]
    assert [p.step_id for p in answered] == [p.step_id for p in scheduled] == [r.step_id for r in link.sent]
    assert names.count("update_from_output") == loop.num_steps == len(link.sent)
    assert not recorder.in_flight
    # With overlapped scheduling some plans really were built while another step ran.
    assert any(r.planned_after_step_id for r in link.sent) == async_scheduling


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
def test_a_lost_executor_fails_the_step_once_and_the_streams_go_on(async_scheduling):
    config = SchedulerConfig(async_scheduling=async_scheduling, max_num_batched_tokens=16, spec="off")
    link = FakeLink()
    link.restart_at_step(4)  # mid-prefill for c, mid-decode for a and b
    loop = StepLoop(config, link)
    recorder, tokens = asyncio.run(serve(loop, REQUESTS))

    assert tokens == expected_tokens()  # no token repeated or missing across the restart
    assert link.num_attaches == 2
    failures = [(args, returned) for name, args, returned in recorder.calls if name == "fail_step"]
    assert len(failures) == 1
    (plan, failure), requests = failures[0]
    assert isinstance(plan, Plan) and plan.step_id == link.sent[3].step_id and failure is StepFailure.EXECUTOR_LOST
    assert sorted(r.request_id for r in requests) == sorted(REQUESTS)  # every live request waited for the executor
    assert set(recorder.names()) == {"add", "schedule", "update_from_output", "fail_step"}
    assert recorder.names()[-1] == "fail_step"  # the lost executor's planner is done with
