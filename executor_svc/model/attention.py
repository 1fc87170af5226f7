"""Paged attention over a ragged batch in plain torch: the CPU path and the reference.

Every query token attends to its own request's KV, read through the block table,
up to and including its own position (causal within the new tokens).

This path is *batch-invariant*: a query row's output does not depend on which
other requests share the step, on how long its own prefill chunk or verify run
is, or on the padded lengths below. CPU GEMMs choose their reduction order from
the problem shape, so the shapes are made canonical instead:

- requests are grouped by (query-length bucket, context-length bucket) and each
  group runs as one batched GEMM, padded to the group's largest query length
  (a multiple of 4: fp32 kernels treat rows in groups of four) and largest
  context (a multiple of `KV_CHUNK`). Padding keys are masked; they contribute
  exact zeros.
- scores reduce over head_dim only (fixed). The probability-times-V reduction runs
  over the context in fixed `KV_CHUNK`-key chunks aligned at key 0, summed in
  chunk order, so a longer padded context only appends exact zeros.

A tree slice (ragged_batch) splits into one-row units: row i at depth d reads
the request's first `start + d + 1` logical keys, logical key start + k being
the slot of its ancestor at depth k. So a tree row meets exactly the GEMMs a
decode of its path would (a one-row unit is what a decode step is), and its bits
are that decode's.

`tests/executor/model/test_attention.py` checks the invariance bit for bit. The grouping pads a
little to use batched GEMMs; the Triton kernel needs none of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.model.ragged_batch import RaggedBatch, tree_paths

KV_CHUNK = 256
QUERY_ROW_MULTIPLE = 4


@dataclass(frozen=True)
class _Group:
    num_query_rows: int  # Mp: padded query rows per request
    num_keys: int  # Np: padded keys per request, a multiple of KV_CHUNK
    query_rows: torch.Tensor  # [R, Mp] rows of the flat q; padding repeats a real row
    kv_slots: torch.Tensor  # [R, Np] flat KV slots; padding reads slot 0 (the null block)
    masked: torch.Tensor  # [R, 1, 1, Mp, Np] True where the key is after the query
    real_rows: torch.Tensor  # [n] rows of the group's [R * Mp] output that are real
    out_rows: torch.Tensor  # [n] rows of the flat output they go to


@dataclass(frozen=True)
class AttentionPlan:
    """Gather indices and masks for one step, built once and used by every layer."""

    groups: list[_Group]
    num_padded_tokens: int


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class _Unit:
    """Query rows that read one logical key sequence: a request, or one row of a tree."""

    request: int
    query_start: int  # first row in the flat q
    query_len: int
    context_len: int  # logical keys read by the last row
    window_rows: list[int] | None = None  # tree rows only: the rows root..this one, read after the context


def _units(batch: RaggedBatch) -> list[_Unit]:
    units = []
    for r, (start, m, n) in enumerate(zip(batch.query_starts, batch.query_lens, batch.context_lens)):
        parents = batch.tree_parents[r] if batch.tree_parents else None
        if parents is None:
            units.append(_Unit(r, start, m, n))
            continue
        first_position = n - m
        for row, path in enumerate(tree_paths(parents)):
            units.append(_Unit(r, start + row, 1, first_position + len(path), path))
    return units


def build_attention_plan(batch: RaggedBatch, block_size: int) -> AttentionPlan:
    device = batch.token_ids.device
    units = _units(batch)
    buckets: dict[tuple[int, int], list[_Unit]] = {}
    for unit in units:
        key = (_next_pow2(_round_up(unit.query_len, QUERY_ROW_MULTIPLE)), _next_pow2(-(-unit.context_len // KV_CHUNK)))
        buckets.setdefault(key, []).append(unit)

    groups = []
    for members in buckets.values():
        query_lens = torch.tensor([u.query_len for u in members], device=device)
        context_lens = torch.tensor([u.context_len for u in members], device=device)
        query_starts = torch.tensor([u.query_start for u in members], device=device)
        mp = _round_up(int(query_lens.max()), QUERY_ROW_MULTIPLE)
        np_ = _round_up(int(context_lens.max()), KV_CHUNK)

        i = torch.arange(mp, device=device)[None, :]  # [1, Mp]
        is_real = i < query_lens[:, None]  # [R, Mp]
        # Padding rows repeat the request's last row: finite scores, discarded output.
        row_in_request = torch.minimum(i, query_lens[:, None] - 1)
        query_rows = query_starts[:, None] + row_in_request
        query_positions = context_lens[:, None] - query_lens[:, None] + row_in_request  # [R, Mp]

        j = torch.arange(np_, device=device)[None, :]  # [1, Np]
        # The position in the request whose slot holds logical key j: j itself, but
        # for a tree row's keys after the context, its ancestors' positions.
        key_positions = j.expand(len(members), -1).clone()
        for u, unit in enumerate(members):
            if unit.window_rows is not None:
                first_position = unit.context_len - len(unit.window_rows)
                key_positions[u, first_position : unit.context_len] = first_position + torch.tensor(
                    unit.window_rows, device=device
                )
        tables = batch.block_tables[[u.request for u in members]].long()  # [R, max_blocks]
        block_index = torch.clamp(key_positions // block_size, max=tables.shape[1] - 1)
        kv_slots = torch.gather(tables, 1, block_index) * block_size + key_positions % block_size
        kv_slots = torch.where(j < context_lens[:, None], kv_slots, torch.zeros_like(kv_slots))
        masked = j[:, None, :] > query_positions[:, :, None]  # [R, Mp, Np]

        real_rows = torch.nonzero(is_real.reshape(-1), as_tuple=False).squeeze(1)
        groups.append(
            _Group(
                num_query_rows=mp,
                num_keys=np_,
                query_rows=query_rows,
                kv_slots=kv_slots,
                masked=masked[:, None, None],
                real_rows=real_rows,
                out_rows=query_rows.reshape(-1)[real_rows],
            )
        )
    return AttentionPlan(groups=groups, num_padded_tokens=batch.num_padded_tokens)


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    """Store each token's K and V in its slot of the paged cache (rounded to the cache's dtype)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,  # [num_padded_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each query over its own request's paged KV; float32 math."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.zeros(plan.num_padded_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    for g in plan.groups:
        r, mp, np_ = g.query_rows.shape[0], g.num_query_rows, g.num_keys
        # [R, Mp, H, D] -> [R, Hkv, group_size * Mp, D]
        qg = q[g.query_rows].float().view(r, mp, num_kv_heads, group_size, head_dim)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(r, num_kv_heads, group_size * mp, head_dim)
        k = k_flat[g.kv_slots].float().permute(0, 2, 3, 1).contiguous()  # [R, Hkv, D, Np]
        v = v_flat[g.kv_slots].float().permute(0, 2, 1, 3).contiguous()  # [R, Hkv, Np, D]
        scores = torch.matmul(qg, k).mul_(scale)  # [R, Hkv, group_size * Mp, Np]
        scores = scores.view(r, num_kv_heads, group_size, mp, np_).masked_fill_(g.masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(r, num_kv_heads, group_size * mp, np_)
        o = torch.matmul(probs[..., :KV_CHUNK].contiguous(), v[:, :, :KV_CHUNK])
        for start in range(KV_CHUNK, np_, KV_CHUNK):
            end = start + KV_CHUNK
            o = o + torch.matmul(probs[..., start:end].contiguous(), v[:, :, start:end])
        # [R, Hkv, group_size * Mp, D] -> [R * Mp, H, D]
        o = o.view(r, num_kv_heads, group_size, mp, head_dim).permute(0, 3, 1, 2, 4)
        o = o.reshape(r * mp, num_heads, head_dim)
        out[g.out_rows] = o[g.real_rows].to(q.dtype)
    return out
