"""The device-side greedy epilogue (argmax, accept count) against plain torch, under the interpreter."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.kernels.sampling_epilogue import BLOCK_V, argmax, greedy_verify  # noqa: E402


def reference_greedy_verify(logits, draft_token_ids, row_starts):
    """torch.argmax per row, then per request the number of leading drafts equal to it."""
    argmax_ids = torch.argmax(logits, dim=-1)
    num_accepted = []
    starts = row_starts.tolist()
    for start, end in zip(starts, starts[1:]):
        n = 0
        while start + n < end and 0 <= draft_token_ids[start + n] == argmax_ids[start + n]:
            n += 1
        num_accepted.append(n)
    return argmax_ids, torch.tensor(num_accepted, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("vocab_size", [1000, BLOCK_V, 2 * BLOCK_V + 17])
def test_argmax_matches_torch(dtype, vocab_size):
    gen = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(6, vocab_size, generator=gen).to(dtype)
    assert torch.equal(argmax(logits), torch.argmax(logits, dim=-1))


def test_ties_go_to_the_lowest_index_across_blocks_and_lanes():
    vocab_size = 3 * BLOCK_V
    logits = torch.zeros(5, vocab_size)
    logits[0, [BLOCK_V + 5, 7, 2 * BLOCK_V]] = 3.0  # the same lane's later copies and an earlier lane
    logits[1, [2 * BLOCK_V + 1, BLOCK_V + 1]] = 2.0  # the same lane in two later blocks
    logits[2] = float("-inf")  # all equal: index 0
    logits[3, -1] = 1.0  # the very last entry
    logits[4] = -1.0  # all equal and negative
    assert argmax(logits).tolist() == [7, BLOCK_V + 1, 0, vocab_size - 1, 0]
    assert torch.equal(argmax(logits), torch.argmax(logits, dim=-1))


def test_greedy_verify_accept_counts():
    gen = torch.Generator().manual_seed(0)
    vocab_size = 300
    # Requests: plain decode (1 row), 3 drafts all accepted, 3 drafts first rejected,
    # 2 drafts second rejected, 20 drafts all accepted (several 16-row chunks).
    rows_per_request = [1, 4, 4, 3, 21]
    row_starts = torch.tensor([0, 1, 5, 9, 12, 33], dtype=torch.int32)
    logits = torch.randn(sum(rows_per_request), vocab_size, generator=gen)
    best = torch.argmax(logits, dim=-1)
    drafts = torch.full((33,), -1, dtype=torch.int64)
    drafts[1:4] = best[1:4]
    drafts[5:8] = best[5:8]
    drafts[5] = (best[5] + 1) % vocab_size
    drafts[9:11] = best[9:11]
    drafts[10] = (best[10] + 1) % vocab_size
    drafts[12:32] = best[12:32]
    argmax_ids, num_accepted = greedy_verify(logits, drafts, row_starts)
    ref_ids, ref_accepted = reference_greedy_verify(logits, drafts, row_starts)
    assert torch.equal(argmax_ids, ref_ids)
    assert num_accepted.dtype == torch.int32 and argmax_ids.dtype == torch.int64
    assert num_accepted.tolist() == ref_accepted.tolist() == [0, 3, 0, 1, 20]


def test_a_draft_matching_after_a_rejection_is_not_accepted():
    logits = torch.zeros(4, 10)
    logits[torch.arange(4), torch.tensor([1, 2, 3, 4])] = 1.0
    drafts = torch.tensor([1, 9, 3, -1])  # the third draft matches but follows a rejection
    _, num_accepted = greedy_verify(logits, drafts, torch.tensor([0, 4], dtype=torch.int32))
    assert num_accepted.tolist() == [1]


def test_rejects_bad_arguments():
    logits = torch.randn(3, 10)
    with pytest.raises(ValueError, match="entries"):
        greedy_verify(logits, torch.full((2,), -1), torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        greedy_verify(logits, torch.full((3,), -1, dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        greedy_verify(logits, torch.full((3,), -1), torch.tensor([0, 3]))
