"""The KV side of the executor, one owner: the paged KV cache, its prefix cache, and (hybrid
models) the recurrent-state pool, with what each request holds of them.

The engine speaks to it in a few verbs, in the order a step uses them (vLLM's KVCacheManager):
- `computed_blocks(token_ids)`: the cached blocks a request starting from zero can reuse (pure);
- `num_blocks_needed` / `num_blocks_available` / `check_state_slots`: whether a plan fits (pure),
  so a plan that does not is refused with nothing changed;
- `take_computed_blocks`: share the reusable blocks (before anyone grows, so no growth evicts them);
- `allocate_slots(request_id, num_tokens)`: blocks to hold that many tokens, and a state slot;
  `plan_state_snapshot`: (hybrid models) a snapshot for the forward pass to take;
- `commit(request_id, token_ids, num_computed_tokens)`: give back the blocks of rejected drafts,
  cache every newly full block (and, hybrid models, snapshot the state at the last boundary reached);
- `free(request_id)`: everything the request holds (cached blocks stay reusable).

Invariants: a request holds blocks and a state slot only through these verbs; a block it holds is
either its own (count 1) or shared read-only (a cached full block, never written into); its first
`num_cached_blocks` blocks are registered in the prefix cache.

**Hybrid models.** A DeltaNet layer's state at token i depends on every token before it, so a
cached block is only reusable together with the recurrent state at its end. Such states are kept
as *snapshots* in rows of the state pool beside the slots (`recurrent_state.py`), at most
`num_snapshots` of them, keyed by the hash of the block that ends at their boundary
(`state_snapshots.py`): the hash chains the whole prefix, so a snapshot found is always the
state of exactly the prefix the lookup asked about. `computed_blocks` stops at the last cached
block that has a snapshot; `take_computed_blocks` copies that snapshot into the request's fresh
slot. A snapshot whose earlier blocks were evicted is never reached and is the first reused.

Which boundaries are snapshotted (the policy): every request keeps one at the **last block
boundary it reached** (an agent's next turn is this turn's tokens plus more, so that is where it
resumes), moved forward as it computes; its previous one is then superseded (reused before
unrelated snapshots). The state sits at `num_computed_tokens`, usually not a boundary, so:
- a step that ends on a boundary copies the slot (`commit`: decode reaches every boundary so);
- a boundary inside a verify window is replayed from the window (`commit`, as a rollback);
- the last boundary of the prompt (of all the request's known tokens), when it falls inside a
  prefill chunk, is written by the forward pass itself (`plan_state_snapshot` before it,
  published in `commit`): it replays the chunk's updates up to the boundary onto a copy of the
  state before the chunk, so at most one chunk of extra delta-rule updates per prompt. Other
  boundaries inside prefill chunks are skipped (the prompt's last one supersedes them anyway).
Capturing never fails: with every entry taken, the least useful published one is reused; with
none at all, a request simply gets no hit.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from executor_svc.errors import OutOfStateSlotsError
from executor_svc.kv.block_allocator import BlockAllocator, block_hash
from executor_svc.kv.kv_cache import KVCache
from executor_svc.kv.recurrent_state import RecurrentStatePool, bytes_per_slot
from executor_svc.kv.state_snapshots import StateSnapshots
from executor_svc.weights.model_config import ModelConfig

# The default number of state snapshots: one per slot, within this share of what the slots leave of the budget.
MAX_SNAPSHOT_SHARE = 0.25


@dataclass(frozen=True)
class ComputedBlocks:
    """Cached blocks that hold the KV of a prompt's leading full blocks."""

    block_ids: list[int]
    block_hashes: list[bytes]  # the hash chain of the request's full blocks (at least one per block id)
    snapshot: int = -1  # hybrid models: the recurrent-state snapshot at the end of the last block


NO_COMPUTED_BLOCKS = ComputedBlocks([], [])


@dataclass(frozen=True)
class _PendingSnapshot:
    """A snapshot the next forward pass writes inside a request's prefill chunk."""

    entry: int
    block_hash: bytes
    boundary: int  # tokens before it


