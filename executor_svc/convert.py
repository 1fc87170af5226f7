"""Protobuf ↔ engine types for the executor service (the servicer's from_pb / to_pb)."""

from __future__ import annotations

from swarmserve.executor.v1 import executor_pb2 as pb

from executor_svc.engine import CostSample, RequestResult, ScheduledRequest, StepResponse, StepRequest
from executor_svc.grammar import GrammarSpec
from executor_svc.request_state import NewRequest
from executor_svc.sampler import SampledToken
from service_common.sampling_params import SamplingParams

def grammar_from_pb(msg: pb.StructuredOutput) -> GrammarSpec | None:
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    return GrammarSpec(kind, "" if kind == "json_object" else getattr(msg, kind))


def new_request_from_pb(msg: pb.NewRequest) -> NewRequest:
    return NewRequest(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        sampling=SamplingParams.from_pb(msg.sampling),
        max_new_tokens=msg.max_new_tokens,
        stop_token_ids=frozenset(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        session_id=msg.session_id,
        retention_s=msg.retention_s,
        output_token_ids=tuple(msg.output_token_ids),
        structured_output=grammar_from_pb(msg.structured_output),
    )


def step_request_from_pb(msg: pb.StepRequest) -> StepRequest:
    return StepRequest(
        scheduled=[ScheduledRequest(s.request_id, s.num_tokens, s.draft_budget) for s in msg.scheduled],
        new_requests=[new_request_from_pb(r) for r in msg.new_requests],
        released=list(msg.released),
        preempted=list(msg.preempted),
        planned_after_step_id=msg.planned_after_step_id,
    )


def _logprob_to_pb(token: SampledToken) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=token.token_id,
        logprob=token.logprob,
        top_logprobs=[pb.TopLogprob(token_id=i, logprob=lp) for i, lp in token.top_logprobs],
    )


def _result_to_pb(out: RequestResult) -> pb.RequestResult:
    return pb.RequestResult(
        request_id=out.request_id,
        new_token_ids=out.new_token_ids,
        finish_reason=pb.FINISH_REASON_UNSPECIFIED if out.finish_reason is None else out.finish_reason.to_pb(pb.FinishReason),
        num_computed_tokens=out.num_computed_tokens,
        num_drafted_tokens=out.num_drafted_tokens,
        num_accepted_tokens=out.num_accepted_tokens,
        num_draftable_tokens=out.num_draftable_tokens,
        num_cached_tokens=out.num_cached_tokens,
        num_exclusive_kv_blocks=out.num_exclusive_blocks,
        logprobs=[_logprob_to_pb(t) for t in out.logprobs],
    )


def step_response_to_pb(step_id: int, out: StepResponse) -> pb.StepResponse:
    return pb.StepResponse(
        step_id=step_id,
        results=[_result_to_pb(r) for r in out.outputs],
        num_free_kv_blocks=out.num_free_blocks,
        num_total_kv_blocks=out.num_total_blocks,
        num_computed_tokens=out.num_computed_tokens,
        num_kv_tokens=out.num_kv_tokens,
        num_logits_rows=out.num_logits_rows,
        num_requests=out.num_requests,
        timings=pb.StepTimings(
            prepare_s=out.timings.prepare_s, forward_s=out.timings.forward_s, sample_s=out.timings.sample_s
        ),
    )


def cost_samples_to_pb(samples: list[CostSample]) -> list[pb.CostSample]:
    return [
        pb.CostSample(
            num_tokens=c.num_tokens,
            num_kv_tokens=c.num_kv_tokens,
            forward_s=c.forward_s,
            num_logits_rows=c.num_logits_rows,
            num_requests=c.num_requests,
            step_s=c.step_s,
        )
        for c in samples
    ]
