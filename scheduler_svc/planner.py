"""The scheduler's pure core: who runs next step, and how many tokens each computes.

**The contract: two calls per step, one for a failed step** (as vLLM's
`schedule` / `update_from_output`; the step loop is the only caller):

- `schedule(now) -> Plan | None`: the next step. The plan is in flight from then
  on (the next one is built ahead of it) and its requests' queue time ends at
  `now`; the requests it had to end for lack of KV ride along in `plan.failures`.
  None: it cannot be built ahead of the steps in flight (ask again once one has
  answered).
- `update_from_output(plan, results, num_free_blocks, now) -> updates`: the
  executor answered `plan` (answers come in the order plans were scheduled). Its
  releases are confirmed, each request mirrors what the executor reports, and the
  live requests' new tokens and finishes come back for their streams.
- `fail_step(plan, failure) -> requests`: the step failed; `StepFailure` says how,
  and so what of the planner outlives it.

Beside the steps, a request's life: `add` queues one, `finish` ends one the
scheduler decided to end (a stop string), `abort` ends one by id; the ends go to
the executor as the next plan's releases.

No sockets, no model: requests and the executor's KV report go in, a `Plan`
comes out, and the step's results go back in. Tests drive it with fake results
(see tests/scheduler/test_planner.py).

Each step, under one token budget (`max_num_batched_tokens`):
1. **Decodes first.** Every running request with exactly one pending token (its
   last sampled token) gets 1 token. If the KV cache cannot grow for it, the
   newest running requests are preempted (KV freed, tokens kept, recomputed
   later) until it fits — a running request is never failed for lack of KV.
2. **Prefill chunks.** Running requests still prefilling (a prompt, or
   prompt + output after a preemption) get what is left of the budget, oldest
   first, cut to what the free KV holds.
3. **Admission.** Waiting requests join in FIFO order while the batch has room,
   budget is left, and the KV cache can hold the whole prompt plus a watermark
   (KV-aware admission: a request is only admitted if it can finish its prefill).
4. **Draft budgets.** What budget and KV remain go to speculative drafts of the
   decoding requests, as the draft policy decides from the cost model, each
   request's acceptance estimate and what its drafter can propose.

While requests decode, prefill chunks (2 and 3) are also capped so the cost
model predicts the step within the decode-latency target, but a prefill always
gets at least half of the step (`_prefill_budget` states the rule).

Plans and results name requests by `Request.executor_request_id` (unique per
submission), never by the client's id; `requests` is keyed the same way.

`static` batching fixes the batch when it forms and admits no one until every
member has finished: the naive baseline continuous batching is measured against.

**Overlapped scheduling**: while plans are in flight (`in_flight`), the next one
is built ahead of them, from the state they are expected to leave
(`_expect_in_flight`): each scheduled request's tokens go into KV, and one that
reaches its last known token samples one more, so a prefill that ends becomes a
decode and a decode stays one. The executor makes this exact (see the proto's
`planned_after_step_id`): it clamps each `num_tokens` to what is really left and
skips requests it has finished meanwhile. What cannot be planned ahead is not:
a plan that would have to preempt or fail a running request returns None, and
the caller plans it again once the step in flight has answered. KV is counted
pessimistically ahead: the blocks in-flight plans reserved are taken off the last
report, and one more block per running request covers accepted drafts.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from scheduler_svc.acceptance import AcceptanceTracker
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.cost_model import CostModel
from scheduler_svc.draft_policy import DraftAllocation, DraftCandidate, DraftStep, parse_draft_policy
from scheduler_svc.request import Request, RequestStatus
from service_common.attention_pairs import attention_pairs
from service_common.finish_reason import FinishReason
from swarmserve.executor.v1 import executor_pb2 as epb

RECENT_ENDED_REQUESTS = 64  # ended requests whose tokens the planner keeps to guess a newcomer's prefix hits


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of a and b (compared 256 tokens at a time)."""
    n, i = min(len(a), len(b)), 0
    while i + 256 <= n and a[i : i + 256] == b[i : i + 256]:
        i += 256
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str  # the executor's id for the request (Request.executor_request_id)
    num_tokens: int
    draft_budget: int = 0

    def to_pb(self) -> epb.ScheduledRequest:
        return epb.ScheduledRequest(
            request_id=self.request_id, num_tokens=self.num_tokens, draft_budget=self.draft_budget
        )


