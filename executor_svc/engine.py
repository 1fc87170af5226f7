"""The executor engine: requests in, one step per plan, tokens out.

The engine does exactly what a plan says. It holds every request's tokens and KV
blocks; the scheduler decides who runs and how many tokens each computes. A
request is *prefilling* while tokens it already knows (its prompt, or prompt and
output after a preemption) are not in the KV cache yet; when a step computes up
to its last known token, that step also samples its next token.

Every plan is validated before anything changes, so a bad plan raises and the
engine carries on serving everyone else.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace

import structlog
import torch

from executor_svc.errors import OutOfKVBlocksError, OutOfStateSlotsError, UnknownRequestError
from executor_svc.gguf_file import open_gguf
from executor_svc.hybrid_model import HybridTransformer
from executor_svc.kv_cache import KVCache
from executor_svc.load_progress import load_progress
from executor_svc.model import Transformer
from executor_svc.model_config import ModelConfig
from executor_svc.model_source import resolve_model_path
from executor_svc.model_weights import load_weights
from executor_svc.ragged_batch import RaggedBatch, RequestSlice
from executor_svc.recurrent_state import RecurrentStatePool
from executor_svc.request_state import FinishReason, NewRequest, RequestState
from executor_svc.block_allocator import block_hash, root_hash
from executor_svc.config import MATMULS, EngineConfig
from executor_svc.drafter import Drafter
from executor_svc.grammar import GrammarCompiler, GrammarMatcher, apply_masks, fill_masks
from executor_svc.sampler import SampledToken, SampleSpec, token_logprobs
from executor_svc.tokenizer import load_tokenizer
from executor_svc.torch_ops import TorchOps
from executor_svc.verifier import verify
from service_common.errors import InvalidRequestError

log = structlog.get_logger()

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MAX_FINISHED_IDS = 4096  # ended requests remembered for plans built ahead (a plan is at most a step or two behind)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA/ROCm device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on a GPU; float32 on the CPU, where the packed-weight kernels compute
    in float32 whatever the activations' dtype, so bfloat16 activations would only add
    conversions and rounding (measured: see the README's CPU section)."""
    if name != "auto":
        return DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_matmul(name: str, dtype_name: str, device: torch.device, kernels: str) -> str:
    """How packed weights multiply. `exact`: dequantized in registers, float32 math (the
    reference). `int16`: activations quantized to int16 per 32-value block and dotted with
    the integer codes of Q4_0/Q4_1/Q8_0 blocks (other types stay exact; see qlinear.cpp).
    `auto`: int16 with the C++ kernels on a CPU that has them, unless `--dtype float32` was
    asked for, which stays the exact reference mode."""
    if name not in MATMULS:
        raise ValueError(f"matmul must be one of {MATMULS}, got {name!r}")
    uses_cpu_kernels = device.type == "cpu" and kernels in ("auto", "cpu")
    if name == "auto":
        if not uses_cpu_kernels or dtype_name == "float32":
            return "exact"
        from executor_svc.weight_format import has_int16_dot

        return "int16" if has_int16_dot() else "exact"
    if name == "int16" and not uses_cpu_kernels:
        raise ValueError("matmul='int16' runs with the C++ CPU kernels (--device cpu, --kernels auto|cpu)")
    return name


def resolve_ops(kernels: str, device: torch.device):
    """The hot-path ops: Triton kernels on a GPU, the C++ kernels on the CPU, plain torch when asked."""
    from executor_svc.kernels import triton_available

    if kernels == "auto":
        kernels = "triton" if device.type == "cuda" else "cpu"
    if kernels == "torch":
        return TorchOps()
    if kernels == "cpu":
        if device.type != "cpu":
            raise ValueError("kernels='cpu' runs on the CPU; use --device cpu or --kernels triton|torch")
        from executor_svc.cpu_ops import CpuOps

        return CpuOps()
    if not triton_available():
        raise ValueError("kernels='triton' needs triton and a CUDA/ROCm device (or TRITON_INTERPRET=1)")
    from executor_svc.kernels.triton_ops import TritonOps

    return TritonOps()


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    num_tokens: int  # tokens to compute this step: a prefill chunk, or 1 to decode
    draft_budget: int = 0  # speculative tokens it may verify on top of a decode token


