"""The Step RPC's messages as the engine takes and gives them, each with its one constructor at
the wire (`from_pb` for what the scheduler sends, `to_pb` for what goes back), as the servicer
uses them: `StepRequest.from_pb` → `Engine.step` → `StepResponse.to_pb`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from executor_svc.engine.request_state import NewRequest
from executor_svc.sampling.sampler import SampledToken
from service_common.finish_reason import FinishReason
from swarmserve.executor.v1 import executor_pb2 as pb


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    num_tokens: int  # tokens to compute this step: a prefill chunk, or 1 to decode
    draft_budget: int = 0  # speculative tokens it may verify on top of a decode token

    @classmethod
    def from_pb(cls, msg: pb.ScheduledRequest) -> ScheduledRequest:
        return cls(msg.request_id, msg.num_tokens, msg.draft_budget)


@dataclass(frozen=True)
class StepRequest:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    released: list[str] = field(default_factory=list)  # finished or aborted: free everything
    preempted: list[str] = field(default_factory=list)  # free KV, keep tokens, recompute later
    # Nonzero: built by an overlapped scheduler before that step's result was known (see Engine.rebase).
    planned_after_step_id: int = 0
    max_runs: int = 1  # runs in one call: the plan, then one decode token per run (see Engine.step)

    @classmethod
    def from_pb(cls, msg: pb.StepRequest) -> StepRequest:
        """InvalidRequestError when a new request's options are out of range (the plan is refused whole)."""
        return cls(
            scheduled=[ScheduledRequest.from_pb(s) for s in msg.scheduled],
            new_requests=[NewRequest.from_pb(r) for r in msg.new_requests],
            released=list(msg.released),
            preempted=list(msg.preempted),
            planned_after_step_id=msg.planned_after_step_id,
            max_runs=max(1, msg.max_runs),
        )


@dataclass(frozen=True)
class RequestResult:
    request_id: str
    new_token_ids: list[int]  # empty mid-prefill
    finish_reason: FinishReason | None
    num_computed_tokens: int  # tokens in KV after this step
    logprobs: list[SampledToken]  # one per new token when logprobs were asked for, else empty
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draftable_tokens: int = 0  # drafts the index could propose next step
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    num_exclusive_blocks: int = 0  # blocks no other request shares: what a preemption would free
    num_runs: int = 1  # runs of the plan it took part in (each may verify drafts up to its budget)
    # The verified drafts' shape, summed over the runs (num_drafted_tokens is their node count).
    draft_depth: int = 0  # deepest node's depth: a chain's length
    num_draft_leaves: int = 0  # 1 for a chain
    expected_num_accepted_tokens: float = 0.0  # the drafter's estimate for the verified trees (0 for chains)
    num_draft_misses: int = 0  # runs whose draft was accepted short of its depth (one rejected token each)
    # [n - 1]: expected accepted tokens of the best n-node tree next step; empty unless it is a branching tree.
    expected_accepted_tokens_by_nodes: list[float] = field(default_factory=list)

    def then(self, later: RequestResult) -> RequestResult:
        """This result followed by `later`, the same request's in the next run of the plan."""
        return replace(
            later,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            logprobs=self.logprobs + later.logprobs,
            num_drafted_tokens=self.num_drafted_tokens + later.num_drafted_tokens,
            num_accepted_tokens=self.num_accepted_tokens + later.num_accepted_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_runs=self.num_runs + later.num_runs,
            draft_depth=self.draft_depth + later.draft_depth,
            num_draft_leaves=self.num_draft_leaves + later.num_draft_leaves,
            expected_num_accepted_tokens=self.expected_num_accepted_tokens + later.expected_num_accepted_tokens,
            num_draft_misses=self.num_draft_misses + later.num_draft_misses,
        )

    def to_pb(self) -> pb.RequestResult:
        return pb.RequestResult(
            request_id=self.request_id,
            new_token_ids=self.new_token_ids,
            finish_reason=pb.FINISH_REASON_UNSPECIFIED
            if self.finish_reason is None
            else self.finish_reason.to_pb(pb.FinishReason),
            num_computed_tokens=self.num_computed_tokens,
            num_drafted_tokens=self.num_drafted_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_draftable_tokens=self.num_draftable_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_exclusive_kv_blocks=self.num_exclusive_blocks,
            num_runs=self.num_runs,
            draft_depth=self.draft_depth,
            num_draft_leaves=self.num_draft_leaves,
            expected_num_accepted_tokens=self.expected_num_accepted_tokens,
            expected_accepted_tokens_by_nodes=self.expected_accepted_tokens_by_nodes,
            num_draft_misses=self.num_draft_misses,
            logprobs=[
                pb.TokenLogprob(
                    token_id=t.token_id,
                    logprob=t.logprob,
                    top_logprobs=[pb.TopLogprob(token_id=i, logprob=lp) for i, lp in t.top_logprobs],
                )
                for t in self.logprobs
            ],
        )


