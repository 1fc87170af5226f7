"""The scheduler's view of one request: what to send, how far it got, when things happened.

The executor owns the truth about KV; the scheduler mirrors just enough of it
(`num_computed_tokens`, hence the blocks a request holds) to plan the next step
without asking.

Two ids: `request_id` is the client's (streams, logs, Abort); `executor_request_id`
is unique per submission and is the only id plans and step results carry. A client
may reuse its id once a request has ended, while a step still in flight carries
results for the old one: keyed by the client's id, those results would be applied
to the new request.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from service_common.sampling_params import SamplingParams
from service_common.structured_output import StructuredOutput
from swarmserve.executor.v1 import executor_pb2 as epb


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # in the batch
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    arrival_time: float = 0.0
    session_id: str = ""
    retention_s: float = 0.0
    executor_request_id: str = ""  # empty: the client's id (pure-core tests); intake always sets a fresh one
    structured_output: StructuredOutput | None = None  # None: unconstrained

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # mirrors the executor: tokens whose KV is cached
    is_known_to_executor: bool = False  # sent in a plan's new_requests (and not released since)
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    # Before the executor reports: the prompt tokens its prefix cache likely holds (the planner's guess at
    # admission). It only prices steps (the cost model); KV accounting never counts on it.
    expected_prefix_hit: int = 0
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draftable_tokens: int = 0  # what the executor's index could draft next step (from the last result)
    # From the last result: E(n) of the branching draft tree it would get with n nodes; () = priced as a chain.
    expected_accepted_tokens_by_nodes: tuple[float, ...] = ()
    num_decodes_since_draft: int = 0  # decode steps in a row planned without a draft (goodput probes after a few)
    num_exclusive_blocks: int = 0  # KV blocks only it holds (from the last result): what preempting it frees
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Overlapped scheduling: what the plans sent but not answered yet are expected to add (the planner
    # sets both before each plan; both 0 when nothing is in flight): tokens into KV, and tokens sampled.
    num_in_flight_tokens: int = 0
    num_in_flight_samples: int = 0

    def __post_init__(self) -> None:
        if not self.executor_request_id:
            self.executor_request_id = self.request_id

    def to_pb(self) -> epb.NewRequest:
        """As a plan's new request, under its executor id; `output_token_ids` are non-empty only
        when it is resubmitted (preempted requests are recomputed, not resent)."""
        return epb.NewRequest(
            request_id=self.executor_request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling=self.sampling.to_pb(),
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=sorted(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            session_id=self.session_id,
            retention_s=self.retention_s,
            output_token_ids=self.output_token_ids,
            structured_output=self.structured_output.to_pb() if self.structured_output else None,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Prompt plus output: everything the executor holds for this request."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_expected_computed_tokens(self) -> int:
        """Tokens in KV once the steps in flight are done (as the executor reported, when none is)."""
        return self.num_computed_tokens + self.num_in_flight_tokens

    @property
    def num_expected_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_in_flight_samples

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet in KV once the steps in flight are done: a prefill remainder, or 1 (the
        last sampled token) when decoding."""
        return self.num_known_tokens + self.num_in_flight_samples - self.num_expected_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def num_blocks(self, block_size: int) -> int:
        return math.ceil(self.num_expected_computed_tokens / block_size)

    def num_new_blocks(self, num_tokens: int, block_size: int) -> int:
        """Blocks the executor must add to compute `num_tokens` more tokens."""
        return math.ceil((self.num_expected_computed_tokens + num_tokens) / block_size) - self.num_blocks(block_size)