@dataclass(frozen=True)
class StepPlan:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    released: list[str] = field(default_factory=list)  # finished or aborted: free everything
    preempted: list[str] = field(default_factory=list)  # free KV, keep tokens, recompute later
    # Nonzero: built by an overlapped scheduler before that step's result was known (see Engine.rebase).
    planned_after_step_id: int = 0


@dataclass(frozen=True)
class RequestOutput:
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


@dataclass(frozen=True)
class CostSample:
    num_tokens: int  # tokens computed
    num_kv_tokens: int  # KV tokens read
    forward_s: float
    num_logits_rows: int = 1  # rows the LM head and the sampler ran on
    num_requests: int = 1
    step_s: float = 0.0  # forward plus picking the tokens (argmax), as a real step's prepare + forward + sample


@dataclass(frozen=True)
class StepTimings:
    prepare_s: float
    forward_s: float
    sample_s: float
    grammar_s: float = 0.0  # of sample_s: computing and applying the grammar masks (0 without grammar requests)


@dataclass(frozen=True)
class StepOutput:
    outputs: list[RequestOutput]
    num_computed_tokens: int
    num_kv_tokens: int  # KV tokens the step's attention read (sum of context lengths): for the cost model
    num_free_blocks: int
    num_total_blocks: int
    timings: StepTimings
    num_logits_rows: int = 0  # rows the LM head and the sampler ran on: for the cost model
    num_requests: int = 0  # requests the step computed tokens for


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = resolve_device(config.device)
        self.model_path = resolve_model_path(config.model)
        gguf = open_gguf(self.model_path)
        self.model_config = ModelConfig.from_gguf(gguf)
        self.tokenizer = load_tokenizer(gguf)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.matmul = resolve_matmul(config.matmul, config.dtype, self.device, config.kernels)
        self.ops = resolve_ops(config.kernels, self.device)
        # With the Triton kernels the weights stay GGUF blocks on the device (resident ≈ the file's size).
        is_triton = self.ops.name == "triton"
        with load_progress(gguf) as loading:
            weights = load_weights(
                loading, self.model_config, self.dtype, self.device, int16_dot=self.matmul == "int16", triton=is_triton
            )
        self.weight_bytes = weights.num_bytes
        # Hybrid models keep a recurrent state per running request beside the paged KV of their attention layers.
        self.state_pool: RecurrentStatePool | None = None
        kv_bytes = config.kv_cache_bytes
        if self.model_config.is_hybrid:
            self.model = HybridTransformer(
                self.model_config, weights, self.device, self.ops, self.dtype, batch_invariant=config.batch_invariant
            )
            self.state_pool = RecurrentStatePool(self.model_config, config.num_state_slots, self.dtype, self.device)
            kv_bytes -= config.num_state_slots * self.state_pool.bytes_per_slot
            if kv_bytes <= 0:
                raise ValueError(
                    f"kv_cache_bytes={config.kv_cache_bytes} does not even hold the {config.num_state_slots} recurrent-state "
                    f"slots ({self.state_pool.bytes_per_slot} bytes each); raise it or lower num_state_slots"
                )
        else:
            self.model = Transformer(self.model_config, weights, self.device, self.ops, self.dtype)
        self.kv_cache = KVCache.from_memory_budget(self.model_config, kv_bytes, config.block_size, self.dtype, self.device)
        self.decode_graphs = None
        if config.decode_graphs and self.device.type == "cuda" and is_triton and self.state_pool is None:
            from executor_svc.decode_graphs import DecodeGraphs

            self.decode_graphs = DecodeGraphs(self.model, self.kv_cache)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.drafter = Drafter(max_draft_tokens=config.max_draft_tokens, use_swarm_index=config.use_swarm_index)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        # Packed-weight kernels are row-invariant by construction; dense fp32 CPU GEMMs group rows
        # in fours (see ragged_batch.py); on a GPU padding buys nothing.
        is_dense_cpu = self.device.type == "cpu" and not weights.is_packed
        self._row_multiple = 4 if config.batch_invariant and is_dense_cpu else 1
        self._requests: dict[str, RequestState] = {}
        # Ids of requests the engine ended itself (a finish reason), newest last: a plan built ahead of
        # the step that ended one may still schedule it (see rebase).
        self._finished_ids: OrderedDict[str, None] = OrderedDict()
        # KV depends on the weights and the dtype: a cached block is only valid for this model as loaded.
        self._prefix_root = root_hash(f"{self.model_path.resolve()}:{self.model_path.stat().st_size}:{self.dtype}")

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
        ctx, vocab = self.model_config.context_length, self.model_config.vocab_size
        if not new.request_id:
            raise InvalidRequestError("request_id must not be empty")
        if new.request_id in self._requests:
            raise InvalidRequestError(f"request id {new.request_id!r} is already in flight")
        if not new.prompt_token_ids:
            raise InvalidRequestError(f"request {new.request_id!r}: prompt_token_ids is empty")
        if len(new.prompt_token_ids) + len(new.output_token_ids) >= ctx:
            already = f" (+ {len(new.output_token_ids)} already generated)" if new.output_token_ids else ""
            raise InvalidRequestError(
                f"request {new.request_id!r}: prompt of {len(new.prompt_token_ids)} tokens{already} leaves no room "
                f"to generate in the model's context of {ctx} tokens"
            )
        if len(new.output_token_ids) >= new.max_new_tokens > 0:
            raise InvalidRequestError(
                f"request {new.request_id!r}: {len(new.output_token_ids)} tokens already generated, "
                f"max_new_tokens={new.max_new_tokens}: nothing is left to generate"
            )
        bad = [t for t in (*new.prompt_token_ids, *new.output_token_ids) if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"request {new.request_id!r}: prompt_token_ids {bad[:5]} outside the vocabulary [0, {vocab})"
            )
        bad_stop = [t for t in new.stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise InvalidRequestError(
                f"request {new.request_id!r}: stop_token_ids {bad_stop[:5]} outside the vocabulary [0, {vocab})"
            )
        if not (math.isfinite(new.retention_s) and new.retention_s >= 0):
            raise InvalidRequestError(f"request {new.request_id!r}: retention_s must be a finite number >= 0, got {new.retention_s}")
        if new.max_new_tokens <= 0:
            raise InvalidRequestError(f"request {new.request_id!r}: max_new_tokens must be > 0, got {new.max_new_tokens}")
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
        self._requests[new.request_id] = RequestState(
            request_id=new.request_id,
            token_ids=new.token_ids,
            num_prompt_tokens=len(new.prompt_token_ids),
            sampling=new.sampling,
            seed=seed,
            max_new_tokens=new.max_new_tokens,
            stop_token_ids=frozenset(new.stop_token_ids),
            ignore_eos=new.ignore_eos,
            session_id=new.session_id,
            retention_s=new.retention_s,
            grammar=self._grammar_matcher(new),
        )
        self.drafter.add_request(new.request_id, new.token_ids)

    def release(self, request_id: str) -> None:
        """Forget a request and free its KV; releasing an unknown (e.g. already finished) id is a no-op."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            retain_until = time.monotonic() + state.retention_s if state.retention_s > 0 else None
            self.kv_cache.release(state.block_ids, retain_until)
            self._free_state_slot(state)
            self.drafter.release(request_id)

    def preempt(self, request_id: str) -> None:
        """Free a request's KV but keep its tokens; later steps recompute them."""
        state = self.get_request(request_id)
        self.kv_cache.release(state.block_ids)
        self._free_state_slot(state)  # recomputing from token 0 rebuilds the recurrent state
        state.num_computed_tokens = state.num_registered_blocks = 0

    def _free_state_slot(self, state: RequestState) -> None:
        if state.state_slot >= 0:
            self.state_pool.free(state.state_slot)
            state.state_slot = -1

    # -------------------------------------------------------------- calibration

    def calibrate(
        self,
        token_counts: tuple[int, ...] = (1, 4, 8, 16, 32, 64),
        context_lens: tuple[int, ...] = (0, 512),
        reps: int = 1,
        batch_sizes: tuple[int, ...] = (4, 16),
    ) -> list[CostSample]:
        """Time forward passes (and the argmax that picks their tokens) of scratch requests over a grid of step shapes.

        One request computing T tokens at each context length (a prefill chunk
        ending its prompt: one logits row), then B requests decoding one token
        each and one request verifying T − 1 drafts (T logits rows), so the
        scheduler's cost model can tell per-token, per-row and per-request
        costs apart before any real step has run. Uses free KV blocks and
        gives them back; call it while no request runs.
        """
        bs = self.kv_cache.block_size
        shapes = []  # (context length, tokens per request, logits rows per request, requests)
        for context_len in context_lens:
            shapes += [(context_len, n, 1, 1) for n in token_counts]
            shapes += [(context_len, 1, 1, b) for b in batch_sizes]
            shapes += [(context_len, n, n, 1) for n in token_counts if 1 < n <= 16]
        max_context = self.model_config.context_length - max(token_counts)
        samples = []
        for context_len, num_tokens, num_logits, num_requests in shapes:
            context_len = min(context_len, max_context)
            needed = num_requests * self.kv_cache.num_blocks_for(context_len + num_tokens)
            if needed > self.kv_cache.num_free_blocks:
                continue
            if self.state_pool is not None and not self.state_pool.can_allocate(num_requests):
                continue
            block_lists: list[list[int]] = [[] for _ in range(num_requests)]
            slots = [self.state_pool.allocate() for _ in range(num_requests)] if self.state_pool is not None else [-1] * num_requests
            try:
                for block_ids in block_lists:
                    self.kv_cache.grow(block_ids, context_len + num_tokens)
                pieces = [
                    RequestSlice([0] * num_tokens, context_len, block_ids, num_logits, slot)
                    for block_ids, slot in zip(block_lists, slots)
                ]
                forward_times, step_times = [], []
                for _ in range(reps + 1):  # the first pass warms up
                    t0 = time.perf_counter()
                    batch = RaggedBatch.build(pieces, bs, self.device, self._row_multiple)
                    t1 = time.perf_counter()
                    logits = self._forward(batch)
                    t2 = time.perf_counter()
                    logits.argmax(dim=-1).tolist()
                    t3 = time.perf_counter()
                    forward_times.append(t2 - t1)
                    step_times.append(t3 - t0)
                samples.append(
                    CostSample(
                        num_tokens * num_requests,
                        (context_len + num_tokens) * num_requests,
                        min(forward_times[1:]),
                        num_logits * num_requests,
                        num_requests,
                        min(step_times[1:]),
                    )
                )
            finally:
                for block_ids in block_lists:
                    self.kv_cache.release(block_ids)
                for slot in slots:
                    if slot >= 0:
                        self.state_pool.free(slot)
        return samples

    # -------------------------------------------------------------------- steps

    def step(self, plan: StepPlan) -> StepOutput:
        """Execute one plan. Raises InvalidRequestError or OutOfKVBlocksError with
        nothing changed, so the caller can fix the plan and try again."""
        t0 = time.perf_counter()
        plan = self.rebase(plan)
        self._validate(plan)
        hits = self._prefix_hits(plan)
        drafts = self._propose_drafts(plan)
        if not self._has_kv_room(plan, hits, drafts):
            drafts = {}  # drafts are optional: drop them before refusing the plan
            if not self._has_kv_room(plan, hits, drafts):
                raise OutOfKVBlocksError(
                    f"the plan needs {self._num_blocks_needed(plan, hits, drafts)} new KV blocks but only "
                    f"{self._num_blocks_available(plan)} are free"
                )
        self._check_state_slots(plan)
        for request_id in plan.released:
            self.release(request_id)
        for request_id in plan.preempted:
            self.preempt(request_id)
        for new in plan.new_requests:
            self._insert(new)
        # Take every cached prefix before growing anyone, so no growth evicts a block about to be shared.
        for request_id, block_ids in hits.items():
            self._reuse_prefix(self._requests[request_id], block_ids)

        work = []
        for s in plan.scheduled:
            state = self._requests[s.request_id]
            if self.state_pool is not None and state.state_slot < 0:
                state.state_slot = self.state_pool.allocate()  # zeroed: the state before token 0
            # A prefix hit may have covered part of what the plan asked to compute.
            num_tokens = min(s.num_tokens, len(state.token_ids) - state.num_computed_tokens)
            work.append((state, num_tokens, drafts.get(s.request_id, [])))
        if not work:
            return self._step_output([], 0, 0, StepTimings(time.perf_counter() - t0, 0.0, 0.0), 0)
        slices = []
        for state, num_tokens, draft_ids in work:
            start = state.num_computed_tokens
            end = start + num_tokens
            self.kv_cache.grow(state.block_ids, end + len(draft_ids))
            num_logits = 1 + len(draft_ids) if end == len(state.token_ids) else 0
            slices.append(RequestSlice(state.token_ids[start:end] + draft_ids, start, state.block_ids, num_logits, state.state_slot))
        batch = RaggedBatch.build(slices, self.kv_cache.block_size, self.device, self._row_multiple)
        t1 = time.perf_counter()
        logits = self._forward(batch)  # [rows needing logits, vocab]
        t2 = time.perf_counter()
        # Grammar rows are masked in place; logprobs stay the model's own (raw copies of masked rows).
        raw_rows = self._mask_grammar_rows(logits, work, slices)
        t_grammar = time.perf_counter() - t2
        argmax_ids = logits.argmax(dim=-1).tolist()

        outputs = []
        row = 0
        for (state, num_tokens, draft_ids), piece in zip(work, slices):
            emitted, num_accepted, logprobs = [], 0, []
            if piece.num_logits:
                rows = slice(row, row + piece.num_logits)
                spec = SampleSpec(state.sampling, state.seed, state.num_output_tokens)
                emitted, num_accepted = verify(logits[rows], argmax_ids[rows], draft_ids, spec)
                emitted = self._append_until_finish(state, emitted)
                if state.sampling.num_logprobs:
                    logprobs = [
                        token_logprobs(raw_rows.get(row + j, logits[row + j]), token_id, state.sampling.num_logprobs)
                        for j, token_id in enumerate(emitted)
                    ]
                row += piece.num_logits
            # KV holds the computed tokens plus the drafts that were kept; rejected drafts roll back.
            state.num_computed_tokens += num_tokens + min(num_accepted, len(emitted))
            self.kv_cache.truncate(state.block_ids, state.num_computed_tokens)
            if self.state_pool is not None and num_accepted < len(draft_ids) and state.finish_reason is None:
                # The recurrent state went through every draft: put back the one after the last kept token
                # (window position 0 is the decode token, position j its j-th draft).
                self.state_pool.restore_window(state.state_slot, num_accepted)
            if emitted:
                self.drafter.append(state.request_id, emitted)
            self._register_full_blocks(state)
            outputs.append(
                RequestOutput(
                    request_id=state.request_id,
                    new_token_ids=emitted,
                    finish_reason=state.finish_reason,
                    num_computed_tokens=state.num_computed_tokens,
                    logprobs=logprobs,
                    num_drafted_tokens=len(draft_ids),
                    num_accepted_tokens=num_accepted,
                    num_draftable_tokens=0 if state.finish_reason else self.drafter.num_draftable(state.request_id),
                    num_cached_tokens=state.num_cached_tokens,
                    num_exclusive_blocks=sum(1 for b in state.block_ids if self.kv_cache.allocator.ref_count(b) == 1),
                )
            )
            if state.finish_reason is not None:
                self.release(state.request_id)
                self._finished_ids[state.request_id] = None
                if len(self._finished_ids) > MAX_FINISHED_IDS:
                    self._finished_ids.popitem(last=False)
        t3 = time.perf_counter()
        return self._step_output(
            outputs, batch.num_tokens, sum(batch.context_lens), StepTimings(t1 - t0, t2 - t1, t3 - t2, t_grammar), batch.num_logits
        )

    def _forward(self, batch: RaggedBatch) -> torch.Tensor:
        """The model's logits for the batch: replayed from a captured graph when it is a plain decode step."""
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            return self.decode_graphs.forward(batch)
        return self.model.forward(batch, self.kv_cache, self.state_pool)

    def rebase(self, plan: StepPlan) -> StepPlan:
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
                s = replace(s, num_tokens=min(s.num_tokens, state.num_uncomputed_tokens))
            scheduled.append(s)
        preempted = [r for r in plan.preempted if r in self._requests or r not in self._finished_ids]
        return replace(plan, scheduled=scheduled, preempted=preempted)

    def _mask_grammar_rows(
        self, logits: torch.Tensor, work: list[tuple[RequestState, int, list[int]]], slices: list[RequestSlice]
    ) -> dict[int, torch.Tensor]:
        """Mask each grammar request's rows of logits [rows, V] in place to what its grammar allows
        there (see grammar.py). Returns the unmasked rows of requests that asked for logprobs, by row.
        A step without grammar requests does nothing here."""
        row_spans, logprob_rows, requests, row = [], [], [], 0
        for (state, _, draft_ids), piece in zip(work, slices):
            if piece.num_logits and state.grammar is not None:
                row_spans.append((row, piece.num_logits))
                if state.sampling.num_logprobs:
                    logprob_rows.extend(range(row, row + piece.num_logits))
                requests.append((state.grammar, draft_ids))
            row += piece.num_logits
        if not requests:
            return {}
        raw_rows = {r: logits[r].clone() for r in logprob_rows}
        bitmask = fill_masks(requests, sum(n for _, n in row_spans), self.model_config.vocab_size)
        with torch.inference_mode():  # the forward pass made logits an inference tensor
            apply_masks(logits, row_spans, bitmask)
        return raw_rows

    def _propose_drafts(self, plan: StepPlan) -> dict[str, list[int]]:
        """Draft tokens for decoding requests with a budget, capped so they cannot overrun
        max_new_tokens or the context, and cut at the first token a request's grammar forbids."""
        drafts = {}
        gone = {*plan.released, *plan.preempted}
        for s in plan.scheduled:
            state = self._requests.get(s.request_id)
            if not s.draft_budget or state is None or s.request_id in gone or state.num_uncomputed_tokens != 1:
                continue
            room = min(
                s.draft_budget,
                self.config.max_draft_tokens,
                state.max_new_tokens - state.num_output_tokens - 1,
                self.model_config.context_length - len(state.token_ids) - 1,
            )
            if room > 0:
                proposed = self.drafter.propose(s.request_id, room)
                if proposed and state.grammar is not None:
                    proposed = proposed[: state.grammar.num_valid(proposed)]
                if proposed:
                    drafts[s.request_id] = proposed
        return drafts

    def _append_until_finish(self, state: RequestState, emitted: list[int]) -> list[int]:
        """Append new tokens in order (advancing the request's grammar), stopping at the one that
        finishes the request; returns those appended."""
        for i, token_id in enumerate(emitted):
            state.token_ids.append(token_id)
            state.finish_reason = self._finish_reason(state, token_id)
            if state.grammar is not None:
                if not state.grammar.consume(token_id):
                    log.warning("grammar_failed", request_id=state.request_id, token_id=token_id, error=state.grammar.error)
                # Complete (or failed): the grammar allows nothing more, whatever ignore_eos says.
                if state.finish_reason is None and state.grammar.is_stopped:
                    state.finish_reason = FinishReason.EOS
            if state.finish_reason is not None:
                return emitted[: i + 1]
        return emitted

    def _validate(self, plan: StepPlan) -> None:
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

    def _blocks_freed_by(self, plan: StepPlan) -> set[int]:
        """Blocks the plan's releases and preemptions leave without a holder."""
        leaving = [self._requests[r] for r in {*plan.released, *plan.preempted} if r in self._requests]
        holders = Counter(b for state in leaving for b in state.block_ids)
        return {b for b, n in holders.items() if self.kv_cache.allocator.ref_count(b) == n}

    def _num_blocks_available(self, plan: StepPlan) -> int:
        """Free blocks once the plan's releases and preemptions have freed theirs."""
        return self.kv_cache.num_free_blocks + len(self._blocks_freed_by(plan))

    def _num_blocks_needed(self, plan: StepPlan, hits: dict[str, list[int]], drafts: dict[str, list[int]]) -> int:
        """Free blocks the plan consumes: new blocks, plus cached-but-unused blocks it reuses.

        A hit on a block the same plan's releases free is counted too: the release
        puts it among the free blocks (see _num_blocks_available), and reusing it takes it out.
        """
        emptied = {*plan.released, *plan.preempted}
        new_lengths = {n.request_id: len(n.token_ids) for n in plan.new_requests}
        allocator = self.kv_cache.allocator
        freed = self._blocks_freed_by(plan)
        needed = len({b for block_ids in hits.values() for b in block_ids if allocator.is_evictable(b) or b in freed})
        for s in plan.scheduled:
            state = self._requests.get(s.request_id)
            if state is None or s.request_id in emptied:  # new, or starting over after a preemption
                num_cached = len(hits.get(s.request_id, ())) * self.kv_cache.block_size
                num_known = new_lengths[s.request_id] if state is None else len(state.token_ids)
                num_tokens = min(s.num_tokens, num_known - num_cached)
                needed += self.kv_cache.num_blocks_for(num_cached + num_tokens) - len(hits.get(s.request_id, ()))
            else:
                num_tokens = s.num_tokens + len(drafts.get(s.request_id, ()))
                needed += self.kv_cache.num_new_blocks_needed(state.block_ids, state.num_computed_tokens + num_tokens)
        return needed

    def _has_kv_room(self, plan: StepPlan, hits: dict[str, list[int]], drafts: dict[str, list[int]]) -> bool:
        return self._num_blocks_needed(plan, hits, drafts) <= self._num_blocks_available(plan)

    def _check_state_slots(self, plan: StepPlan) -> None:
        """A hybrid model computes a request only with a recurrent-state slot: refuse (nothing
        changed) a plan that would run more requests than there are slots, counting the slots
        its releases and preemptions give back."""
        if self.state_pool is None:
            return
        emptied = {*plan.released, *plan.preempted}
        freed = sum(1 for r in emptied if r in self._requests and self._requests[r].state_slot >= 0)
        needed = 0
        for s in plan.scheduled:
            state = self._requests.get(s.request_id)
            if state is None or s.request_id in emptied or state.state_slot < 0:
                needed += 1
        available = self.state_pool.num_free_slots + freed
        if needed > available:
            raise OutOfStateSlotsError(
                f"the plan starts {needed} requests but only {available} of {self.state_pool.num_slots} "
                f"recurrent-state slots are free (each running request of a hybrid model holds one)"
            )

    # ---------------------------------------------------------- prefix cache

    def _extend_block_hashes(self, token_ids: list[int], block_hashes: list[bytes], num_blocks: int) -> None:
        """Grow a hash chain in place to cover the first `num_blocks` full blocks of token_ids."""
        bs = self.kv_cache.block_size
        for i in range(len(block_hashes), num_blocks):
            parent = block_hashes[-1] if block_hashes else self._prefix_root
            block_hashes.append(block_hash(parent, token_ids[i * bs : (i + 1) * bs]))

    def _prefix_hits(self, plan: StepPlan) -> dict[str, list[int]]:
        """Cached blocks each request starting from zero can reuse (pure: nothing is taken yet).

        Only blocks wholly before the last known token count: that token must be
        computed to produce logits, and a shared block is never written into.
        """
        if not self.config.enable_prefix_caching or self.state_pool is not None:
            return {}  # a hybrid's prefix would also need its recurrent state at the block boundary
        new = {n.request_id: n for n in plan.new_requests}
        emptied = {*plan.released, *plan.preempted}
        hits = {}
        for s in plan.scheduled:
            state = self._requests.get(s.request_id)
            if state is not None and s.request_id not in emptied and (state.num_computed_tokens or state.block_ids):
                continue
            token_ids = new[s.request_id].token_ids if state is None else state.token_ids
            block_hashes = [] if state is None else state.block_hashes
            max_blocks = (len(token_ids) - 1) // self.kv_cache.block_size
            self._extend_block_hashes(token_ids, block_hashes, max_blocks)
            found = []
            for h in block_hashes[:max_blocks]:
                block_id = self.kv_cache.allocator.lookup(h)
                if block_id is None:
                    break
                found.append(block_id)
            if found:
                hits[s.request_id] = found
        return hits

    def _reuse_prefix(self, state: RequestState, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.kv_cache.allocator.share(block_id)
        state.block_ids = list(block_ids)
        state.num_registered_blocks = len(block_ids)
        state.num_computed_tokens = state.num_cached_tokens = len(block_ids) * self.kv_cache.block_size

    def _register_full_blocks(self, state: RequestState) -> None:
        """Cache every block the request has completely computed and not registered yet."""
        if not self.config.enable_prefix_caching or self.state_pool is not None:
            return
        num_full = state.num_computed_tokens // self.kv_cache.block_size
        if num_full <= state.num_registered_blocks:
            return
        self._extend_block_hashes(state.token_ids, state.block_hashes, num_full)
        for i in range(state.num_registered_blocks, num_full):
            self.kv_cache.allocator.register(state.block_ids[i], state.block_hashes[i])
        state.num_registered_blocks = num_full

    def _finish_reason(self, state: RequestState, token_id: int) -> FinishReason | None:
        if token_id in self.eos_token_ids and not state.ignore_eos:
            return FinishReason.EOS
        if token_id in state.stop_token_ids:
            return FinishReason.STOP_TOKEN
        if state.num_output_tokens >= state.max_new_tokens:
            return FinishReason.LENGTH
        if len(state.token_ids) >= self.model_config.context_length:
            return FinishReason.CONTEXT_FULL
        return None

    def _step_output(
        self, outputs: list[RequestOutput], num_tokens: int, num_kv_tokens: int, timings: StepTimings, num_logits_rows: int
    ) -> StepOutput:
        return StepOutput(
            num_logits_rows=num_logits_rows,
            num_requests=len(outputs),
            outputs=outputs,
            num_computed_tokens=num_tokens,
            num_kv_tokens=num_kv_tokens,
            num_free_blocks=self.kv_cache.num_free_blocks,
            num_total_blocks=self.kv_cache.num_usable_blocks,
            timings=timings,
        )
