"""The KV block allocator: a free list of fixed-size blocks with reference counts.

Pure bookkeeping, no tensors, so it is property-tested on its own. Block 0 is
reserved as the *null block*: it is never handed out, always holds zeros, and
pads block tables (a padded table entry reads zeros that attention masks off).

Reference counts are here for prefix sharing: a block shared by n requests has
count n and returns to the free list only when the last one lets go.
"""

from __future__ import annotations

from collections import deque

from executor_svc.errors import OutOfKVBlocksError

NULL_BLOCK_ID = 0


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (1 is the reserved null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        """All blocks but the null block."""
        return self.num_blocks - 1

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks (count 1 each); all or nothing."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if not self.can_allocate(num_blocks):
            raise OutOfKVBlocksError(f"need {num_blocks} KV blocks, only {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def share(self, block_id: int) -> None:
        """One more holder of an allocated block."""
        self._check_held(block_id)
        self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block with no holder left is free again."""
        for block_id in block_ids:
            self._check_held(block_id)
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def _check_held(self, block_id: int) -> None:
        if block_id == NULL_BLOCK_ID or not 0 < block_id < self.num_blocks:
            raise ValueError(f"block {block_id} is not an allocatable block")
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not allocated")
