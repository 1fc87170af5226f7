"""Structured output: a grammar per request, and the logit masks that keep sampling inside it.

llguidance compiles a request's grammar (a JSON schema, any JSON object, a Lark
grammar, a regex) against the model's token table into a matcher. Each step the
matcher says which tokens may come next (a bitmask, one bit per token); the engine
sets every other logit to -inf before the argmax or the sampler looks at the row,
and the tokens the step emits advance the matcher. Requests without a grammar
never reach this module: a step with none costs nothing extra.

Speculation stays lossless. A draft is cut at the first token the grammar forbids
(`num_valid`). A request's verify rows are masked per position: row j (the
distribution after draft d_j) with the matcher state after d_1..d_j, which
`fill_masks` reaches by consuming the drafts and rolling them back. Row j's mask
is therefore exactly the one plain decoding would use at that position had
d_1..d_j been emitted, so every kept draft and the bonus token are what plain
decoding would pick (greedy: the same argmax; sampled: the same distribution and
uniform); the matcher then consumes just the emitted tokens.

The end: a matcher that has stopped (it consumed EOS, or nothing can follow)
ends its request with reason EOS. That holds under `ignore_eos` too: ignore_eos
keeps EOS from ending a request the grammar has not ended, but once the grammar is
complete, no further token would be grammatical.

Why llguidance (vs xgrammar): on the embedded model's 49152-token vocabulary a
typical JSON schema compiled in ~1.5-10 ms vs ~30-50 ms, the compile being on
each new request's critical path; per-step masks cost 0.03 ms (xgrammar 0.003 ms)
for one request, both far below a step; and it needs no torch/triton/tvm-ffi, so
the scheduler can validate grammars at intake with the same library.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from executor_svc.weights.tokenizer import TokenizerInfo
from service_common.errors import InvalidRequestError
from service_common.structured_output import StructuredOutput

MAX_CACHED_GRAMMARS = 64  # agents send the same tool and response schemas again and again


class GrammarMatcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens the grammar allows from here (nothing is consumed)."""
        return self.matcher.validate_tokens(list(token_ids))

    def consume(self, token_id: int) -> bool:
        """Advance past a sampled token; False leaves the matcher stopped in an error state
        (a token the mask allowed is always accepted, so that would be llguidance's own
        limit, e.g. a grammar too complex to follow, or a bug)."""
        return self.matcher.consume_token(token_id)

    @property
    def is_stopped(self) -> bool:
        """Nothing more may follow: EOS was consumed, the grammar admits no extension, or an error."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class GrammarCompiler:
    """Compiles grammars against one model's token table; keeps recently compiled ones.

    The token table (llguidance's LLTokenizer) takes about a second to build for a
    50k vocabulary, so it is built at the first grammar, not at start-up.
    """

    def __init__(self, tokenizer: TokenizerInfo, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @functools.cached_property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        # Built from the same tokenizer.json the scheduler gets: CONTROL tokens are special there,
        # so a grammar can name them (`<|im_end|>`) but never produces them as text. EOS: every
        # end-of-turn id the model has.
        return llguidance.LLTokenizer(
            self._tokenizer.tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=list(self._tokenizer.eos_token_ids)
        )

    def matcher(self, spec: StructuredOutput, output_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher, advanced past `output_token_ids` (a resubmitted request's output).

        Raises InvalidRequestError naming the problem when the grammar does not compile
        or the output does not follow it.
        """
        matcher = self._compile(spec).deep_copy()
        if output_token_ids:
            num_valid = matcher.validate_tokens(list(output_token_ids))
            if num_valid < len(output_token_ids) or not matcher.consume_tokens(list(output_token_ids)):
                raise InvalidRequestError(
                    f"output_token_ids do not follow the structured_output grammar "
                    f"(token {num_valid}, id {output_token_ids[num_valid]}, is not allowed there)"
                )
        return GrammarMatcher(matcher)

    def _compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
        compiled = llguidance.LLMatcher(self.ll_tokenizer, spec.to_llguidance(), log_level=0)
        if compiled.is_error():
            raise InvalidRequestError(f"structured_output.{spec.kind} is invalid: {compiled.get_error()}")
        with self._lock:
            self._compiled[spec] = compiled
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


@functools.cache
def _bit_positions(device: torch.device) -> torch.Tensor:
    return torch.arange(32, dtype=torch.int32, device=device)


def fill_masks(requests: Sequence[tuple[GrammarMatcher, list[int]]], num_rows: int, vocab_size: int) -> torch.Tensor:
    """The allowed-token bitmasks of every grammar row: int32 [num_rows, ceil(V / 32)], bit t of row r set iff allowed.

    `requests`: (matcher, drafts) in row order; a request's rows are the state now,
    then after each of its drafts (which the grammar must allow), 1 + len(drafts) rows.
    Computed in llguidance's thread pool, all requests at once; the matchers end as
    they started.
    """
    bitmask = torch.zeros((num_rows, (vocab_size + 31) // 32), dtype=torch.int32)
    decodes, verifies, row = [], [], 0  # llguidance takes requests with drafts in a call of their own
    for matcher, draft_ids in requests:
        if draft_ids:
            verifies.append((matcher.matcher, row, list(draft_ids)))
        else:
            decodes.append((matcher.matcher, row))
        row += 1 + len(draft_ids)
    assert row == num_rows, f"{row} grammar rows for a bitmask of {num_rows}"
    mask_bytes = bitmask.shape[1] * 4
    if decodes:
        _executor().unsafe_compute_mask_ptr(decodes, bitmask.data_ptr(), mask_bytes, num_rows)
    if verifies:
        _executor().unsafe_compute_mask_ptr_with_draft_token(verifies, bitmask.data_ptr(), mask_bytes, num_rows)
    return bitmask


def apply_masks(logits: torch.Tensor, row_spans: Sequence[tuple[int, int]], bitmask: torch.Tensor) -> None:
    """Set, in place, every logit the bitmask forbids to -inf.

    logits [rows, V] float32; row_spans: (first row, number of rows) in logits of each
    grammar request, in the bitmask's row order (as fill_masks laid it out); bitmask
    [sum of the spans' rows, ceil(V / 32)] int32 on the CPU.
    """
    if logits.device.type == "cpu":
        _apply_masks_numpy(logits, row_spans, bitmask)
    else:
        _apply_masks_torch(logits, row_spans, bitmask)


def _apply_masks_numpy(logits: torch.Tensor, row_spans: Sequence[tuple[int, int]], bitmask: torch.Tensor) -> None:
    # numpy, single-threaded: torch's unpacking and masked_fill_ of a 50k row took milliseconds
    # on a busy CPU (its thread pool waiting for cores), numpy a tenth of that.
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")[:, : logits.shape[-1]]
    values, mask_row = logits.numpy(), 0
    for start, num_rows in row_spans:
        np.putmask(values[start : start + num_rows], allowed[mask_row : mask_row + num_rows] == 0, -np.inf)
        mask_row += num_rows


def _apply_masks_torch(logits: torch.Tensor, row_spans: Sequence[tuple[int, int]], bitmask: torch.Tensor) -> None:
    bitmask = bitmask.to(logits.device, non_blocking=True)  # 32x smaller than the unpacked mask
    bits = (bitmask.unsqueeze(-1) >> _bit_positions(logits.device)) & 1  # [R, W, 32]
    forbidden = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[-1]] == 0  # [R, V]
    mask_row = 0
    for start, num_rows in row_spans:
        logits[start : start + num_rows].masked_fill_(forbidden[mask_row : mask_row + num_rows], float("-inf"))
        mask_row += num_rows
