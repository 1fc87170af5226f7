"""How one request wants its tokens chosen."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from service_common.errors import InvalidRequestError
from swarmserve.common.v1 import sampling_pb2 as pb

MAX_LOGPROBS = 20
# Below this, logits / temperature overflows float32 (1e-38 gave NaN probabilities and a
# garbage token), and the distribution is a point mass on the argmax anyway: greedy.
MIN_SAMPLING_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or below MIN_SAMPLING_TEMPERATURE) = greedy (argmax)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with this much mass
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    min_p: float = 0.0  # drop tokens below min_p × the top token's probability
    seed: int | None = None  # None: the engine draws one, so a request is reproducible internally
    num_logprobs: int = 0  # also report the top-n log-probabilities at each sampled position

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"sampling.temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"sampling.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"sampling.min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.num_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"sampling.num_logprobs must be in [0, {MAX_LOGPROBS}], got {self.num_logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"sampling.seed must be in [0, 2**63), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    # One proto message (swarmserve.common.v1.SamplingParams) carries these on both hops, its fields
    # named like the dataclass's, so one pair of converters driven by the dataclass's fields serves
    # both: a new option needs no conversion code, only its proto field.

    @classmethod
    def from_pb(cls, msg: pb.SamplingParams, defaults: SamplingParams | None = None) -> SamplingParams:
        """A field the message leaves unset takes its value in `defaults` (the dataclass defaults
        if None). Raises InvalidRequestError naming the field out of range."""
        defaults = defaults or cls()
        return cls(
            **{
                f.name: getattr(msg, f.name) if msg.HasField(f.name) else getattr(defaults, f.name)
                for f in dataclasses.fields(cls)
            }
        )

    def to_pb(self) -> pb.SamplingParams:
        """Every field set but a None seed (the executor draws one)."""
        return pb.SamplingParams(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        )
