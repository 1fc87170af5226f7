"""Draft budgets: how many speculative tokens each decoding request may verify next step.

Batching and speculation spend the same compute slack (DESIGN.md, "Cost model
and the speculation budget"): a step of B decodes already commits B tokens, so
the drafts worth adding shrink as the batch grows. A constant draft length is
wrong at every batch size but one. Four policies, selectable with
`--spec off|fixed:K|even|goodput` so they can be compared:

- `off`: no drafts.
- `fixed:K`: K drafts for every request that has them (the baseline to beat).
- `even`: an even split of the free budget. S = the free-token budget at this step's KV; the
  step's other tokens (one committed token per decode, plus prefill chunks)
  come out of S first, and what is left is split evenly over the requests that
  can draft, so Σ(1 + k_i) + prefill ≤ S whenever the step fits in S at all.
- `goodput` (default): add draft tokens one at a time to the request whose next
  token is most likely accepted (α_i^(k_i+1) for a linear draft), while the
  expected tokens per predicted second still rises.

Every policy returns only budgets; the executor's index may draft fewer. No
policy drafts for a request whose index has nothing to propose (d_i = 0).

Trees (`--draft-shape tree` on the executor): a budget of n buys a tree of n nodes,
whose expected accepted tokens E_i(n) the executor's drafter knows and reports for
every n (RequestResult.expected_accepted_tokens_by_nodes). The n-th node's gain is
then E_i(n) - E_i(n-1), scaled by the request's tree correction c_i (acceptance.py:
its accepted tokens over what the drafter expected of its verified trees, so an
over- or under-confident drafter is corrected by what verification found) and capped
at 1 (no node is accepted more than surely). A request without a curve (a chain, or
a tree that does not branch) is priced as before by α_i: where trees do not branch,
this is today's policy exactly. The drafter grows its trees likeliest node first, so
a curve's gains only fall, as α^j does, and the greedy allocation stays sound; the
policy keeps them falling (a running minimum) whatever a curve says.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from scheduler_svc.cost_model import CostModel
from service_common.attention_pairs import attention_pairs

DRAFT_POLICY_CHOICES = "off|fixed:K|even|goodput"
DEFAULT_DRAFT_POLICY = "goodput"
FREE_TOKEN_TOLERANCE = 0.05  # S counts a step as free within 5% of a one-token step


@dataclass(frozen=True)
class DraftCandidate:
    """One decoding request as the policy sees it."""

    request_id: str
    num_draftable_tokens: int  # d_i: what the executor's index can propose next step (0 = none)
    acceptance: float  # α_i: probability a draft token is accepted given the previous one was
    num_context_tokens: int  # the keys its decode row attends: computed tokens + the decode token
    num_decodes_since_draft: int = 0  # its decode steps in a row that verified no draft (goodput's probe)
    # E_i(n) at [n - 1]: the expected accepted tokens of its best n-node draft tree; () = price as a chain by α_i.
    expected_accepted_tokens_by_nodes: tuple[float, ...] = ()
    tree_correction: float = 1.0  # c_i: scales the curve's gains (AcceptanceTracker.tree_correction)

    def __post_init__(self) -> None:
        if self.num_draftable_tokens < 0:
            raise ValueError(f"{self.request_id!r}: num_draftable_tokens must be >= 0, got {self.num_draftable_tokens}")
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"{self.request_id!r}: acceptance must be in [0, 1], got {self.acceptance}")
        if self.num_context_tokens < 0:
            raise ValueError(f"{self.request_id!r}: num_context_tokens must be >= 0, got {self.num_context_tokens}")
        if not all(math.isfinite(e) and e >= 0.0 for e in self.expected_accepted_tokens_by_nodes):
            raise ValueError(
                f"{self.request_id!r}: expected_accepted_tokens_by_nodes must be finite and >= 0, "
                f"got {self.expected_accepted_tokens_by_nodes}"
            )
        if not (math.isfinite(self.tree_correction) and self.tree_correction >= 0.0):
            raise ValueError(
                f"{self.request_id!r}: tree_correction must be finite and >= 0, got {self.tree_correction}"
            )

    def draft_gains(self) -> list[float]:
        """The expected accepted tokens each further draft token adds: element j is the gain of
        the (j+1)-th, for as many as it can draft (see the module docstring).

        A chain: α, α², ... (by repeated multiplication, as the goodput policy always has). A
        curve: c · (E(n) - E(n-1)), capped at 1 and never above the gain before it; it stops
        where the curve does (the drafter has no more nodes to propose).
        """
        curve = self.expected_accepted_tokens_by_nodes
        if not curve:
            gains, gain = [], 1.0
            for _ in range(self.num_draftable_tokens):
                gain *= self.acceptance
                gains.append(gain)
            return gains
        gains, previous, ceiling = [], 0.0, 1.0
        for expected in curve[: self.num_draftable_tokens]:
            ceiling = min(ceiling, max(0.0, self.tree_correction * (expected - previous)))
            gains.append(ceiling)
            previous = expected
        return gains


@dataclass(frozen=True)
class DraftStep:
    """The rest of the step the drafts join."""

    num_other_tokens: int  # one committed token per decoding request (B) + the step's prefill chunk tokens
    num_attention_pairs: int  # the pairs the step's rows attend without drafts (service_common/attention_pairs.py)
    num_prefill_output_tokens: int = 0  # tokens the prefill chunks emit (1 per chunk that ends its prompt)
    max_num_draft_tokens: int | None = None  # what the step's token/KV budget leaves for drafts; None = no cap
    num_requests: int = 0  # requests in the step, decoding or prefilling (0: the decoding candidates alone)

    def __post_init__(self) -> None:
        for name in ("num_other_tokens", "num_attention_pairs", "num_prefill_output_tokens", "num_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_num_draft_tokens is not None and self.max_num_draft_tokens < 0:
            raise ValueError(f"max_num_draft_tokens must be >= 0 or None, got {self.max_num_draft_tokens}")


@dataclass(frozen=True)
class DraftAllocation:
    """Budgets plus what the policy believed, for the step's trace span."""

    draft_budgets: dict[str, int]  # request id -> k_i
    num_free_tokens: int  # S at this step's KV
    num_expected_tokens: float  # tokens the step is expected to emit: B + prefill outputs + Σ_i Σ_j≤k_i gain_ij
    predicted_step_s: float  # the cost model's time for the step with these drafts

    @property
    def num_draft_tokens(self) -> int:
        return sum(self.draft_budgets.values())


