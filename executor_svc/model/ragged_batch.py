"""One step's work as a single flat token vector: the ragged batch.

Prefill chunks, single decode tokens and multi-token verify runs of many
requests are laid end to end. Request r owns rows
`query_start[r] : query_start[r] + query_lens[r]`; its first new token sits at
position `context_lens[r] - query_lens[r]`, and after this step its KV holds
`context_lens[r]` tokens. Nothing is padded per request.

The only padding is a few rows at the end of the whole vector (`num_padded_tokens`),
in batch-invariant mode: fp32 GEMMs on this CPU give a row a different result
depending on where it falls in a group of four rows, so the vector is rounded up to
a multiple of `row_multiple` and every row meets the same kernel whatever the batch.
Padding rows belong to no request, write no KV, and are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.kv.block_allocator import NULL_BLOCK_ID


@dataclass(frozen=True)
class RequestSlice:
    """One request's part of a step."""

    token_ids: list[int]  # the tokens computed this step
    start_position: int  # tokens already in KV before this step
    block_ids: list[int]  # the request's block table (covers start_position + len(token_ids))
    num_logits: int  # how many trailing positions need logits (0 mid-prefill, 1 to sample, k+1 to verify k drafts)
    state_slot: int = -1  # the request's recurrent-state slot (hybrid models); -1: none


@dataclass(frozen=True)
class RaggedBatch:
    token_ids: torch.Tensor  # [num_padded_tokens] int64
    positions: torch.Tensor  # [num_padded_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat KV slot of each real token
    block_tables: torch.Tensor  # [num_requests, max_blocks] int32, padded with the null block
    logits_indices: torch.Tensor  # [num_padded_logits] int64: rows whose logits are computed
    query_starts: list[int]  # [num_requests]
    query_lens: list[int]  # [num_requests]
    context_lens: list[int]  # [num_requests]
    num_tokens: int
    num_padded_tokens: int
    num_logits: int  # real rows of logits_indices; the rest is padding
    logits_counts: tuple[int, ...] = ()  # [num_requests]: logits rows of each request (its verify window)
    state_slots: tuple[int, ...] = ()  # [num_requests]: recurrent-state slots (hybrid models), else empty

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @classmethod
    def build(
        cls,
        slices: list[RequestSlice],
        block_size: int,
        device: torch.device,
        row_multiple: int = 1,
    ) -> "RaggedBatch":
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        query_starts, query_lens, context_lens = [], [], []
        for s in slices:
            start = len(token_ids)
            n = len(s.token_ids)
            if n == 0:
                raise ValueError("a request slice must compute at least one token")
            if not 0 <= s.num_logits <= n:
                raise ValueError(f"num_logits {s.num_logits} outside [0, {n}]")
            end_position = s.start_position + n
            if len(s.block_ids) * block_size < end_position:
                raise ValueError(f"block table of {len(s.block_ids)} blocks cannot hold {end_position} tokens")
            token_ids.extend(s.token_ids)
            for position in range(s.start_position, end_position):
                positions.append(position)
                slots.append(s.block_ids[position // block_size] * block_size + position % block_size)
            logits_indices.extend(range(start + n - s.num_logits, start + n))
            query_starts.append(start)
            query_lens.append(n)
            context_lens.append(end_position)

        num_tokens = len(token_ids)
        num_padded_tokens = _round_up(num_tokens, row_multiple)
        token_ids.extend([0] * (num_padded_tokens - num_tokens))
        positions.extend([0] * (num_padded_tokens - num_tokens))
        num_logits = len(logits_indices)
        logits_indices.extend([0] * (_round_up(num_logits, row_multiple) - num_logits))

        max_blocks = max((len(s.block_ids) for s in slices), default=0)
        tables = [s.block_ids + [NULL_BLOCK_ID] * (max_blocks - len(s.block_ids)) for s in slices]

        def as_tensor(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            token_ids=as_tensor(token_ids),
            positions=as_tensor(positions),
            slot_mapping=as_tensor(slots),
            block_tables=as_tensor(tables, torch.int32).reshape(len(slices), max_blocks),
            logits_indices=as_tensor(logits_indices),
            query_starts=query_starts,
            query_lens=query_lens,
            context_lens=context_lens,
            num_tokens=num_tokens,
            num_padded_tokens=num_padded_tokens,
            num_logits=num_logits,
            logits_counts=tuple(s.num_logits for s in slices),
            state_slots=tuple(s.state_slot for s in slices) if any(s.state_slot >= 0 for s in slices) else (),
        )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