@dataclass
class Plan:
    step_id: int
    new_requests: list[Request] = field(default_factory=list)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    planned_after_step_id: int = 0  # the step in flight this plan was built ahead of (0: none)
    decode_ids: set[str] = field(default_factory=set)  # scheduled requests that decode (the rest prefill)
    predicted_step_s: float = 0.0  # the cost model's executor time for the step as planned
    num_reserved_blocks: int = 0  # KV blocks the plan may take (drafts and whole prompts included)
    num_free_tokens: int = 0  # the free-token budget S the draft policy saw (0 without speculation)
    max_runs: int = 1  # runs in one call: decodes only may run again, a token per request per run
    failures: list[RequestFailure] = field(default_factory=list)  # requests ended for lack of KV (not sent)

    @property
    def is_empty(self) -> bool:
        """Nothing for the executor: not sent, and not in flight (`failures` are the scheduler's own)."""
        return not (self.new_requests or self.scheduled or self.released or self.preempted)

    @property
    def executor_request_ids(self) -> set[str]:
        """Every request the plan names (executor ids): scheduled, new or preempted."""
        return (
            {s.request_id for s in self.scheduled}
            | {r.executor_request_id for r in self.new_requests}
            | set(self.preempted)
        )

    def to_pb(self) -> epb.StepRequest:
        """The plan as the executor's StepRequest: new requests whole, the rest by id."""
        return epb.StepRequest(
            step_id=self.step_id,
            new_requests=[r.to_pb() for r in self.new_requests],
            scheduled=[s.to_pb() for s in self.scheduled],
            released=self.released,
            preempted=self.preempted,
            planned_after_step_id=self.planned_after_step_id,
            max_runs=self.max_runs,
        )

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass(frozen=True)
class RequestResult:
    """What the executor reported for one request, as plain data."""

    request_id: str  # the executor's id for the request (Request.executor_request_id)
    new_token_ids: list[int]
    finish_reason: FinishReason | None  # from the executor: eos | stop_token | length | context_full
    num_computed_tokens: int
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    num_cached_tokens: int = 0
    num_draftable_tokens: int = 0
    num_exclusive_blocks: int = 0
    logprobs: list[epb.TokenLogprob] = field(default_factory=list)  # streamed to the client as they are
    num_runs: int = 1  # runs of the plan it took part in: its draft budget held in each
    # The verified drafts' shape, summed over the runs (num_drafted_tokens counts their nodes).
    draft_depth: int = 0
    num_draft_leaves: int = 0
    expected_num_accepted_tokens: float = 0.0  # what the drafter expected of the verified trees (0: chains)
    expected_accepted_tokens_by_nodes: tuple[float, ...] = ()  # E(n) of next step's tree, if it branches
    num_draft_misses: int = 0  # runs whose draft stopped short of its depth (one rejected token each)

    @classmethod
    def from_pb(cls, msg: epb.RequestResult) -> RequestResult:
        return cls(
            request_id=msg.request_id,
            new_token_ids=list(msg.new_token_ids),
            finish_reason=FinishReason.from_pb(epb.FinishReason, msg.finish_reason),
            num_computed_tokens=msg.num_computed_tokens,
            num_drafted_tokens=msg.num_drafted_tokens,
            num_accepted_tokens=msg.num_accepted_tokens,
            num_cached_tokens=msg.num_cached_tokens,
            num_draftable_tokens=msg.num_draftable_tokens,
            num_exclusive_blocks=msg.num_exclusive_kv_blocks,
            logprobs=list(msg.logprobs),
            num_runs=max(1, msg.num_runs),
            draft_depth=msg.draft_depth,
            num_draft_leaves=msg.num_draft_leaves,
            expected_num_accepted_tokens=msg.expected_num_accepted_tokens,
            expected_accepted_tokens_by_nodes=tuple(msg.expected_accepted_tokens_by_nodes),
            num_draft_misses=msg.num_draft_misses,
        )


@dataclass(frozen=True)
class RequestUpdate:
    request: Request
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list


@dataclass(frozen=True)
class RequestFailure:
    request: Request
    message: str


class StepFailure(enum.Enum):
    """How a step failed, which decides what of the planner outlives it (see `Planner.fail_step`)."""

    RAISED = "raised"  # the scheduler raised sending the plan or applying its answer: no answer will be applied
    RAISED_IN_FLIGHT = "raised_in_flight"  # the scheduler raised while the step ran: its answer is still to come
    EXECUTOR_LOST = "executor_lost"  # unreachable or restarted: its state is gone, and it may come back
    EXECUTOR_RESET = "executor_reset"  # refused the step, or is made to drop all it holds (a new incarnation)


