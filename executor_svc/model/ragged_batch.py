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

A *tree* slice verifies a draft tree (drafter.DraftTree): row 0 is the request's
last token, row i + 1 its node i, and `tree_parents[row]` the row of its parent
(-1 for row 0). Its rows' K/V go to consecutive slots as any slice's do, but a
row's position (RoPE) is the start plus its depth, and it attends to the context
before the step plus its own ancestors only, read in root-to-row order: the very
keys, in the very order, that decoding its path one token at a time would read.
That is what makes a verified row's bits equal plain decoding's. A chain is the
tree with parents -1, 0, 1, ...; every other slice is `tree_parents=None`.
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
    tree_parents: tuple[int, ...] | None = None  # [len(token_ids)]: each row's parent row, -1 for row 0

    def __post_init__(self) -> None:
        if self.tree_parents is None:
            return
        if len(self.tree_parents) != len(self.token_ids) or self.num_logits != len(self.token_ids):
            raise ValueError("a tree slice needs a parent and logits for every row")
        if self.state_slot >= 0:
            raise ValueError("hybrid models verify chains: a recurrent state follows one path")
        parents = self.tree_parents
        if parents[0] != -1 or any(not 0 <= parent < row for row, parent in enumerate(parents) if row > 0):
            raise ValueError(f"tree rows need parent -1 at row 0 and an earlier row after it, got {self.tree_parents}")

    def depths(self) -> list[int]:
        """Each row's offset from start_position: its depth in the tree, or its row."""
        if self.tree_parents is None:
            return list(range(len(self.token_ids)))
        depths: list[int] = []
        for parent in self.tree_parents:
            depths.append(0 if parent < 0 else depths[parent] + 1)
        return depths


def tree_paths(tree_parents: tuple[int, ...]) -> list[list[int]]:
    """paths[row]: the rows root..row of a tree slice, the order its keys are read in."""
    paths: list[list[int]] = []
    for row, parent in enumerate(tree_parents):
        paths.append((paths[parent] if parent >= 0 else []) + [row])
    return paths


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
    tree_parents: tuple[tuple[int, ...] | None, ...] = ()  # [num_requests] when any slice is a tree, else empty
    # Σ over the query rows of the keys each attends (its context and ancestors, itself included): the
    # step's attention work, as the scheduler's cost model counts it (service_common/attention_pairs.py).
    num_attention_pairs: int = 0

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
        num_attention_pairs = 0
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
                slots.append(s.block_ids[position // block_size] * block_size + position % block_size)
            depths = s.depths()
            positions.extend(s.start_position + depth for depth in depths)
            num_attention_pairs += n * (s.start_position + 1) + sum(depths)
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
            tree_parents=tuple(s.tree_parents for s in slices) if any(s.tree_parents for s in slices) else (),
            num_attention_pairs=num_attention_pairs,
        )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