def _step_time(
    cost_model: CostModel,
    step: DraftStep,
    num_candidates: int,
    num_tokens: int,
    num_attention_pairs: int,
    num_drafts: int,
) -> float:
    """The cost model's time for the step with `num_drafts` drafts in all: each draft is a token and a logits row."""
    num_logits_rows = num_candidates + step.num_prefill_output_tokens + num_drafts
    return cost_model.predict(
        num_tokens, num_attention_pairs, num_logits_rows, max(step.num_requests, num_candidates, 1)
    )


def draft_attention_pairs(num_context_tokens: int, num_draft_tokens: int) -> int:
    """The pairs a request's drafts add to the step: draft j (1-based) attends the request's
    context, its decode token included, and the j drafts up to itself. Example: context 1000,
    3 drafts: 1001 + 1002 + 1003 = 3006. At thousands of tokens of context a draft row's
    attention outweighs its share of the matmuls, so a draft is priced by where it attends."""
    return attention_pairs(num_context_tokens, num_draft_tokens)


def free_token_budget(cost_model: CostModel, step: DraftStep, candidates: Sequence[DraftCandidate]) -> int:
    """S at this step: the tokens it computes within FREE_TOKEN_TOLERANCE of a one-token step,
    each extra token a row attending the decoding requests' mean context."""
    mean_context = sum(c.num_context_tokens for c in candidates) / len(candidates) if candidates else 0.0
    return cost_model.free_token_budget(step.num_attention_pairs, FREE_TOKEN_TOLERANCE, mean_context)


class DraftPolicy(ABC):
    name: ClassVar[str]  # as `--spec` spells it, for traces

    @abstractmethod
    def budgets(self, candidates: Sequence[DraftCandidate], step: DraftStep, cost_model: CostModel) -> dict[str, int]:
        """k_i per candidate, 0 <= k_i <= d_i."""

    def allocate(self, candidates: Sequence[DraftCandidate], step: DraftStep, cost_model: CostModel) -> DraftAllocation:
        """Budgets for this step's decoding requests, with S, expected tokens and predicted time."""
        ids = [c.request_id for c in candidates]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate request ids among draft candidates: {sorted(ids)}")
        if step.num_other_tokens < len(candidates):
            raise ValueError(
                f"num_other_tokens ({step.num_other_tokens}) must count one committed token for each of the "
                f"{len(candidates)} decoding requests"
            )
        budgets = self.budgets(candidates, step, cost_model) if candidates else {}
        num_tokens, num_attention_pairs = step.num_other_tokens, step.num_attention_pairs
        expected = float(len(candidates) + step.num_prefill_output_tokens)
        for c in candidates:
            k = budgets[c.request_id]
            num_tokens += k
            num_attention_pairs += draft_attention_pairs(c.num_context_tokens, k)
            expected += _expected_accepted(c, k)
        return DraftAllocation(
            draft_budgets=budgets,
            num_free_tokens=free_token_budget(cost_model, step, candidates),
            num_expected_tokens=expected,
            predicted_step_s=_step_time(
                cost_model, step, len(candidates), num_tokens, num_attention_pairs, sum(budgets.values())
            ),
        )


