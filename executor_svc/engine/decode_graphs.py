"""Decode steps replayed from captured graphs, so Python launch cost is not paid per layer.

A step in which every request computes exactly one token and samples it (plain
decode: no prefill chunk, no drafts) has a shape fixed by its request count alone.
For each bucket B in `DEFAULT_BUCKETS` the first such step of at most B requests
captures the model's forward over static buffers of B rows; every later one copies
its tensors into those buffers and replays. Rows past the real requests are
padding: token 0 at position 0, writing its K/V into slot 0 of the null block and
attending to that slot alone, so it never touches a request's KV; its logits are
dropped.

Batch invariance: a replay runs the kernels the eager forward runs, with the same
configurations, and every kernel computes a row independently of the others
(`kernels/`), so the padding rows and the bucket change no real row's bits.

What may be captured: the Triton ops (their attention metadata is all device
tensors; a decode tile is one token of one request) on a llama-family model
without recurrent state. On CUDA/ROCm the capture is `torch.cuda.CUDAGraph`
(`capture_cuda_graph`); tests pass a fake capture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from executor_svc.kernels.paged_attention import AttentionMetadata
from executor_svc.kv.block_allocator import NULL_BLOCK_ID
from executor_svc.kv.kv_cache import KVCache
from executor_svc.model.ragged_batch import RaggedBatch
from executor_svc.model.transformer import Transformer

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)

# capture(fn) runs fn as warm-up, records it, and returns replay(): fn's work again, on the same memory,
# returning the tensor fn returned (overwritten in place by each replay).
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def bucket_for(num_requests: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> int | None:
    """The smallest bucket holding num_requests rows; None when none does."""
    return next((b for b in sorted(buckets) if b >= num_requests), None)


def is_plain_decode(batch: RaggedBatch) -> bool:
    """Every request computes one token and samples it: the only step shape a graph replays."""
    n = batch.num_requests
    return n > 0 and batch.num_tokens == batch.num_padded_tokens == batch.num_logits == n and not batch.state_slots


def capture_cuda_graph(fn: Callable[[], torch.Tensor], pool=None) -> Callable[[], torch.Tensor]:
    """fn's kernels as a CUDA/HIP graph. Warm-up runs on a side stream first (Triton compiles there,
    the allocator settles), as torch.cuda.graphs asks."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


@dataclass
class _StaticStep:
    """One bucket's buffers, which its graph reads and writes, and the replay."""

    batch: RaggedBatch
    metadata: AttentionMetadata
    replay: Callable[[], torch.Tensor]


class DecodeGraphs:
    def __init__(
        self,
        model: Transformer,
        kv_cache: KVCache,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        capture: Capture | None = None,
    ) -> None:
        if model.ops.name != "triton":
            raise ValueError(f"decode graphs replay the Triton ops' forward, not {model.ops.name!r}")
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive request counts, got {buckets}")
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = tuple(sorted(set(buckets)))
        self.max_blocks = math.ceil(model.config.context_length / kv_cache.block_size)
        if capture is None:
            pool = torch.cuda.graph_pool_handle()  # one memory pool shared by every bucket's graph
            capture = lambda fn: capture_cuda_graph(fn, pool)  # noqa: E731
        self._capture = capture
        self._steps: dict[int, _StaticStep] = {}

    @property
    def captured_buckets(self) -> list[int]:
        return sorted(self._steps)

    def can_run(self, batch: RaggedBatch) -> bool:
        return (
            is_plain_decode(batch)
            and bucket_for(batch.num_requests, self.buckets) is not None
            and batch.block_tables.shape[1] <= self.max_blocks
        )

    def forward(self, batch: RaggedBatch) -> torch.Tensor:
        """The model's float32 logits [num_requests, vocab] for a plain decode batch, replayed."""
        if not self.can_run(batch):
            raise ValueError(
                f"not a decode step a graph replays: {batch.num_requests} requests, {batch.num_tokens} tokens, "
                f"{batch.num_logits} logits rows, block tables of {batch.block_tables.shape[1]} blocks"
            )
        bucket = bucket_for(batch.num_requests, self.buckets)
        step = self._steps.get(bucket)
        if step is None:
            step = self._steps[bucket] = self._capture_bucket(bucket, batch)
        self._copy_in(step.batch, step.metadata, batch)
        # A copy: the graph's output buffer is overwritten by the next replay.
        return step.replay()[: batch.num_requests].clone()

    def _capture_bucket(self, bucket: int, batch: RaggedBatch) -> _StaticStep:
        """Static buffers of `bucket` rows, filled from this step (warm-up runs write exactly its KV), then captured."""
        device = batch.token_ids.device
        rows = torch.arange(bucket, device=device)
        tables = torch.full((bucket, self.max_blocks), NULL_BLOCK_ID, dtype=torch.int32, device=device)
        static_batch = RaggedBatch(
            token_ids=torch.zeros(bucket, dtype=torch.int64, device=device),
            positions=torch.zeros(bucket, dtype=torch.int64, device=device),
            slot_mapping=torch.zeros(bucket, dtype=torch.int64, device=device),
            block_tables=tables,
            logits_indices=rows.clone(),
            query_starts=list(range(bucket)),
            query_lens=[1] * bucket,
            context_lens=[1] * bucket,
            num_tokens=bucket,
            num_padded_tokens=bucket,
            num_logits=bucket,
            logits_counts=(1,) * bucket,
        )
        metadata = AttentionMetadata(  # one single-token tile per row (see build_attention_metadata)
            tile_requests=rows.to(torch.int32),
            tile_row_starts=rows.to(torch.int32),
            tile_num_rows=torch.ones(bucket, dtype=torch.int32, device=device),
            tile_first_positions=torch.zeros(bucket, dtype=torch.int32, device=device),
            block_tables=tables,
            block_size=self.kv_cache.block_size,
            query_tile_tokens=self.model.ops.query_tile_tokens,
            num_tokens=bucket,
            num_padded_tokens=bucket,
        )
        self._copy_in(static_batch, metadata, batch)
        replay = self._capture(lambda: self.model.forward_prepared(static_batch, metadata, self.kv_cache))
        return _StaticStep(static_batch, metadata, replay)

    def _copy_in(self, static: RaggedBatch, metadata: AttentionMetadata, batch: RaggedBatch) -> None:
        """The plan's tensors into the static buffers; rows past them become padding rows."""
        n, width = batch.num_requests, batch.block_tables.shape[1]
        static.token_ids[:n].copy_(batch.token_ids)
        static.positions[:n].copy_(batch.positions)
        static.slot_mapping[:n].copy_(batch.slot_mapping)
        static.block_tables[:n, :width].copy_(batch.block_tables)
        static.block_tables[:n, width:].fill_(NULL_BLOCK_ID)
        metadata.tile_first_positions[:n].copy_(batch.positions)
        # Padding: token 0 at position 0 in slot 0 of the null block, its block table all null.
        static.token_ids[n:].zero_()
        static.positions[n:].zero_()
        static.slot_mapping[n:].fill_(NULL_BLOCK_ID * self.kv_cache.block_size)
        static.block_tables[n:].fill_(NULL_BLOCK_ID)
        metadata.tile_first_positions[n:].zero_()
