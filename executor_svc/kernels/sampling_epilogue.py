"""The greedy sampling / verify epilogue on the device: argmax and the accept count.

A step that samples greedily or verifies drafts needs, per request, only the
argmax token of each scored row and how many leading drafts the model agrees
with. Computing both here means the host copies back [S] + [R] small integers
instead of [S, vocab] float32 logits.

Layout: request r owns logits rows `row_starts[r] : row_starts[r + 1]`. Row i
verifies `draft_token_ids[i]` (the draft that follows row i's position), or
nothing when it is -1 (a plain decode row, or the bonus row after the last
draft). Worked example, one request with drafts [5, 9, 2]:

    argmax_ids       [5, 9, 7, 4]
    draft_token_ids  [5, 9, 2, -1]
    num_accepted     2   → emit 5, 9, then the correction 7 (= argmax_ids[2])

The accepted tokens are the first `num_accepted` drafts; the next token is
`argmax_ids[row_starts[r] + num_accepted]`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.kernels.checks import FLOAT_DTYPES, check_same_device, check_tensor

BLOCK_V = 2048
BLOCK_ROWS = 16


@triton.jit
def _argmax_kernel(
    logits_ptr,  # [S, V]
    argmax_ptr,  # [S] int64
    stride_row,
    vocab_size,
    BLOCK_V: tl.constexpr,
):
    """Each lane keeps its running max and the first index reaching it; ties go to the lowest index."""
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_index = lanes
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + lanes
        x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab_size, other=float("-inf"))
        x = x.to(tl.float32)
        is_better = x > best  # strict: an equal later value keeps the earlier index
        best_index = tl.where(is_better, cols, best_index)
        best = tl.where(is_better, x, best)
    row_max = tl.max(best, axis=0)
    first = tl.min(tl.where(best == row_max, best_index, vocab_size + BLOCK_V), axis=0)
    tl.store(argmax_ptr + row, first.to(tl.int64))


@triton.jit
def _accept_kernel(
    argmax_ptr,  # [S] int64
    draft_ptr,  # [S] int64, -1 where a row verifies no draft
    row_starts_ptr,  # [R + 1] int32
    num_accepted_ptr,  # [R] int32
    BLOCK_ROWS: tl.constexpr,
):
    request = tl.program_id(0)
    start = tl.load(row_starts_ptr + request)
    end = tl.load(row_starts_ptr + request + 1)
    accepted = end - start
    for base in range(start, end, BLOCK_ROWS):
        rows = base + tl.arange(0, BLOCK_ROWS)
        in_request = rows < end
        predicted = tl.load(argmax_ptr + rows, mask=in_request, other=-1)
        draft = tl.load(draft_ptr + rows, mask=in_request, other=-1)
        rejected = in_request & ((draft < 0) | (draft != predicted))
        first_rejected = tl.min(tl.where(rejected, rows - start, end - start), axis=0)
        accepted = tl.minimum(accepted, first_rejected)
    tl.store(num_accepted_ptr + request, accepted)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, V] → [S] int64, like torch.argmax(logits, -1) (NaNs are not treated specially)."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_same_device(logits=logits)
    num_rows, vocab_size = logits.shape
    if vocab_size == 0:
        raise ValueError("argmax over an empty vocabulary")
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows:
        block = min(BLOCK_V, triton.next_power_of_2(vocab_size))
        _argmax_kernel[(num_rows,)](logits, out, logits.stride(0), vocab_size, BLOCK_V=block, num_warps=8)
    return out


def greedy_verify(
    logits: torch.Tensor,  # [S, V]
    draft_token_ids: torch.Tensor,  # [S] int64, -1 where the row verifies no draft
    row_starts: torch.Tensor,  # [R + 1] int32, row_starts[0] = 0, row_starts[R] = S
) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax_ids [S] int64, num_accepted [R] int32): see the module docstring."""
    check_tensor("draft_token_ids", draft_token_ids, ndim=1, dtypes=(torch.int64,))
    check_tensor("row_starts", row_starts, ndim=1, dtypes=(torch.int32,))
    check_same_device(logits=logits, draft_token_ids=draft_token_ids, row_starts=row_starts)
    if draft_token_ids.shape[0] != logits.shape[0]:
        raise ValueError(f"draft_token_ids has {draft_token_ids.shape[0]} entries for {logits.shape[0]} logits rows")
    if row_starts.shape[0] < 1:
        raise ValueError("row_starts needs at least one entry (R + 1 for R requests)")
    argmax_ids = argmax(logits)
    num_requests = row_starts.shape[0] - 1
    num_accepted = torch.empty(num_requests, dtype=torch.int32, device=logits.device)
    if num_requests:
        _accept_kernel[(num_requests,)](argmax_ids, draft_token_ids, row_starts, num_accepted, BLOCK_ROWS=BLOCK_ROWS)
    return argmax_ids, num_accepted