def _expected_accepted(c: DraftCandidate, num_draft_tokens: int) -> float:
    """The expected accepted length of k draft tokens: Σ_{j=1..k} α^j for a linear draft, the
    sum of the first k gains of a tree's curve (nodes past the curve's end are never drafted)."""
    if not c.expected_accepted_tokens_by_nodes:
        return sum(c.acceptance**j for j in range(1, num_draft_tokens + 1))
    return sum(c.draft_gains()[:num_draft_tokens])


def _cap_total(caps: dict[str, int], max_total: int | None, order: Sequence[str]) -> dict[str, int]:
    """Water-fill: k_i = min(cap_i, L) at the highest level L whose total fits, the remainder +1 in `order`.

    Requests capped below L give their unused share to the others. Example:
    caps {a: 1, b: 9, c: 9}, total 8 → L = 3 leaves 1 → {a: 1, b: 4, c: 3} in order b, c.
    """
    if max_total is None or sum(caps.values()) <= max_total:
        return dict(caps)
    low, high = 0, max(caps.values())
    while low < high:  # the largest level L with Σ min(cap, L) <= max_total
        mid = (low + high + 1) // 2
        if sum(min(cap, mid) for cap in caps.values()) <= max_total:
            low = mid
        else:
            high = mid - 1
    budgets = {request_id: min(cap, low) for request_id, cap in caps.items()}
    left = max_total - sum(budgets.values())
    for request_id in order:
        if left == 0:
            break
        if caps[request_id] > budgets[request_id]:
            budgets[request_id] += 1
            left -= 1
    return budgets


def _by_acceptance(candidates: Sequence[DraftCandidate]) -> list[str]:
    """Request ids, most likely accepted first; ties by request id so every run splits the same way."""
    return [c.request_id for c in sorted(candidates, key=lambda c: (-c.acceptance, c.request_id))]


@dataclass(frozen=True)
class OffPolicy(DraftPolicy):
    name: ClassVar[str] = "off"

    def budgets(self, candidates: Sequence[DraftCandidate], step: DraftStep, cost_model: CostModel) -> dict[str, int]:
        return {c.request_id: 0 for c in candidates}


@dataclass(frozen=True)
class FixedPolicy(DraftPolicy):
    num_draft_tokens: int = 4

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"fixed draft length must be at least 1, got {self.num_draft_tokens}")

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"fixed:{self.num_draft_tokens}"

    def budgets(self, candidates: Sequence[DraftCandidate], step: DraftStep, cost_model: CostModel) -> dict[str, int]:
        caps = {c.request_id: min(self.num_draft_tokens, c.num_draftable_tokens) for c in candidates}
        return _cap_total(caps, step.max_num_draft_tokens, _by_acceptance(candidates))


@dataclass(frozen=True)
class EvenSplitPolicy(DraftPolicy):
    """What S leaves after the step's other tokens, split evenly.

    S comes from the cost model at this step's KV. Prefill chunk tokens are
    arithmetic like any other, so they spend S before drafts do: a step
    carrying a large chunk gets no drafts. The split is a water-fill over the
    requests that can draft: a request whose index has fewer tokens than its
    share takes what it has and leaves the rest to the others; the last few
    tokens that do not divide evenly go to the likeliest-accepted requests.
    """

    name: ClassVar[str] = "even"

    def budgets(self, candidates: Sequence[DraftCandidate], step: DraftStep, cost_model: CostModel) -> dict[str, int]:
        num_free_tokens = free_token_budget(cost_model, step, candidates)
        room = max(0, num_free_tokens - step.num_other_tokens)
        if step.max_num_draft_tokens is not None:
            room = min(room, step.max_num_draft_tokens)
        caps = {c.request_id: c.num_draftable_tokens for c in candidates}
        return _cap_total(caps, room, _by_acceptance(candidates))