@dataclass
class _RequestKV:
    """What one request holds."""

    block_ids: list[int] = field(default_factory=list)  # its block table
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of its full blocks, as far as computed
    num_cached_blocks: int = 0  # leading blocks of block_ids registered in the prefix cache
    state_slot: int = -1  # recurrent-state slot (hybrid models); -1: none
    num_computed_tokens: int = 0  # as of the last commit (or the prefix hit)
    pending_snapshot: _PendingSnapshot | None = None
    latest_snapshot: bytes | None = None  # hash of the last boundary it snapshotted


class KVManager:
    def __init__(
        self,
        cache: KVCache,
        state_pool: RecurrentStatePool | None,
        prefix_root: bytes,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.cache = cache
        self.state_pool = state_pool
        self._prefix_root = prefix_root
        # A hybrid's prefix also needs its recurrent state at the block boundary (see the module docstring).
        self.snapshots = (
            StateSnapshots(state_pool.num_snapshots) if state_pool is not None and enable_prefix_caching else None
        )
        self.caches_prefixes = enable_prefix_caching and (state_pool is None or state_pool.num_snapshots > 0)
        self._held: dict[str, _RequestKV] = {}

    @classmethod
    def from_memory_budget(
        cls,
        config: ModelConfig,
        budget_bytes: int,
        block_size: int,
        num_state_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        prefix_root: bytes,
        enable_prefix_caching: bool = True,
        num_state_snapshots: int | None = None,
        kv_dtype: torch.dtype | None = None,
        kv_layout: str = "token_major",
    ) -> "KVManager":
        """Hybrid models take their recurrent-state slots and snapshots out of the budget first; the KV
        blocks get the rest. `num_state_snapshots` None: one per slot, as many as fit in a quarter of
        what the slots leave (none without prefix caching). `dtype`: the recurrent states'; `kv_dtype`:
        the KV cache's (None: `dtype`); `kv_layout`: see kv_cache.py."""
        state_pool = None
        if config.is_hybrid:
            per_row = bytes_per_slot(config, dtype)
            left = budget_bytes - num_state_slots * per_row
            if num_state_snapshots is None:
                num_state_snapshots = min(num_state_slots, max(0, int(left * MAX_SNAPSHOT_SHARE) // per_row))
            if not enable_prefix_caching:
                num_state_snapshots = 0
            budget_bytes = left - num_state_snapshots * per_row
            if budget_bytes <= 0:
                raise ValueError(
                    f"kv_cache_bytes={budget_bytes + (num_state_slots + num_state_snapshots) * per_row} does not even hold "
                    f"the {num_state_slots} recurrent-state slots and {num_state_snapshots} snapshots ({per_row} bytes "
                    f"each); raise it or lower num_state_slots / num_state_snapshots"
                )
            state_pool = RecurrentStatePool(config, num_state_slots, dtype, device, num_state_snapshots)
        cache = KVCache.from_memory_budget(config, budget_bytes, block_size, kv_dtype or dtype, device, kv_layout)
        return cls(cache, state_pool, prefix_root, enable_prefix_caching)

    # ---------------------------------------------------------------- counts

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.cache.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.cache.num_usable_blocks

    @property
    def _allocator(self) -> BlockAllocator:
        return self.cache.allocator

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty when it holds no KV)."""
        held = self._held.get(request_id)
        return held.block_ids if held is not None else []

    def state_slot(self, request_id: str) -> int:
        """The request's recurrent-state slot; -1 when it holds none (or the model has no recurrent layers)."""
        held = self._held.get(request_id)
        return held.state_slot if held is not None else -1

    def num_exclusive_blocks(self, request_id: str) -> int:
        """Blocks no other request shares: what freeing the request would give back now."""
        return sum(1 for b in self.block_ids(request_id) if self._allocator.ref_count(b) == 1)

    # ------------------------------------------------------------- admission (pure)

    def computed_blocks(self, token_ids: list[int]) -> ComputedBlocks:
        """Cached blocks a request starting from zero with these tokens can reuse; nothing is taken yet.

        Only blocks wholly before the last token count: that token must be computed to
        produce logits, and a shared block is never written into.
        """
        if not self.caches_prefixes:
            return NO_COMPUTED_BLOCKS
        max_blocks = (len(token_ids) - 1) // self.block_size
        block_hashes = self._extend_hashes(token_ids, [], max_blocks)
        found = []
        for h in block_hashes:
            block_id = self._allocator.lookup(h)
            if block_id is None:
                break
            found.append(block_id)
        if self.snapshots is None:
            return ComputedBlocks(found, block_hashes) if found else NO_COMPUTED_BLOCKS
        # A hybrid resumes only where it finds the recurrent state too: at the last block with a snapshot.
        for num_blocks in range(len(found), 0, -1):
            snapshot = self.snapshots.lookup(block_hashes[num_blocks - 1])
            if snapshot is not None:
                return ComputedBlocks(found[:num_blocks], block_hashes, snapshot)
        return NO_COMPUTED_BLOCKS

    def num_blocks_available(self, leaving: Iterable[str]) -> int:
        """Free blocks once the `leaving` requests (released or preempted) have freed theirs."""
        return self.num_free_blocks + len(self._blocks_freed_by(leaving))

    def num_blocks_needed(
        self, num_tokens: dict[str, int], computed: dict[str, ComputedBlocks], leaving: Iterable[str]
    ) -> int:
        """Free blocks a step consumes when each request of `num_tokens` must hold that many tokens
        of KV after it, starting from its `computed` blocks (if any), once `leaving` have left.

        New blocks count, and so do cached-but-unused blocks it reuses: including a hit on a
        block that a leaving request frees, which the release puts among the free blocks (see
        num_blocks_available) and the reuse takes out again.
        """
        leaving = set(leaving)
        freed = self._blocks_freed_by(leaving)
        reused = {b for c in computed.values() for b in c.block_ids if self._allocator.is_evictable(b) or b in freed}
        needed = len(reused)
        for request_id, n in num_tokens.items():
            if request_id in computed:
                num_held = len(computed[request_id].block_ids)
            elif request_id in leaving:
                num_held = 0
            else:
                num_held = len(self.block_ids(request_id))
            needed += max(0, self.cache.num_blocks_for(n) - num_held)
        return needed

    def check_state_slots(self, request_ids: Iterable[str], leaving: Iterable[str]) -> None:
        """A hybrid model computes a request only with a recurrent-state slot: raise
        OutOfStateSlotsError if the requests to compute need more slots than are free, counting
        those the `leaving` requests give back."""
        if self.state_pool is None:
            return
        leaving = set(leaving)
        freed = sum(1 for r in leaving if self.state_slot(r) >= 0)
        needed = sum(1 for r in request_ids if r in leaving or self.state_slot(r) < 0)
        available = self.state_pool.num_free_slots + freed
        if needed > available:
            raise OutOfStateSlotsError(
                f"the plan starts {needed} requests but only {available} of {self.state_pool.num_slots} "
                f"recurrent-state slots are free (each running request of a hybrid model holds one)"
            )

    def _blocks_freed_by(self, leaving: Iterable[str]) -> set[int]:
        """Blocks the leaving requests leave without a holder."""
        holders = Counter(b for r in set(leaving) for b in self.block_ids(r))
        return {b for b, n in holders.items() if self._allocator.ref_count(b) == n}

    # ------------------------------------------------------------------ changes

    def take_computed_blocks(self, request_id: str, computed: ComputedBlocks) -> int:
        """Share the request's computed blocks (it holds nothing yet); returns the tokens they cover."""
        held = self._held.setdefault(request_id, _RequestKV())
        if held.block_ids:
            raise ValueError(f"request {request_id!r} already holds KV blocks")
        for block_id in computed.block_ids:
            self._allocator.share(block_id)
        held.block_ids = list(computed.block_ids)
        held.block_hashes = list(computed.block_hashes)
        held.num_cached_blocks = len(computed.block_ids)
        held.num_computed_tokens = len(computed.block_ids) * self.block_size
        if computed.snapshot >= 0:
            if held.state_slot < 0:
                held.state_slot = self.state_pool.allocate()
            self.state_pool.load(computed.snapshot, held.state_slot)
            self.snapshots.touch(computed.block_hashes[len(computed.block_ids) - 1])
        return held.num_computed_tokens

    def allocate_slots(self, request_id: str, num_tokens: int) -> None:
        """Grow the request's block table to hold `num_tokens` tokens, and give it a zeroed
        recurrent-state slot (the state before token 0) if the model has them and it has none."""
        held = self._held.setdefault(request_id, _RequestKV())
        if self.state_pool is not None and held.state_slot < 0:
            held.state_slot = self.state_pool.allocate()
        self.cache.grow(held.block_ids, num_tokens)

    def plan_state_snapshot(self, request_id: str, token_ids: list[int], start: int, end: int) -> None:
        """Hybrid models: the step computes the request's known tokens [start, end); if the last block
        boundary of all its known tokens lies strictly inside, have the forward pass snapshot the
        state there, unless one is kept there already (see the module docstring)."""
        if self.snapshots is None:
            return
        held = self._held[request_id]
        self._drop_pending_snapshot(held)
        boundary = len(token_ids) // self.block_size * self.block_size
        if (
            not start < boundary < end
        ):  # not inside (a step ending on it leaves the state in the slot: commit copies it)
            return
        num_blocks = boundary // self.block_size
        block_hash_ = self._extend_hashes(token_ids, held.block_hashes, num_blocks)[num_blocks - 1]
        if self.snapshots.lookup(block_hash_) is not None:
            return
        entry = self.snapshots.reserve(self._is_stale)
        if entry is not None:
            self.state_pool.capture_in_step(held.state_slot, boundary - start, entry)
            held.pending_snapshot = _PendingSnapshot(entry, block_hash_, boundary)

    def commit(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """The request's KV now holds its first `num_computed_tokens` tokens (and a hybrid's slot the
        state after them): give back blocks beyond them (rejected drafts roll back), cache every
        newly full block, and snapshot the state at the last boundary the step reached."""
        held = self._held[request_id]
        self.cache.truncate(held.block_ids, num_computed_tokens)
        if self.caches_prefixes:
            num_full = num_computed_tokens // self.block_size
            self._extend_hashes(token_ids, held.block_hashes, num_full)
            for i in range(held.num_cached_blocks, num_full):
                self._allocator.register(held.block_ids[i], held.block_hashes[i])
            held.num_cached_blocks = max(held.num_cached_blocks, num_full)
            if self.snapshots is not None:
                self._snapshot_last_boundary(held, num_computed_tokens)
        held.num_computed_tokens = num_computed_tokens

    def move_tokens(self, request_id: str, src_positions: list[int], dst_positions: list[int]) -> None:
        """Copy the K/V of the request's tokens at `src_positions` to `dst_positions` (within its
        blocks): a verified draft tree's kept path, to where decoding would have put it."""
        block_ids = self._held[request_id].block_ids

        def slots(positions: list[int]) -> torch.Tensor:
            flat = [block_ids[p // self.block_size] * self.block_size + p % self.block_size for p in positions]
            return torch.tensor(flat, dtype=torch.int64, device=self.cache.tensor.device)

        self.cache.copy_slots(slots(src_positions), slots(dst_positions))

    def restore_state(self, request_id: str, position: int) -> None:
        """Put back the recurrent state after verify position `position` (0 = the decode token,
        j its j-th draft): the step computed every draft, the verifier kept fewer."""
        self.state_pool.restore_window(self.state_slot(request_id), position)

    def free(self, request_id: str, retain_s: float = 0.0) -> None:
        """Give back everything the request holds (a no-op if it holds nothing). Its cached blocks
        (and state snapshots) stay reusable, preferred over others for `retain_s` seconds when memory is needed."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        self._drop_pending_snapshot(held)
        retain_until = time.monotonic() + retain_s if retain_s > 0 else None
        self.cache.release(held.block_ids, retain_until)
        if held.state_slot >= 0:
            self.state_pool.free(held.state_slot)

    # ------------------------------------------------------------- snapshots

    def _snapshot_last_boundary(self, held: _RequestKV, num_computed_tokens: int) -> None:
        """Keep the state at the last block boundary the step reached (after `held.num_computed_tokens`),
        from wherever it is at hand: the forward pass's capture, the slot, or the verify window."""
        boundary = num_computed_tokens // self.block_size * self.block_size
        pending, held.pending_snapshot = held.pending_snapshot, None
        latest = None
        if pending is not None:  # the forward pass wrote it
            self.snapshots.publish(pending.entry, pending.block_hash)
            latest = pending.block_hash
        if held.num_computed_tokens < boundary and (pending is None or pending.boundary < boundary):
            latest = self._snapshot_at(held, boundary, num_computed_tokens) or latest
        if latest is not None:
            if held.latest_snapshot not in (None, latest):
                self.snapshots.supersede(held.latest_snapshot)
            held.latest_snapshot = latest

    def _snapshot_at(self, held: _RequestKV, boundary: int, num_computed_tokens: int) -> bytes | None:
        """Snapshot the state at `boundary`, reached this step; its hash, or None when the state there
        is not at hand."""
        block_hash_ = held.block_hashes[boundary // self.block_size - 1]
        if self.snapshots.lookup(block_hash_) is not None:
            self.snapshots.touch(block_hash_)
            return block_hash_
        # A verify window starts at the step's first token: its position p is the state after token start + p.
        window_position = boundary - 1 - held.num_computed_tokens
        in_window = window_position < self.state_pool.window_size(held.state_slot)
        if boundary != num_computed_tokens and not in_window:
            return None  # inside a prefill chunk that asked for no capture
        entry = self.snapshots.reserve(self._is_stale)
        if entry is None:
            return None
        if boundary == num_computed_tokens:
            self.state_pool.save(held.state_slot, entry)
        else:
            self.state_pool.save_window(held.state_slot, window_position, entry)
        self.snapshots.publish(entry, block_hash_)
        return block_hash_

    def _drop_pending_snapshot(self, held: _RequestKV) -> None:
        """Forget a capture the forward pass did not make (the request left, or its step never ran)."""
        if held.pending_snapshot is not None:
            if held.state_slot >= 0:
                self.state_pool.cancel_captures(held.state_slot)
            self.snapshots.discard(held.pending_snapshot.entry)
            held.pending_snapshot = None

    def _is_stale(self, block_hash_: bytes) -> bool:
        """A snapshot whose block is no longer cached: no lookup reaches it any more."""
        return self._allocator.lookup(block_hash_) is None

    # ------------------------------------------------------------- calibration

    @contextlib.contextmanager
    def scratch(self, num_requests: int, num_tokens: int) -> Iterator[list[tuple[list[int], int]] | None]:
        """Blocks for `num_tokens` tokens and a state slot for each of `num_requests` scratch
        requests, as (block_ids, state_slot) pairs, given back on exit; None when they do not fit."""
        needed = num_requests * self.cache.num_blocks_for(num_tokens)
        if needed > self.num_free_blocks or (
            self.state_pool is not None and not self.state_pool.can_allocate(num_requests)
        ):
            yield None
            return
        taken = []
        try:
            for _ in range(num_requests):
                slot = self.state_pool.allocate() if self.state_pool is not None else -1
                taken.append(([], slot))
                self.cache.grow(taken[-1][0], num_tokens)
            yield taken
        finally:
            for block_ids, slot in taken:
                self.cache.release(block_ids)
                if slot >= 0:
                    self.state_pool.free(slot)

    # ---------------------------------------------------------------- hashes

    def _extend_hashes(self, token_ids: list[int], block_hashes: list[bytes], num_blocks: int) -> list[bytes]:
        """Grow a hash chain in place to cover the first `num_blocks` full blocks of token_ids; returns it."""
        bs = self.block_size
        for i in range(len(block_hashes), num_blocks):
            parent = block_hashes[-1] if block_hashes else self._prefix_root
            block_hashes.append(block_hash(parent, token_ids[i * bs : (i + 1) * bs]))
        return block_hashes
