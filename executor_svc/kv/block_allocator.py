"""The KV block allocator: ref-counted blocks, a prefix cache of full blocks, eviction.

Pure bookkeeping, no tensors, so it is property-tested on its own. Block 0 is
reserved as the *null block*: it is never handed out, always holds zeros, and
pads block tables (a padded table entry reads zeros that attention masks off).

**Prefix cache.** A full block of computed KV is *registered* under a hash chain
of its tokens: hash(parent block's hash, its token ids), rooted in the model's
fingerprint, so equal hashes mean equal prefixes and therefore equal KV. A new
request looks its prompt's blocks up in order and shares every hit by reference
count instead of recomputing it; a shared system prompt is stored once.

A block whose last holder lets go stays cached (and counts as free: it can be
reclaimed at any time) until memory is needed; then blocks are evicted least
recently used first, never a block in use. A block released with a retention
deadline (an agent's session, back from a tool call in a few seconds) is evicted
only when no unretained block is left, until its deadline passes; after that it
is evicted before any other.
"""

from __future__ import annotations

import hashlib
import heapq
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable

from executor_svc.errors import OutOfKVBlocksError

NULL_BLOCK_ID = 0


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The hash chain link of one full block: its tokens on top of everything before it."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def root_hash(model_fingerprint: str) -> bytes:
    """The chain's root: KV of one model never matches another model's."""
    return hashlib.blake2b(model_fingerprint.encode(), digest_size=16).digest()


class BlockAllocator:
    def __init__(self, num_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (1 is the reserved null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self._clock = clock
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))  # unregistered, unused
        self._hash_of: dict[int, bytes] = {}  # registered block -> its hash
        self._block_of: dict[bytes, int] = {}  # hash -> registered block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused, unretained: LRU first
        self._retained: dict[int, float] = {}  # cached, unused, retained: block -> deadline
        self._retained_heap: list[tuple[float, int]] = []  # (deadline, block), lazily cleaned, compacted
        self._retain_until: dict[int, float] = {}  # deadlines of blocks in use, applied when freed

    # ---------------------------------------------------------------- counts

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: never used, or cached but unused (evictable)."""
        return len(self._free) + len(self._evictable) + len(self._retained)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    @property
    def num_usable_blocks(self) -> int:
        """All blocks but the null block."""
        return self.num_blocks - 1

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    # ------------------------------------------------------------ allocation

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks (count 1 each), evicting cached ones if needed; all or nothing."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if not self.can_allocate(num_blocks):
            raise OutOfKVBlocksError(f"need {num_blocks} KV blocks, only {self.num_free_blocks} free")
        block_ids = [self._free.popleft() if self._free else self._evict() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def share(self, block_id: int) -> None:
        """One more holder of a block: in use, or cached and unused (which takes it off eviction)."""
        if block_id == NULL_BLOCK_ID or not 0 < block_id < self.num_blocks:
            raise ValueError(f"block {block_id} is not an allocatable block")
        if self._ref_counts[block_id] == 0:
            if block_id not in self._hash_of:
                raise ValueError(f"block {block_id} is neither allocated nor cached")
            self._take_off_eviction(block_id)
        self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int], retain_until: float | None = None) -> None:
        """Drop one reference to each block. A block with no holder left stays cached if it is
        registered (retained until `retain_until` if given), else it is free again."""
        for block_id in block_ids:
            self._check_held(block_id)
        for block_id in block_ids:
            if retain_until is not None:
                self._retain_until[block_id] = max(retain_until, self._retain_until.get(block_id, retain_until))
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] > 0:
                continue
            deadline = self._retain_until.pop(block_id, None)
            if block_id not in self._hash_of:
                self._free.append(block_id)
            elif deadline is not None and deadline > self._clock():
                self._retained[block_id] = deadline
                heapq.heappush(self._retained_heap, (deadline, block_id))
                self._compact_retained_heap()
            else:
                self._evictable[block_id] = None

    # ---------------------------------------------------------- prefix cache

    def register(self, block_id: int, block_hash_: bytes) -> bool:
        """Cache a full block under its hash; False if another block already holds that prefix."""
        self._check_held(block_id)
        if block_hash_ in self._block_of or block_id in self._hash_of:
            return False
        self._hash_of[block_id] = block_hash_
        self._block_of[block_hash_] = block_id
        return True

    def lookup(self, block_hash_: bytes) -> int | None:
        return self._block_of.get(block_hash_)

    def is_evictable(self, block_id: int) -> bool:
        """Cached and unused: taking it consumes a free block."""
        return self._ref_counts[block_id] == 0 and block_id in self._hash_of

    # -------------------------------------------------------------- eviction

    def _take_off_eviction(self, block_id: int) -> None:
        if block_id in self._evictable:
            del self._evictable[block_id]
        else:
            del self._retained[block_id]  # its heap entry is skipped when popped

    def _compact_retained_heap(self) -> None:
        """Drop stale heap entries once they outnumber the live ones.

        A retained block that is shared again leaves its entry behind, and each new
        release pushes another: with deadlines far off nothing is ever popped, so the
        heap would grow by one entry per block per release. Rebuilding when it is over
        twice the live size keeps it O(retained blocks), amortised O(1) per push.
        """
        if len(self._retained_heap) > 2 * len(self._retained) + 64:
            self._retained_heap = [(deadline, block_id) for block_id, deadline in self._retained.items()]
            heapq.heapify(self._retained_heap)

    def _promote_expired(self) -> None:
        """Retained blocks past their deadline go first in line for eviction."""
        now = self._clock()
        while self._retained_heap and self._retained_heap[0][0] <= now:
            deadline, block_id = heapq.heappop(self._retained_heap)
            if self._retained.get(block_id) == deadline:
                del self._retained[block_id]
                self._evictable[block_id] = None
                self._evictable.move_to_end(block_id, last=False)

    def _evict(self) -> int:
        self._promote_expired()
        if self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
        else:  # only retained blocks left: the one whose deadline comes first
            while True:
                deadline, block_id = heapq.heappop(self._retained_heap)
                if self._retained.get(block_id) == deadline:
                    del self._retained[block_id]
                    break
        del self._block_of[self._hash_of.pop(block_id)]
        return block_id

    def _check_held(self, block_id: int) -> None:
        if block_id == NULL_BLOCK_ID or not 0 < block_id < self.num_blocks:
            raise ValueError(f"block {block_id} is not an allocatable block")
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not allocated")
