"""What the executor holds for one request: its tokens, how far they are computed, why it stopped
(its KV blocks and recurrent-state slot are the KVManager's)."""

from __future__ import annotations

from dataclasses import dataclass

from executor_svc.sampling.grammar import GrammarMatcher
from service_common.finish_reason import FinishReason
from service_common.sampling_params import SamplingParams
from service_common.structured_output import StructuredOutput
from swarmserve.executor.v1 import executor_pb2 as pb


@dataclass(frozen=True)
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 256
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    session_id: str = ""  # an agent's conversation: its KV is preferred when evicting...
    retention_s: float = 0.0  # ... for this long after the request ends (0: no preference)
    output_token_ids: tuple[int, ...] = ()  # already generated (resubmitted after an executor restart)
    structured_output: StructuredOutput | None = None  # None: unconstrained

    @classmethod
    def from_pb(cls, msg: pb.NewRequest) -> NewRequest:
        """InvalidRequestError when its sampling options or structured_output are malformed."""
        return cls(
            request_id=msg.request_id,
            prompt_token_ids=list(msg.prompt_token_ids),
            sampling=SamplingParams.from_pb(msg.sampling),
            max_new_tokens=msg.max_new_tokens,
            stop_token_ids=frozenset(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            session_id=msg.session_id,
            retention_s=msg.retention_s,
            output_token_ids=tuple(msg.output_token_ids),
            structured_output=StructuredOutput.from_pb(msg.structured_output),
        )

    @property
    def token_ids(self) -> list[int]:
        """Everything the request starts with: prompt, then any output it already has."""
        return [*self.prompt_token_ids, *self.output_token_ids]


@dataclass
class RequestState:
    new: NewRequest  # the request as the plan sent it: its prompt and options
    token_ids: list[int]  # prompt followed by output
    seed: int  # the sampling seed: the request's own, or one the engine drew
    grammar: GrammarMatcher | None = None  # where its output stands in its structured_output grammar
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (its blocks: the engine's KVManager)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache instead of computed
    finish_reason: FinishReason | None = None

    @property
    def request_id(self) -> str:
        return self.new.request_id

    @property
    def sampling(self) -> SamplingParams:
        return self.new.sampling

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.new.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
