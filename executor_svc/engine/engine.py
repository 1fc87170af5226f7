"""The executor engine: requests in, one step per plan, tokens out.

The engine does exactly what a plan says. It holds every request's tokens and KV
blocks; the scheduler decides who runs and how many tokens each computes. A
request is *prefilling* while tokens it already knows (its prompt, or prompt and
output after a preemption) are not in the KV cache yet; when a step computes up
to its last known token, that step also samples its next token.

Every plan is validated before anything changes, so a bad plan raises and the
engine carries on serving everyone else. The model side (device, weights, the forward
pass, calibration) is the ModelRunner's (model_runner.py).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import structlog
import torch

from executor_svc.config import EngineConfig
from executor_svc.engine.model_runner import ModelRunner
from executor_svc.engine.request_state import FinishReason, NewRequest, RequestState
from executor_svc.engine.step_messages import (
    RequestResult,
    ScheduledRequest,
    StepRequest,
    StepResponse,
    StepTimings,
)
from executor_svc.errors import OutOfKVBlocksError, UnknownRequestError
from executor_svc.kv.kv_manager import NO_COMPUTED_BLOCKS, ComputedBlocks
from executor_svc.model.ragged_batch import RequestSlice
from executor_svc.sampling.drafter import Drafter, DraftTree
from executor_svc.sampling.grammar import GrammarCompiler, GrammarMatcher, apply_masks, fill_masks
from executor_svc.sampling.sampler import SampledToken, SampleSpec, token_logprobs
from executor_svc.sampling.verifier import verify, verify_tree
from service_common.errors import InvalidRequestError
from service_common.request_checks import check_new_request

log = structlog.get_logger()

MAX_FINISHED_IDS = 4096  # ended requests remembered for plans built ahead (a plan is at most a step or two behind)
MAX_RUNS_PER_PLAN = 64  # StepRequest.max_runs: a plan's runs in one call


@dataclass(frozen=True)
class _Draft:
    """What a request verifies on top of its last token: a chain, or a tree (drafter.DraftTree)."""

    token_ids: list[int]
    parent_indexes: tuple[int, ...] | None = None  # a tree's, -1 for the root's children; None: a chain
    depth: int = 0  # the deepest node's depth (a chain's length), reported in RequestResult.draft_depth
    num_leaves: int = 0  # 1 for a chain
    expected_num_accepted_tokens: float = 0.0  # the drafter's estimate, for a tree (a chain has none)
    tree: DraftTree | None = None  # the drafter's tree, told what verification kept

    @classmethod
    def chain(cls, token_ids: list[int]) -> _Draft:
        return cls(token_ids, None, len(token_ids), 1)

    @classmethod
    def tree_of(cls, tree: DraftTree) -> _Draft:
        """The drafter's tree. One that does not branch is verified as the chain it is: ordinary
        verify rows (no ancestor windows in attention, no K/V moves), the same tokens kept."""
        parents = None if tree.is_chain() else tuple(tree.parent_indexes)
        return cls(tree.token_ids, parents, tree.depth, tree.num_leaves, tree.expected_num_accepted_tokens, tree)


NO_DRAFT = _Draft([])


@dataclass(frozen=True)
class _StepPart:
    """One scheduled request's part of a step, as the engine carries it from the plan to postprocess."""

    state: RequestState
    num_tokens: int  # known tokens computed this step
    draft: _Draft  # speculative tokens verified on top of them
    piece: RequestSlice  # what the forward pass computes for it

    @property
    def draft_ids(self) -> list[int]:
        return self.draft.token_ids


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_runner = ModelRunner(config)  # the device, the model, the KV cache's memory
        self.model_config = self.model_runner.model_config
        self.tokenizer = self.model_runner.tokenizer
        self.kv = self.model_runner.kv
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.drafter = Drafter(
            max_draft_tokens=config.max_draft_tokens,
            max_ngram=config.draft_max_ngram,
            use_swarm_index=config.use_swarm_index,
        )
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self._requests: dict[str, RequestState] = {}
        # Ids of requests the engine ended itself (a finish reason), newest last: a plan built ahead of
        # the step that ended one may still schedule it (see rebase).
        self._finished_ids: OrderedDict[str, None] = OrderedDict()

    # ----------------------------------------------------------------- requests

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def get_request(self, request_id: str) -> RequestState:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequestError(f"unknown request id {request_id!r}") from None

    def validate_new_request(self, new: NewRequest) -> None:
        """The checks of its contents the scheduler's intake made too (service_common.request_checks,
        worded alike, with the request's id in front), then what only the executor knows: the
        requests in flight, and its grammar compiled against this model's tokens."""
        if not new.request_id:
            raise InvalidRequestError("request_id must not be empty")
        if new.request_id in self._requests:
            raise InvalidRequestError(f"request id {new.request_id!r} is already in flight")
        try:
            check_new_request(new, self.model_config.context_length, self.model_config.vocab_size)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"request {new.request_id!r}: {exc}") from None
        self._grammar_matcher(new)  # compiles it (then cached for _insert), or says what is wrong with it

    def _grammar_matcher(self, new: NewRequest) -> GrammarMatcher | None:
        if new.structured_output is None:
            return None
        try:
            return self.grammars.matcher(new.structured_output, new.output_token_ids)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"request {new.request_id!r}: {exc}") from None

    def add_request(self, new: NewRequest) -> None:
        self.validate_new_request(new)
        self._insert(new)

    def _insert(self, new: NewRequest) -> None:
        self._finished_ids.pop(new.request_id, None)
        seed = new.sampling.seed if new.sampling.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self._requests[new.request_id] = RequestState(new, new.token_ids, seed, self._grammar_matcher(new))
        self.drafter.add_request(new.request_id, new.token_ids)

    def release(self, request_id: str) -> None:
        """Forget a request and free its KV; releasing an unknown (e.g. already finished) id is a no-op."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            self.kv.free(request_id, state.new.retention_s)
            self.drafter.release(request_id)

    def preempt(self, request_id: str) -> None:
        """Free a request's KV but keep its tokens; later steps recompute them."""
        state = self.get_request(request_id)
        self.kv.free(request_id)  # recomputing from token 0 rebuilds the recurrent state too
        state.num_computed_tokens = 0

    # -------------------------------------------------------------------- steps

    def step(self, plan: StepRequest) -> StepResponse:
        """Execute a plan: once, then (up to `plan.max_runs`) again as one more decode token for
        each of its requests still decoding, each run as `run` does; one answer covers them all.
        Raises InvalidRequestError or OutOfKVBlocksError with nothing changed when the first run
        cannot be done, so the caller can fix the plan and try again. A later run that does not
        fit in the free KV is simply not done: the answer says how many runs were."""
        response = self.run(plan)
        for _ in range(plan.max_runs - 1):
            again = self._decode_again(plan)
            if not again.scheduled:
                break
            try:
                response = response.then(self.run(again))
            except OutOfKVBlocksError:
                break
        return response

    def _decode_again(self, plan: StepRequest) -> StepRequest:
        """The next run of `plan`: one token (and drafts up to its budget) for each of its requests
        still running with exactly its last sampled token to compute; nothing else."""
        return StepRequest(
            scheduled=[
                replace(s, num_tokens=1)
                for s in plan.scheduled
                if (state := self._requests.get(s.request_id)) is not None and state.num_pending_tokens == 1
            ]
        )

    def run(self, plan: StepRequest) -> StepResponse:
        """Run a plan once: apply it (releases, new requests, each scheduled request's KV and
        drafts), run the forward pass, postprocess (verify, append, commit KV, report). Raises
        InvalidRequestError or OutOfKVBlocksError with nothing changed, so the caller can fix the
        plan and try again."""
        t0 = time.perf_counter()
        parts = self._apply_plan(self.rebase(plan))
        if not parts:
            return self._step_response([], 0, 0, StepTimings(time.perf_counter() - t0, 0.0, 0.0), 0)
        batch = self.model_runner.prepare([part.piece for part in parts])
        t1 = time.perf_counter()
        logits = self.model_runner.forward(batch)  # [rows needing logits, vocab]
        t2 = time.perf_counter()
        outputs, grammar_s = self._postprocess(parts, logits)
        t3 = time.perf_counter()
        timings = StepTimings(t1 - t0, t2 - t1, t3 - t2, grammar_s)
        return self._step_response(outputs, batch.num_tokens, batch.num_attention_pairs, timings, batch.num_logits)

    # ---------------------------------------------------------- step: the plan

    def _apply_plan(self, plan: StepRequest) -> list[_StepPart]:
        """Check the plan, then carry out its releases, preemptions and new requests and give each
        scheduled request its KV: the step's parts, one per scheduled request."""
        self._validate(plan)
        computed, drafts = self._fit_in_kv(plan)
        for request_id in plan.released:
            self.release(request_id)
        for request_id in plan.preempted:
            self.preempt(request_id)
        for new in plan.new_requests:
            self._insert(new)
        # Take every cached prefix before growing anyone, so no growth evicts a block about to be shared.
        for request_id, blocks in computed.items():
            state = self._requests[request_id]
            state.num_computed_tokens = state.num_cached_tokens = self.kv.take_computed_blocks(request_id, blocks)
        return [self._allocate(s, drafts.get(s.request_id, NO_DRAFT)) for s in plan.scheduled]

    def _fit_in_kv(self, plan: StepRequest) -> tuple[dict[str, ComputedBlocks], dict[str, _Draft]]:
        """The plan's prefix hits and drafts, once its KV and state slots are known to fit (pure:
        raises OutOfKVBlocksError with nothing changed if they do not). Drafts are optional: they
        are dropped before the plan is refused."""
        leaving = {*plan.released, *plan.preempted}
        computed = self._computed_blocks(plan)
        drafts = self._propose_drafts(plan)
        if self._num_blocks_needed(plan, computed, drafts) > self.kv.num_blocks_available(leaving):
            drafts = {}
            needed = self._num_blocks_needed(plan, computed, drafts)
            available = self.kv.num_blocks_available(leaving)
            if needed > available:
                raise OutOfKVBlocksError(f"the plan needs {needed} new KV blocks but only {available} are free")
        self.kv.check_state_slots([s.request_id for s in plan.scheduled], leaving)
        return computed, drafts

    def _computed_blocks(self, plan: StepRequest) -> dict[str, ComputedBlocks]:
        """Cached blocks each scheduled request starting from zero can reuse (pure: nothing is taken yet)."""
        new = {n.request_id: n for n in plan.new_requests}
        leaving = {*plan.released, *plan.preempted}
        computed = {}
        for s in plan.scheduled:
            state = self._requests.get(s.request_id)
            if (
                state is not None
                and s.request_id not in leaving
                and (state.num_computed_tokens or self.kv.block_ids(s.request_id))
            ):
                continue
            blocks = self.kv.computed_blocks(new[s.request_id].token_ids if state is None else state.token_ids)
            if blocks.block_ids:
                computed[s.request_id] = blocks
        return computed

    def _num_blocks_needed(
        self, plan: StepRequest, computed: dict[str, ComputedBlocks], drafts: dict[str, _Draft]
    ) -> int:
        """Free KV blocks the plan consumes, from the tokens each scheduled request's KV holds after it."""
        leaving = {*plan.released, *plan.preempted}
        new_lengths = {n.request_id: len(n.token_ids) for n in plan.new_requests}
        num_tokens = {}
        for s in plan.scheduled:
            state = self._requests.get(s.request_id)
            if state is None or s.request_id in leaving:  # new, or starting over after a preemption
                num_cached = len(computed.get(s.request_id, NO_COMPUTED_BLOCKS).block_ids) * self.kv.block_size
                num_known = new_lengths[s.request_id] if state is None else len(state.token_ids)
                num_tokens[s.request_id] = num_cached + min(s.num_tokens, num_known - num_cached)
            else:
                num_draft_tokens = len(drafts.get(s.request_id, NO_DRAFT).token_ids)
                num_tokens[s.request_id] = state.num_computed_tokens + s.num_tokens + num_draft_tokens
        return self.kv.num_blocks_needed(num_tokens, computed, leaving)

    def _allocate(self, s: ScheduledRequest, draft: _Draft) -> _StepPart:
        """KV (and a state slot) for one scheduled request's tokens and drafts: its part of the step.
        A tree's nodes take the slots after the last token in node order (ragged_batch.py)."""
        state = self._requests[s.request_id]
        draft_ids = draft.token_ids
        # A prefix hit may have covered part of what the plan asked to compute.
        num_tokens = min(s.num_tokens, state.num_pending_tokens)
        start = state.num_computed_tokens
        end = start + num_tokens
        self.kv.allocate_slots(s.request_id, end + len(draft_ids))
        if (
            not draft_ids
        ):  # a prefill chunk may hold the prompt's last block boundary: where a hybrid's next turn resumes
            self.kv.plan_state_snapshot(s.request_id, state.token_ids, start, end)
        num_logits = 1 + len(draft_ids) if end == len(state.token_ids) else 0
        tree_parents = None
        if draft.parent_indexes is not None:  # drafts only ever follow exactly one token, the root
            tree_parents = (-1, *(parent + 1 for parent in draft.parent_indexes))
        piece = RequestSlice(
            state.token_ids[start:end] + draft_ids,
            start,
            self.kv.block_ids(s.request_id),
            num_logits,
            self.kv.state_slot(s.request_id),
            tree_parents,
        )
        return _StepPart(state, num_tokens, draft, piece)

    # --------------------------------------------------------- step: postprocess

    def _postprocess(self, parts: list[_StepPart], logits: torch.Tensor) -> tuple[list[RequestResult], float]:
        """Every request's new tokens from the logits [rows, vocab], with its KV and drafter
        brought up to date; also the seconds spent on grammar masks."""
        t0 = time.perf_counter()
        # Grammar rows are masked in place; logprobs stay the model's own (raw copies of masked rows).
        raw_rows = self._mask_grammar_rows(logits, parts)
        grammar_s = time.perf_counter() - t0
        argmax_ids = logits.argmax(dim=-1).tolist()
        outputs, row = [], 0
        for part in parts:
            outputs.append(self._postprocess_request(part, logits, argmax_ids, raw_rows, row))
            row += part.piece.num_logits
        return outputs, grammar_s

    def _postprocess_request(
        self, part: _StepPart, logits: torch.Tensor, argmax_ids: list[int], raw_rows: dict[int, torch.Tensor], row: int
    ) -> RequestResult:
        """One request's result; `row` is its first logits row."""
        state = part.state
        emitted, kept_nodes, logprobs = self._sample(part, logits, argmax_ids, raw_rows, row)
        num_accepted = len(kept_nodes)
        # KV holds the computed tokens plus the drafts that were kept; rejected drafts roll back.
        num_kept = min(num_accepted, len(emitted))  # fewer than accepted when an accepted draft finished the request
        first_draft_position = state.num_computed_tokens + part.num_tokens
        # A tree's kept path moves to the slots decoding would have used (a kept node never sits
        # before its destination, and no later source is overwritten: nodes on a path increase).
        moves = [(node, depth) for depth, node in enumerate(kept_nodes[:num_kept]) if node != depth]
        if moves:
            self.kv.move_tokens(
                state.request_id,
                [first_draft_position + node for node, _ in moves],
                [first_draft_position + depth for _, depth in moves],
            )
        state.num_computed_tokens += part.num_tokens + num_kept
        if self.kv.state_pool is not None and num_kept < len(part.draft_ids):
            # The recurrent state went through every draft: put back the one after the last kept token
            # (a finishing request too: commit may snapshot it).
            self.kv.restore_state(state.request_id, num_kept)
        self.kv.commit(state.request_id, state.token_ids, state.num_computed_tokens)
        if part.draft.tree is not None:
            self.drafter.observe_tree(part.draft.tree, kept_nodes)
        if emitted:
            self.drafter.append(state.request_id, emitted)
        num_draftable, expected_by_nodes = self._draft_outlook(state)
        output = RequestResult(
            request_id=state.request_id,
            new_token_ids=emitted,
            finish_reason=state.finish_reason,
            num_computed_tokens=state.num_computed_tokens,
            logprobs=logprobs,
            num_drafted_tokens=len(part.draft_ids),
            num_accepted_tokens=num_accepted,
            num_draftable_tokens=num_draftable,
            num_cached_tokens=state.num_cached_tokens,
            num_exclusive_blocks=self.kv.num_exclusive_blocks(state.request_id),
            draft_depth=part.draft.depth,
            num_draft_leaves=part.draft.num_leaves,
            expected_num_accepted_tokens=part.draft.expected_num_accepted_tokens,
            expected_accepted_tokens_by_nodes=expected_by_nodes,
            num_draft_misses=int(num_accepted < part.draft.depth),
        )
        if state.finish_reason is not None:
            self.release(state.request_id)
            self._finished_ids[state.request_id] = None
            if len(self._finished_ids) > MAX_FINISHED_IDS:
                self._finished_ids.popitem(last=False)
        return output

    def _sample(
        self, part: _StepPart, logits: torch.Tensor, argmax_ids: list[int], raw_rows: dict[int, torch.Tensor], row: int
    ) -> tuple[list[int], list[int], list[SampledToken]]:
        """The tokens a request emits from its logits rows (verified drafts, then the bonus token,
        cut at the one that finishes it), the draft nodes kept (a chain's: 0, 1, ...), and their
        logprobs if asked for. Nothing mid-prefill."""
        state = part.state
        if not part.piece.num_logits:
            return [], [], []
        rows = slice(row, row + part.piece.num_logits)
        spec = SampleSpec(state.sampling, state.seed, state.num_output_tokens)
        if part.draft.parent_indexes is None:
            emitted, num_accepted = verify(logits[rows], argmax_ids[rows], part.draft_ids, spec)
            kept_nodes = list(range(num_accepted))
        else:
            emitted, kept_nodes = verify_tree(
                logits[rows], argmax_ids[rows], part.draft_ids, part.draft.parent_indexes, spec
            )
        emitted = self._append_until_finish(state, emitted)
        logprobs = []
        if state.sampling.num_logprobs:
            # Emitted token j came from the row of the node before it (row 0: the last token).
            emitting_rows = [row] + [row + 1 + node for node in kept_nodes]
            logprobs = [
                token_logprobs(raw_rows.get(r, logits[r]), token_id, state.sampling.num_logprobs)
                for r, token_id in zip(emitting_rows, emitted)
            ]
        return emitted, kept_nodes, logprobs

    def rebase(self, plan: StepRequest) -> StepRequest:
        """A plan built ahead (overlapped scheduling), made exact against what the previous step left.

        The scheduler built it before the previous step's result was known,
        expecting every scheduled request's tokens to go into KV and one that
        reached its last known token to sample one more. What it cannot know:
        - a request the previous step finished (EOS, a stop token, length, a full
          context) is gone here: it is skipped, in `scheduled` and `preempted`,
          and gets no result (the scheduler saw its finish in that step's result);
        - a prefix hit may have covered more of a prompt than planned: each
          `num_tokens` is an upper bound, cut to the tokens not yet in KV (for a
          decode that is exactly the token the previous step sampled).
        A plan not built ahead is returned unchanged, and stays strictly validated.
        """
        if not plan.planned_after_step_id:
            return plan
        emptied = {*plan.released, *plan.preempted}
        scheduled = []
        for s in plan.scheduled:
            state = self._requests.get(s.request_id)
            if state is None and s.request_id in self._finished_ids:
                continue
            if state is not None and s.request_id not in emptied:
                s = replace(s, num_tokens=min(s.num_tokens, state.num_pending_tokens))
            scheduled.append(s)
        preempted = [r for r in plan.preempted if r in self._requests or r not in self._finished_ids]
        return replace(plan, scheduled=scheduled, preempted=preempted)

    def _mask_grammar_rows(self, logits: torch.Tensor, parts: list[_StepPart]) -> dict[int, torch.Tensor]:
        """Mask each grammar request's rows of logits [rows, V] in place to what its grammar allows
        there (see grammar.py). Returns the unmasked rows of requests that asked for logprobs, by row.
        A step without grammar requests does nothing here."""
        row_spans, logprob_rows, requests, row = [], [], [], 0
        for part in parts:
            num_logits = part.piece.num_logits
            if num_logits and part.state.grammar is not None:
                row_spans.append((row, num_logits))
                if part.state.sampling.num_logprobs:
                    logprob_rows.extend(range(row, row + num_logits))
                requests.append((part.state.grammar, part.draft_ids))
            row += num_logits
        if not requests:
            return {}
        raw_rows = {r: logits[r].clone() for r in logprob_rows}
        bitmask = fill_masks(requests, sum(n for _, n in row_spans), self.model_config.vocab_size)
        with torch.inference_mode():  # the forward pass made logits an inference tensor
            apply_masks(logits, row_spans, bitmask)
        return raw_rows

    def _drafts_trees(self, state: RequestState) -> bool:
        """Whether this request's budget buys a tree. Grammar requests draft chains: a matcher
        follows one path, and a tree would need one per branch to mask each node's row. Hybrid
        models draft chains: the recurrent state after a row is the state after every row
        before it in the step, so rows of different branches cannot share one pass (each
        branch would need its own replay from the window-start state)."""
        return self.config.draft_shape == "tree" and state.grammar is None and self.kv.state_pool is None

    def _draft_outlook(self, state: RequestState) -> tuple[int, list[float]]:
        """What the request's index could draft next step, and for a request that drafts trees,
        what each node budget would buy (RequestResult.expected_accepted_tokens_by_nodes).

        A tree request's draftable count is its next tree's node count, not the longest
        chain's: the scheduler caps a budget at it, and a tree may use nodes a chain cannot.
        When that tree does not branch, the request is offered what a chain request is: its
        count stops where the chain's does, at the history's end (the tree would go on into
        its own path, a bet on the text repeating: on the branchy workload at one agent, tree
        requests drafted 317-320 tokens against chains' 245-272 for the same accepted ones),
        and its curve is left out, so it is priced like a chain, by the scheduler's own
        acceptance estimate. One tree grown per step per tree request
        (O(max_draft_tokens * max_ngram) trie lookups): next step's propose_tree takes its first
        nodes while neither index has grown (Drafter.propose_tree).
        """
        if state.finish_reason is not None:
            return 0, []
        if not self._drafts_trees(state):
            return self.drafter.num_draftable(state.request_id), []
        tree = self.drafter.next_tree(state.request_id)
        if tree.is_chain():
            return min(tree.num_nodes, self.drafter.num_draftable(state.request_id)), []
        return tree.num_nodes, tree.expected_num_accepted_tokens_by_nodes()

    def _propose_drafts(self, plan: StepRequest) -> dict[str, _Draft]:
        """Draft tokens for decoding requests with a budget, capped so they cannot overrun
        max_new_tokens or the context (a tree's nodes in all, so its depth too), and a chain cut
        at the first token a request's grammar forbids."""
        drafts = {}
        gone = {*plan.released, *plan.preempted}
        for s in plan.scheduled:
            state = self._requests.get(s.request_id)
            if not s.draft_budget or state is None or s.request_id in gone or state.num_pending_tokens != 1:
                continue
            room = min(
                s.draft_budget,
                self.config.max_draft_tokens,
                state.new.max_new_tokens - state.num_output_tokens - 1,
                self.model_config.context_length - len(state.token_ids) - 1,
            )
            if room <= 0:
                continue
            if self._drafts_trees(state):
                tree = self.drafter.propose_tree(s.request_id, room)
                if tree.num_nodes:
                    drafts[s.request_id] = _Draft.tree_of(tree)
                continue
            proposed = self.drafter.propose(s.request_id, room)
            if proposed and state.grammar is not None:
                proposed = proposed[: state.grammar.num_valid(proposed)]
            if proposed:
                drafts[s.request_id] = _Draft.chain(proposed)
        return drafts

    def _append_until_finish(self, state: RequestState, emitted: list[int]) -> list[int]:
        """Append new tokens in order (advancing the request's grammar), stopping at the one that
        finishes the request; returns those appended."""
        for i, token_id in enumerate(emitted):
            state.token_ids.append(token_id)
            state.finish_reason = self._finish_reason(state, token_id)
            if state.grammar is not None:
                if not state.grammar.consume(token_id):
                    log.warning(
                        "grammar_failed", request_id=state.request_id, token_id=token_id, error=state.grammar.error
                    )
                # Complete (or failed): the grammar allows nothing more, whatever ignore_eos says.
                if state.finish_reason is None and state.grammar.is_stopped:
                    state.finish_reason = FinishReason.EOS
            if state.finish_reason is not None:
                return emitted[: i + 1]
        return emitted

    def _validate(self, plan: StepRequest) -> None:
        if not 1 <= plan.max_runs <= MAX_RUNS_PER_PLAN:
            raise InvalidRequestError(f"max_runs must be between 1 and {MAX_RUNS_PER_PLAN}, got {plan.max_runs}")
        new_ids = set()
        for new in plan.new_requests:
            self.validate_new_request(new)
            if new.request_id in new_ids:
                raise InvalidRequestError(f"request id {new.request_id!r} appears twice in new_requests")
            new_ids.add(new.request_id)
        gone = set(plan.released) | set(plan.preempted)
        if len(gone) < len(plan.released) + len(plan.preempted):
            twice = sorted(r for r in gone if (plan.released + plan.preempted).count(r) > 1)
            raise InvalidRequestError(f"request ids {twice[:5]} are listed more than once in released and preempted")
        for request_id in plan.preempted:
            if request_id not in self._requests:
                raise UnknownRequestError(f"cannot preempt unknown request id {request_id!r}")
        seen: set[str] = set()
        total = 0
        for s in plan.scheduled:
            if s.request_id in seen:
                raise InvalidRequestError(f"request {s.request_id!r} is scheduled twice in one step")
            seen.add(s.request_id)
            if s.request_id in new_ids:
                new = next(n for n in plan.new_requests if n.request_id == s.request_id)
                num_computed, num_known = 0, len(new.token_ids)
            elif s.request_id in self._requests and s.request_id not in plan.released:
                state = self._requests[s.request_id]
                num_known = len(state.token_ids)
                num_computed = 0 if s.request_id in gone else state.num_computed_tokens
            else:
                raise UnknownRequestError(f"the plan schedules unknown request id {s.request_id!r}")
            if s.num_tokens <= 0:
                raise InvalidRequestError(f"request {s.request_id!r}: num_tokens must be > 0, got {s.num_tokens}")
            if num_computed + s.num_tokens > num_known:
                raise InvalidRequestError(
                    f"request {s.request_id!r}: cannot compute {s.num_tokens} tokens, "
                    f"only {num_known - num_computed} are not yet in KV"
                )
            total += s.num_tokens
        if total > self.config.max_num_batched_tokens:
            raise InvalidRequestError(
                f"the plan computes {total} tokens, more than max_num_batched_tokens={self.config.max_num_batched_tokens}"
            )

    def _finish_reason(self, state: RequestState, token_id: int) -> FinishReason | None:
        if token_id in self.eos_token_ids and not state.new.ignore_eos:
            return FinishReason.EOS
        if token_id in state.new.stop_token_ids:
            return FinishReason.STOP_TOKEN
        if state.num_output_tokens >= state.new.max_new_tokens:
            return FinishReason.LENGTH
        if len(state.token_ids) >= self.model_config.context_length:
            return FinishReason.CONTEXT_FULL
        return None

    def _step_response(
        self,
        outputs: list[RequestResult],
        num_tokens: int,
        num_attention_pairs: int,
        timings: StepTimings,
        num_logits_rows: int,
    ) -> StepResponse:
        return StepResponse(
            num_logits_rows=num_logits_rows,
            num_requests=len(outputs),
            outputs=outputs,
            num_computed_tokens=num_tokens,
            num_attention_pairs=num_attention_pairs,
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_usable_blocks,
            timings=timings,
        )