@dataclass(frozen=True)
class CostSample:
    num_tokens: int  # tokens computed
    num_attention_pairs: int  # Σ over the query rows of the keys each attends (service_common/attention_pairs.py)
    forward_s: float
    num_logits_rows: int = 1  # rows the LM head and the sampler ran on
    num_requests: int = 1
    step_s: float = 0.0  # forward plus picking the tokens (argmax), as a real step's prepare + forward + sample

    def to_pb(self) -> pb.CostSample:
        return pb.CostSample(
            num_tokens=self.num_tokens,
            num_attention_pairs=self.num_attention_pairs,
            forward_s=self.forward_s,
            num_logits_rows=self.num_logits_rows,
            num_requests=self.num_requests,
            step_s=self.step_s,
        )


@dataclass(frozen=True)
class StepTimings:
    prepare_s: float
    forward_s: float
    sample_s: float
    grammar_s: float = 0.0  # of sample_s: computing and applying the grammar masks (0 without grammar requests)

    def to_pb(self) -> pb.StepTimings:
        return pb.StepTimings(prepare_s=self.prepare_s, forward_s=self.forward_s, sample_s=self.sample_s)

    def __add__(self, other: StepTimings) -> StepTimings:
        return StepTimings(
            self.prepare_s + other.prepare_s,
            self.forward_s + other.forward_s,
            self.sample_s + other.sample_s,
            self.grammar_s + other.grammar_s,
        )


@dataclass(frozen=True)
class StepResponse:
    outputs: list[RequestResult]
    num_computed_tokens: int
    num_attention_pairs: int  # Σ over the query rows of the keys each attends: for the cost model
    num_free_blocks: int
    num_total_blocks: int
    timings: StepTimings
    num_logits_rows: int = 0  # rows the LM head and the sampler ran on: for the cost model
    num_requests: int = 0  # requests the step computed tokens for
    num_runs: int = 1  # runs of the plan (see StepRequest.max_runs): the counts and timings are their sums

    def then(self, later: StepResponse) -> StepResponse:
        """This answer followed by `later`, the next run's: each request's results joined, the sums added."""
        later_outputs = {r.request_id: r for r in later.outputs}
        return replace(
            later,
            outputs=[r.then(later_outputs[r.request_id]) if r.request_id in later_outputs else r for r in self.outputs],
            num_computed_tokens=self.num_computed_tokens + later.num_computed_tokens,
            num_attention_pairs=self.num_attention_pairs + later.num_attention_pairs,
            timings=self.timings + later.timings,
            num_logits_rows=self.num_logits_rows + later.num_logits_rows,
            num_requests=self.num_requests + later.num_requests,
            num_runs=self.num_runs + later.num_runs,
        )

    def to_pb(self, step_id: int) -> pb.StepResponse:
        return pb.StepResponse(
            step_id=step_id,
            results=[r.to_pb() for r in self.outputs],
            num_free_kv_blocks=self.num_free_blocks,
            num_total_kv_blocks=self.num_total_blocks,
            num_computed_tokens=self.num_computed_tokens,
            num_attention_pairs=self.num_attention_pairs,
            num_logits_rows=self.num_logits_rows,
            num_requests=self.num_requests,
            timings=self.timings.to_pb(),
            num_runs=self.num_runs,
        )
