"""What the executor holds for one request: its tokens, its KV blocks, why it stopped."""

from __future__ import annotations

from dataclasses import dataclass, field

from executor_svc.grammar import GrammarMatcher, GrammarSpec
from service_common.finish_reason import FinishReason
from service_common.sampling_params import SamplingParams


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
    structured_output: GrammarSpec | None = None  # None: unconstrained

    @property
    def token_ids(self) -> list[int]:
        """Everything the request starts with: prompt, then any output it already has."""
        return [*self.prompt_token_ids, *self.output_token_ids]


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]  # prompt followed by output
    num_prompt_tokens: int
    sampling: SamplingParams
    seed: int
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    session_id: str = ""
    retention_s: float = 0.0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache instead of computed
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of the full blocks of token_ids
    num_registered_blocks: int = 0  # leading blocks of block_ids registered in the prefix cache
    state_slot: int = -1  # recurrent-state slot (hybrid models) while the request is being computed; -1: none
    grammar: GrammarMatcher | None = None  # where its output stands in its structured_output grammar

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