@dataclass(frozen=True)
class GoodputPolicy(DraftPolicy):
    """Greedy marginal goodput: each draft token goes where it is likeliest accepted, while it pays.

    With k_i drafts, request i's next draft token is accepted with probability
    α_i^(k_i+1) (a linear draft is accepted up to its first miss), so gains
    only fall as a request's draft grows; a tree's next node gains what the
    request's curve says (`DraftCandidate.draft_gains`), falling too. The step's
    expected output is E = B + prefill outputs + Σ_i Σ_{j≤k_i} gain_ij and its time
    t = cost_model.predict(T, P, L, R), where each draft adds 1 to T and to
    the logits rows L, and the pairs it attends (`draft_attention_pairs`) to P. The best
    candidate (gain g) is taken iff (E + g) / t(T + 1, P + ΔP) > E / t(T, P), i.e. it raises
    expected tokens per second; a candidate that does not is dropped and the next is tried
    (its context may be shorter, its draft cheaper). Ties go to the smaller request id.

    Two guards against trusting the model where it has no evidence: the step
    never grows past the largest step the cost model has measured (it would
    extrapolate), and no draft token with gain below `min_gain` is proposed (a
    flat model prices it at zero, but verification and its KV slot are not free).

    One guard against never gathering evidence: α is learned only from drafts,
    so a request whose estimate says drafting does not pay (say it started from a
    low swarm-wide rate, then began to copy) would never draft again. A request
    that could draft but has gone `probe_every` decode steps without a draft gets
    one draft token (a probe, about 1/probe_every of a verify row per step at
    worst): accepted, its α rises and goodput takes over; rejected, it waits
    another `probe_every` steps.
    """

    min_gain: float = 0.02
    probe_every: int = 8  # 0: never probe
    name: ClassVar[str] = "goodput"

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_gain <= 1.0:
            raise ValueError(f"min_gain must be in [0, 1], got {self.min_gain}")
        if self.probe_every < 0:
            raise ValueError(f"probe_every must be >= 0, got {self.probe_every}")

    def budgets(self, candidates: Sequence[DraftCandidate], step: DraftStep, cost_model: CostModel) -> dict[str, int]:
        budgets = {c.request_id: 0 for c in candidates}
        room = max(0, cost_model.max_observed_tokens - step.num_other_tokens)
        if step.max_num_draft_tokens is not None:
            room = min(room, step.max_num_draft_tokens)
        gains = {c.request_id: c.draft_gains() for c in candidates}
        # Max-heap on the next draft token's gain: (-gain, request_id, candidate).
        heap = [(-g[0], c.request_id, c) for c in candidates if (g := gains[c.request_id]) and g[0] > 0]
        heapq.heapify(heap)
        num_tokens, num_attention_pairs = step.num_other_tokens, step.num_attention_pairs
        expected = float(len(candidates) + step.num_prefill_output_tokens)
        num_drafts = 0
        step_s = _step_time(cost_model, step, len(candidates), num_tokens, num_attention_pairs, num_drafts)
        while heap and room > 0:
            negative_gain, request_id, c = heapq.heappop(heap)
            gain = -negative_gain
            if gain < self.min_gain:
                break  # every later candidate gains less
            k = budgets[request_id]
            pairs = draft_attention_pairs(c.num_context_tokens, k + 1) - draft_attention_pairs(c.num_context_tokens, k)
            next_step_s = _step_time(
                cost_model, step, len(candidates), num_tokens + 1, num_attention_pairs + pairs, num_drafts + 1
            )
            if not (expected + gain) * step_s > expected * next_step_s:
                continue
            budgets[request_id] = k + 1
            num_tokens, num_attention_pairs, step_s = num_tokens + 1, num_attention_pairs + pairs, next_step_s
            num_drafts += 1
            expected += gain
            room -= 1
            if k + 1 < len(gains[request_id]):
                heapq.heappush(heap, (-gains[request_id][k + 1], request_id, c))
        for c in candidates:  # probes, from what room is left
            if room > 0 and self._is_probe_due(c) and budgets[c.request_id] == 0:
                budgets[c.request_id] = 1
                room -= 1
        return budgets

    def _is_probe_due(self, c: DraftCandidate) -> bool:
        return self.probe_every > 0 and c.num_draftable_tokens > 0 and c.num_decodes_since_draft >= self.probe_every


def parse_draft_policy(text: str) -> DraftPolicy:
    """The `--spec` flag: off | fixed:K | even | goodput."""
    value = text.strip().lower()
    if value == "off":
        return OffPolicy()
    if value == "even":
        return EvenSplitPolicy()
    if value == "goodput":
        return GoodputPolicy()
    if value.startswith("fixed:"):
        count = value.removeprefix("fixed:")
        if not (count.isascii() and count.isdigit()) or int(count) < 1:
            raise ValueError(f"--spec fixed:K needs K to be a positive integer (e.g. fixed:4), got {text!r}")
        return FixedPolicy(int(count))
    if value == "fixed":
        raise ValueError(f"--spec fixed needs a draft length, e.g. fixed:4; got {text!r}")
    raise ValueError(f"--spec must be one of {DRAFT_POLICY_CHOICES}, got {text!r}")