@dataclass
class _Room:
    """What the plan being built may still take: free KV blocks and tokens. Decodes and drafts
    take from `num_tokens`; prefill chunks and admissions take from both it and
    `num_prefill_tokens`, their own (possibly smaller) share of it, and a prompt that ends within
    `num_stretch_tokens` past that share may take them too (Planner.step_stretch)."""

    num_free_blocks: int
    num_tokens: int
    num_prefill_tokens: int = 0
    num_stretch_tokens: int = 0
    has_prefill: bool = False  # a prefill chunk or admission has taken tokens this step

    def fits_whole(self, num_remaining: int) -> bool:
        """Whether a prompt with `num_remaining` tokens still to compute ends in this step: within
        the prefill share plus the stretch."""
        return num_remaining <= self.num_prefill_tokens + self.num_stretch_tokens

    def prefill_tokens_for(self, num_remaining: int) -> int:
        """Tokens such a prompt takes this step: all of them where it ends in it, else the share."""
        return num_remaining if self.fits_whole(num_remaining) else self.num_prefill_tokens

    def take_prefill(self, num_tokens: int, num_blocks: int) -> None:
        over = max(0, num_tokens - self.num_prefill_tokens)
        self.num_stretch_tokens -= over
        self.num_tokens = max(0, self.num_tokens - num_tokens)
        self.num_prefill_tokens = max(0, self.num_prefill_tokens - num_tokens)
        self.num_free_blocks -= num_blocks
        self.has_prefill = True


class _CannotPlanAhead(Exception):
    """The plan would preempt or fail a running request: plan it once the step in flight has answered."""


# The step budget when neither the flag nor the executor names one (an executor from before
# GetInfoResponse.preferred_step_tokens).
DEFAULT_STEP_TOKENS = 256
# How far past the executor's preferred step budget a step may go to end a prompt (Planner.step_stretch).
PREFILL_STRETCH = 0.25


def step_tokens(config: SchedulerConfig, preferred_step_tokens: int) -> int:
    """Tokens per step: `--max-num-batched-tokens` where given, else what the executor prefers
    (its kernels know where their prompt chunks reach their speed), else 256."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    return preferred_step_tokens or DEFAULT_STEP_TOKENS


class Planner:
    def __init__(
        self,
        config: SchedulerConfig,
        block_size: int,
        num_kv_blocks: int,
        max_num_batched_tokens: int,
        cost_model: CostModel | None = None,
        max_draft_tokens: int = 0,
        num_state_slots: int = 0,
        preferred_step_tokens: int = 0,
    ) -> None:
        self.config = config
        # A hybrid model's executor computes a request only while it holds one of its
        # recurrent-state slots (0: no such limit), so no more requests run than it has.
        self.max_running_requests = min(config.max_running_requests, num_state_slots or config.max_running_requests)
        self.cost_model = cost_model or CostModel()
        self.draft_policy = parse_draft_policy(config.spec)
        self.max_draft_tokens = max_draft_tokens
        self.acceptance = AcceptanceTracker()
        self.last_allocation: DraftAllocation | None = None
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.num_free_blocks = num_kv_blocks
        self.token_budget = min(step_tokens(config, preferred_step_tokens), max_num_batched_tokens)
        # Tokens a step may run past the budget the executor prefers so that a prompt ends in it
        # instead of leaving a remainder to the next step (none past a --max-num-batched-tokens
        # the user set: that is a cap). See _schedule_prefill_chunks.
        stretch = 0 if config.max_num_batched_tokens is not None else int(PREFILL_STRETCH * self.token_budget)
        self.step_stretch = max(0, min(stretch, max_num_batched_tokens - self.token_budget))
        self.watermark_blocks = math.ceil(config.kv_watermark * num_kv_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}  # live requests by executor id
        # Ended by the scheduler, and the executor has not yet confirmed the release (by executor id).
        self.releasing: dict[str, Request] = {}
        self._failures: list[RequestFailure] = []  # handed over with the next plan
        self._to_release: list[str] = []
        self._static_batch: set[str] = set()
        self._step_id = 0
        self.in_flight: deque[Plan] = deque()  # sent, not answered yet, oldest first (overlapped scheduling)
        # The tokens of the last requests that ended: a newcomer's likely prefix hits (an agent's next turn).
        self._ended_tokens: deque[list[int]] = deque(maxlen=RECENT_ENDED_REQUESTS)

    # ------------------------------------------------------------------ queue

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_queued(self) -> int:
        """Requests waiting beyond the batch's free places: those the next step cannot take in.
        The queue cap counts these, so whether a burst is refused does not depend on whether a
        step was planned between its requests (one about to enter the batch is not queued)."""
        free_places = max(0, self.max_running_requests - len(self.running))
        return max(0, len(self.waiting) - free_places)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._to_release)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request of this many tokens fits in the whole KV cache at all."""
        return self.blocks_for(num_tokens) <= self.num_kv_blocks - self.watermark_blocks

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt and output) one request can ever hold: can_ever_fit's bound."""
        return (self.num_kv_blocks - self.watermark_blocks) * self.block_size

    def add(self, request: Request) -> None:
        if request.executor_request_id in self.requests:
            raise ValueError(
                f"request {request.request_id!r}: executor id {request.executor_request_id!r} is already in flight"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.executor_request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request) -> None:
        """End a request the scheduler decided to end (stop string, abort, failure)."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self._ended_tokens.append(request.prompt_token_ids + request.output_token_ids)
        self.acceptance.forget(request.executor_request_id)
        if request.is_known_to_executor:
            self._to_release.append(request.executor_request_id)
            self.releasing[request.executor_request_id] = request
            request.is_known_to_executor = False
        self.requests.pop(request.executor_request_id, None)
        self._static_batch.discard(request.executor_request_id)

    def abort(self, executor_request_id: str) -> Request | None:
        request = self.requests.get(executor_request_id)
        if request is None:
            return None
        self.finish(request)
        return request

    def is_releasing(self, client_request_id: str) -> bool:
        """Whether a request with this client id ended but the executor may still hold it.

        Until the step carrying its release comes back, a step in flight may still
        report on it; the id is refused meanwhile so the client cannot mistake one for the other.
        """
        return any(r.request_id == client_request_id for r in self.releasing.values())

    # --------------------------------------------------------------- planning

    def schedule(self, now: float) -> Plan | None:
        """The next step's plan, in flight from now on; None if it cannot be built ahead of the
        plans in flight (ask again once one has answered).

        With plans in flight it is built ahead of them (see the module docstring). Its
        requests' queue time ends at `now` (`Request.first_scheduled_time`). Requests it had
        to end for lack of KV are in `plan.failures`: the caller ends their streams. An
        empty plan (nothing to run or release) is not sent, so it is not in flight.
        """
        ahead = bool(self.in_flight)
        self._expect_in_flight()
        self._step_id += 1
        plan = Plan(step_id=self._step_id, released=self._to_release)
        self._to_release = []
        try:
            self._schedule(plan, ahead)
        except _CannotPlanAhead:
            self._step_id -= 1
            self._to_release = plan.released + self._to_release
            return None
        plan.failures, self._failures = self._failures, []
        if not plan.is_empty:
            self._mark_scheduled(plan, now)
            self.in_flight.append(plan)
        return plan

    def _expect_in_flight(self) -> None:
        """Set each running request's in-flight counts from the plans sent but not answered yet.

        The executor computes min(num_tokens, tokens not yet in KV) of a plan
        built ahead, so the same clamp here keeps the expectation exact whatever
        the earlier plans turned out to do (prefix hits only shorten a prefill;
        accepted drafts leave a decode with one pending token, like rejected ones).
        """
        for request in self.running:
            request.num_in_flight_tokens = request.num_in_flight_samples = 0
        for plan in self.in_flight:
            for s in plan.scheduled:
                request = self.requests.get(s.request_id)
                if request is None or request.status != RequestStatus.RUNNING:
                    continue
                n = min(s.num_tokens, request.num_pending_tokens)
                request.num_in_flight_tokens += n
                if request.num_pending_tokens == 0:  # the step computes its last known token: it samples one
                    request.num_in_flight_samples += 1

    def _schedule(self, plan: Plan, ahead: bool) -> None:
        # Blocks of requests released by this plan come back only in the next report.
        room = _Room(self.num_free_blocks, self.token_budget)
        if ahead:
            plan.planned_after_step_id = self.in_flight[-1].step_id
            room.num_free_blocks -= sum(p.num_reserved_blocks for p in self.in_flight) + len(self.running)
        free_at_start = room.num_free_blocks
        scheduled: dict[str, int] = {}  # tokens to compute by executor request id, in scheduling order
        self._schedule_decodes(plan, scheduled, room, ahead)
        room.num_prefill_tokens = self._prefill_budget(scheduled, room.num_tokens)
        room.num_stretch_tokens = self.step_stretch if room.num_prefill_tokens == room.num_tokens else 0
        self._schedule_prefill_chunks(scheduled, room)
        self._admit_waiting(plan, scheduled, room)
        drafts, room.num_free_blocks = self._draft_budgets(scheduled, room.num_tokens, room.num_free_blocks)
        plan.scheduled = [ScheduledRequest(rid, n, drafts.get(rid, 0)) for rid, n in scheduled.items()]
        plan.decode_ids = {rid for rid, n in scheduled.items() if n == 1 and self.requests[rid].num_pending_tokens == 1}
        plan.num_reserved_blocks = free_at_start - room.num_free_blocks
        plan.predicted_step_s = self._predict(plan)
        plan.num_free_tokens = self.last_allocation.num_free_tokens if self.last_allocation else 0
        plan.max_runs = self._max_runs(plan, ahead)

    def _max_runs(self, plan: Plan, ahead: bool) -> int:
        """How many times the executor may run `plan` in one call (StepRequest.max_runs): up to
        `max_decode_runs` while the runs after the first are predicted within the window (a request
        that arrives meanwhile waits for them, beyond the step it would wait for anyway), for a plan
        of decodes only with no request waiting. Once for anything else, and with overlapped
        scheduling (a plan built ahead expects each step in flight to sample one token)."""
        config = self.config
        # New requests stream their first token after one run (a preempted one is waiting again).
        if config.max_decode_runs <= 1 or config.async_scheduling or ahead or self.waiting or plan.new_requests:
            return 1
        if len(plan.decode_ids) < len(plan.scheduled) or plan.predicted_step_s <= 0:  # prefills, or nothing to do
            return 1
        return min(config.max_decode_runs, 1 + int(config.decode_runs_window_s / plan.predicted_step_s))

    def _schedule_decodes(self, plan: Plan, scheduled: dict[str, int], room: _Room, ahead: bool) -> None:
        """1. One token for each decoding request, oldest first; preempt the newest running
        requests when the KV cannot grow."""
        for request in [r for r in self.running if r.num_pending_tokens == 1]:
            if room.num_tokens == 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if request.num_expected_output_tokens >= request.max_new_tokens:
                continue  # its step in flight ends it (length): nothing left to plan
            need = request.num_new_blocks(1, self.block_size)
            if need > room.num_free_blocks and ahead:
                raise _CannotPlanAhead
            self._preempt_for(request, need, plan, scheduled, room)
            if need > room.num_free_blocks:
                if len(self.running) > 1:
                    # Older requests hold the KV: this one (the newest left) waits its turn.
                    self._preempt(request)
                    plan.preempted.append(request.executor_request_id)
                elif not plan.released:  # released blocks would come back next step
                    self._fail(request, room.num_free_blocks)
                continue
            scheduled[request.executor_request_id] = 1
            room.num_free_blocks -= need
            room.num_tokens -= 1

    def _preempt_for(self, request: Request, need: int, plan: Plan, scheduled: dict[str, int], room: _Room) -> None:
        """Preempt the newest running requests not scheduled yet until `need` blocks are free for `request`
        (or no one is left to preempt)."""
        while need > room.num_free_blocks:
            victim = next(
                (r for r in reversed(self.running) if r is not request and r.executor_request_id not in scheduled), None
            )
            if victim is None:
                return
            room.num_free_blocks += victim.num_exclusive_blocks  # blocks it shares stay held by others
            self._preempt(victim)
            plan.preempted.append(victim.executor_request_id)

    def _prefill_budget(self, scheduled: dict[str, int], num_tokens: int) -> int:
        """Of the tokens left after the decodes, those prefill chunks and admissions may take.

        The rule, so that a newcomer's long prompt never freezes the agents already streaming and
        the streaming agents never starve a newcomer either:
        - a step with no decodes gives prefill all of them (no one is waiting for a token);
        - a step with decodes is capped where the cost model predicts it within the decode-latency
          target, but never below twice what the decodes alone take (a prefill always gets at least
          half of a step, however many agents decode) nor below `min_prefill_chunk` tokens.
        """
        target = self.config.decode_latency_target_s
        if not target or not scheduled:  # None or 0: no cap
            return num_tokens
        num_decodes = len(scheduled)
        decode_pairs = sum(attention_pairs(self._expected_context(self.requests[rid]), 1) for rid in scheduled)
        decodes_alone_s = self.cost_model.predict(num_decodes, decode_pairs, num_decodes, num_decodes)
        # The chunk's rows attend what its request has cached: price the oldest prefill's context.
        prefilling = next((r for r in self.running if r.num_pending_tokens > 1), None)
        context = self._expected_context(prefilling) if prefilling is not None else 0
        cap = self.cost_model.max_chunk_tokens(
            num_decodes,
            decode_pairs,
            max(target, 2 * decodes_alone_s),
            self.config.min_prefill_chunk,
            num_cached_tokens=context,
        )
        return min(num_tokens, cap)

    def _schedule_prefill_chunks(self, scheduled: dict[str, int], room: _Room) -> None:
        """2. Prefill chunks of running requests, oldest first, cut to the budget and the free KV.

        A prompt whose rest ends within the step's stretch past the budget takes it whole: a
        remainder of a few dozen tokens would wait a whole further step for its first token, since
        the next step carries the next prompt's chunk too (the 8-agent swarm under `--matmul bf16`:
        later turns of ~1,040 new tokens against 1,024-token steps took two steps of ~0.4 s each).
        """
        for request in self.running:
            if room.num_prefill_tokens == 0:
                break
            if request.executor_request_id in scheduled or request.num_pending_tokens <= 1:
                continue
            fits = (
                request.num_blocks(self.block_size) + room.num_free_blocks
            ) * self.block_size - request.num_expected_computed_tokens
            n = min(room.prefill_tokens_for(request.num_pending_tokens), fits)
            if n <= 0:
                continue
            scheduled[request.executor_request_id] = n
            room.take_prefill(n, request.num_new_blocks(n, self.block_size))

    def _admit_waiting(self, plan: Plan, scheduled: dict[str, int], room: _Room) -> None:
        """3. Admission, FIFO, while there is room in the batch, budget, and KV for the whole prompt.

        A newcomer whose prompt (short of its expected prefix hit) would fit one step whole but not
        what is left of this one waits for the next step rather than start in this one's leftover:
        it would end in the next step anyway, behind the next prompt's chunk, its first token a
        whole step later than if it started there. A prompt too long for one step starts at once.
        """
        if self.config.batching == "static" and not self.running:
            self._static_batch.clear()
        forming_static_batch = self.config.batching == "static" and not self._static_batch
        admitted: list[str] = []
        while self.waiting and room.num_prefill_tokens > 0 and len(self.running) < self.max_running_requests:
            request = self.waiting[0]
            if (
                self.config.batching == "static"
                and not forming_static_batch
                and request.executor_request_id not in self._static_batch
            ):
                break
            need_total = self.blocks_for(request.num_known_tokens + 1)
            if not self.can_ever_fit(request.num_known_tokens + 1):
                self.waiting.popleft()
                self._fail(request, room.num_free_blocks)
                continue
            if need_total > room.num_free_blocks - self.watermark_blocks:
                break
            expected_hit = self._expected_prefix_hit(request) if not request.is_known_to_executor else 0
            num_new = max(1, request.num_pending_tokens - expected_hit)
            if room.has_prefill and not room.fits_whole(num_new) and num_new <= self.token_budget + self.step_stretch:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(request.executor_request_id)
            if not request.is_known_to_executor:
                plan.new_requests.append(request)
                request.is_known_to_executor = True
                request.expected_prefix_hit = expected_hit
            # The executor computes what its prefix cache does not hold, up to n: a prompt expected to
            # end within the stretch gets a block more than the guess, which counts whole blocks.
            n = min(request.num_pending_tokens, room.num_prefill_tokens)
            if num_new > room.num_prefill_tokens and room.fits_whole(num_new):
                n = min(
                    request.num_pending_tokens,
                    num_new + self.block_size,
                    room.num_prefill_tokens + room.num_stretch_tokens,
                )
            scheduled[request.executor_request_id] = n
            # Reserve the whole prompt: cached prefix blocks the executor reuses may come out of the free pool too.
            room.take_prefill(n, need_total)
        if forming_static_batch:
            self._static_batch.update(admitted)

    def _predict(self, plan: Plan) -> float:
        """The cost model's executor time for `plan`, in the executor's own terms (see cost_model.py):
        tokens computed, attention pairs, logits rows, requests."""
        num_tokens = num_attention_pairs = num_logits_rows = 0
        for s in plan.scheduled:
            request = self.requests[s.request_id]
            num_tokens += s.num_tokens + s.draft_budget
            num_attention_pairs += attention_pairs(self._expected_context(request), s.num_tokens + s.draft_budget)
            if s.num_tokens == request.num_pending_tokens:  # computes its last known token: samples (and verifies)
                num_logits_rows += 1 + s.draft_budget
        if not num_tokens:
            return 0.0
        return self.cost_model.predict(num_tokens, num_attention_pairs, num_logits_rows, len(plan.scheduled))

    def _expected_prefix_hit(self, request: Request) -> int:
        """The prompt tokens the executor's prefix cache likely holds for a newcomer: its longest
        common prefix with a running request's tokens or a recently ended one's (an agent's next
        turn extends its last; agents share a system prompt), in whole blocks, short of the whole
        prompt. A guess for pricing steps only: its first chunk attends that context."""
        prompt = request.prompt_token_ids
        running = (r.prompt_token_ids + r.output_token_ids for r in self.running if r is not request)
        known = itertools.chain(running, self._ended_tokens)
        longest = max((_common_prefix_length(prompt, tokens) for tokens in known), default=0)
        return min(longest, len(prompt) - 1) // self.block_size * self.block_size

    def _expected_context(self, request: Request) -> int:
        """The keys before a request's next scheduled token: its KV once the steps in flight are done,
        plus, until the executor has reported any, the prefix hit it is expected to find."""
        guess = request.expected_prefix_hit if request.num_computed_tokens == 0 else 0
        return request.num_expected_computed_tokens + guess

    def _draft_budgets(self, scheduled: dict[str, int], budget: int, free: int) -> tuple[dict[str, int], int]:
        """Draft budgets by request id, and the free blocks they leave."""
        decoding = [r for r in self.running if scheduled.get(r.executor_request_id) == 1 and r.num_pending_tokens == 1]
        if not decoding or self.max_draft_tokens == 0 or self.draft_policy.name == "off":
            self.last_allocation = None
            return {}, free
        candidates = [
            DraftCandidate(
                request_id=r.executor_request_id,
                num_draftable_tokens=max(
                    0,
                    min(
                        r.num_draftable_tokens,
                        self.max_draft_tokens,
                        r.max_new_tokens - r.num_expected_output_tokens - 1,
                    ),
                ),
                acceptance=self.acceptance.estimate(r.executor_request_id),
                num_context_tokens=r.num_expected_computed_tokens + 1,
                num_decodes_since_draft=r.num_decodes_since_draft,
                expected_accepted_tokens_by_nodes=r.expected_accepted_tokens_by_nodes,
                tree_correction=self.acceptance.tree_correction(r.executor_request_id)
                if r.expected_accepted_tokens_by_nodes
                else 1.0,
            )
            for r in decoding
        ]
        num_attention_pairs = sum(
            attention_pairs(self._expected_context(self.requests[rid]), n) for rid, n in scheduled.items()
        )
        num_prefill_outputs = sum(
            1 for rid, n in scheduled.items() if n > 1 and self.requests[rid].num_pending_tokens == n
        )
        step = DraftStep(
            num_other_tokens=sum(scheduled.values()),
            num_attention_pairs=num_attention_pairs,
            num_prefill_output_tokens=num_prefill_outputs,
            max_num_draft_tokens=budget,
            num_requests=len(scheduled),
        )
        allocation = self.draft_policy.allocate(candidates, step, self.cost_model)
        self.last_allocation = allocation
        drafts = {}
        for r in decoding:  # oldest first: cut each budget to the KV that is left
            k = allocation.draft_budgets.get(r.executor_request_id, 0)
            base = r.num_new_blocks(1, self.block_size)
            while k > 0 and r.num_new_blocks(1 + k, self.block_size) - base > free:
                k -= 1
            if k:
                drafts[r.executor_request_id] = k
                free -= r.num_new_blocks(1 + k, self.block_size) - base
            r.num_decodes_since_draft = 0 if k else r.num_decodes_since_draft + 1
        return drafts, free

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _fail(self, request: Request, free: int) -> None:
        message = (
            f"request {request.request_id!r} needs {self.blocks_for(request.num_known_tokens + 1)} KV blocks of "
            f"{self.block_size} tokens for its {request.num_known_tokens} tokens, but the executor's KV cache has "
            f"{self.num_kv_blocks} blocks ({free} free with nothing left to preempt)"
        )
        self.finish(request)
        self._failures.append(RequestFailure(request, message))

    def _mark_scheduled(self, plan: Plan, now: float) -> None:
        """Queue time ends when a request is first part of a step."""
        for s in plan.scheduled:
            request = self.requests.get(s.request_id)
            if request is not None and request.first_scheduled_time is None:
                request.first_scheduled_time = now

    # ---------------------------------------------------------------- results

    def update_from_output(
        self, plan: Plan, results: list[RequestResult], num_free_blocks: int, now: float
    ) -> list[RequestUpdate]:
        """The executor answered `plan` with `results` and `num_free_blocks` (its KV report after
        the step): fold the answer in; returns the updates of requests still live, for their streams.

        The plan leaves flight. The requests it released are gone on the executor, so their
        client ids are free again (`is_releasing`). Each result's request mirrors what the
        executor reports (tokens in KV, drafts accepted, new tokens), and one it finished ends.

        Plans built ahead never preempt, so the requests a result names still
        hold what the executor reports, whatever is in flight behind it.
        """
        if plan in self.in_flight:
            self.in_flight.remove(plan)
        for executor_request_id in plan.released:
            self.releasing.pop(executor_request_id, None)
        return self._apply(results, num_free_blocks, now)

    def _apply(self, results: list[RequestResult], num_free_blocks: int, now: float) -> list[RequestUpdate]:
        self.num_free_blocks = num_free_blocks
        updates = []
        for result in results:
            request = self.requests.get(result.request_id)
            if request is None:  # aborted while the step ran
                continue
            request.num_computed_tokens = result.num_computed_tokens
            request.num_drafted_tokens += result.num_drafted_tokens
            request.num_accepted_tokens += result.num_accepted_tokens
            request.num_cached_tokens = max(request.num_cached_tokens, result.num_cached_tokens)
            request.num_draftable_tokens = result.num_draftable_tokens
            request.expected_accepted_tokens_by_nodes = result.expected_accepted_tokens_by_nodes
            request.num_exclusive_blocks = result.num_exclusive_blocks
            if result.num_drafted_tokens:
                # A tree is tested along its kept path: a miss only if it stopped short of its depth.
                # (An executor that does not report depth drafted chains: depth = nodes.)
                depth = result.draft_depth or result.num_drafted_tokens
                self.acceptance.observe(
                    request.executor_request_id, depth, result.num_accepted_tokens, result.num_draft_misses
                )
                self.acceptance.observe_trees(
                    request.executor_request_id, result.expected_num_accepted_tokens, result.num_accepted_tokens
                )
            if result.new_token_ids:
                request.output_token_ids.extend(result.new_token_ids)
                if request.first_token_time is None:
                    request.first_token_time = now
            if result.finish_reason is not None:
                # The executor freed it already.
                request.is_known_to_executor = False
                self.finish(request)
                request.finish_time = now
            updates.append(RequestUpdate(request, list(result.new_token_ids), result.finish_reason, result.logprobs))
        return updates

    # ---------------------------------------------------------------- failures

    def fail_step(self, plan: Plan | None, failure: StepFailure) -> list[Request]:
        """`plan`'s step failed (`failure` says how); returns the live requests it took off.

        - RAISED, RAISED_IN_FLIGHT: the scheduler raised on the step. The requests the
          plan names end (the caller ends their streams); the others go on. Its releases
          go out again next step, since it may never have reached the executor: releasing
          is idempotent there (an unknown id is a no-op), so a release sent twice costs
          nothing, and one never sent would leak KV. RAISED: no answer of it will be
          applied (never sent, or applying it raised), so it leaves flight;
          RAISED_IN_FLIGHT: its answer is still to come, through `update_from_output`.
        - EXECUTOR_LOST: every live request, in arrival order, reset to be sent again
          (prompt + output so far, nothing in KV) to the next planner. This planner is done.
        - EXECUTOR_RESET: every live request ends (`plan` may be None: `schedule` itself
          raised). This planner is done.
        """
        if plan is not None and failure is not StepFailure.RAISED_IN_FLIGHT and plan in self.in_flight:
            self.in_flight.remove(plan)
        if failure is StepFailure.EXECUTOR_LOST:
            return self._take_live_requests()
        if failure is StepFailure.EXECUTOR_RESET:
            return self._end_live_requests()
        if plan is None:
            raise ValueError(f"{failure} needs the failed step's plan")
        self._to_release.extend(r for r in plan.released if r not in self._to_release)
        named = plan.executor_request_ids
        ended = [request for request_id, request in self.requests.items() if request_id in named]
        for request in ended:
            self.finish(request)
        return ended

    def _take_live_requests(self) -> list[Request]:
        live = sorted([*self.running, *self.waiting], key=lambda r: r.arrival_time)
        for request in live:
            request.status = RequestStatus.WAITING
            request.num_computed_tokens = 0
            request.is_known_to_executor = False
            request.num_exclusive_blocks = request.num_draftable_tokens = 0
            request.expected_accepted_tokens_by_nodes = ()
        self.running.clear()
        self.waiting.clear()
        self.requests.clear()
        return live

    def _end_live_requests(self) -> list[Request]:
        live = list(self.running) + list(self.waiting)
        for request in live:
            request.is_known_to_executor = False
            self.finish(request)
        self._to_release.clear()
        self.releasing.clear()
        self.in_flight.clear()
        return live
