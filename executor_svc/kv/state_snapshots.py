"""Which recurrent-state snapshots the prefix cache of a hybrid model holds: pure bookkeeping.

A snapshot is a copy of one request's recurrent state (conv and delta-rule state of every
DeltaNet layer) at a block boundary, stored in a row of the state pool beside the slots
(`RecurrentStatePool.snapshot_row`) and keyed by the hash of the block that ends there. That
hash chains every token before the boundary (rooted in the model's fingerprint), so a snapshot
is the state of exactly that prefix: it can never be wrong for a lookup that finds it, only
useless once the KV blocks before it are evicted (the KV manager then never reaches it, and it
is the first one reused).

Paired verbs, as the block allocator: `reserve` an entry for a capture (a free one, else one
whose prefix lost its KV, else one superseded by its request's newer snapshot, else the least
recently used), `publish` it under its hash once the state is written, or `discard` it;
`lookup` / `touch` / `supersede`. Invariants: an entry is free, reserved or published, never
two; a published entry is found under exactly one hash; a reserved entry is never found (its
row is being written), so a capture that never completes can only lose a hit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class StateSnapshots:
    def __init__(self, num_snapshots: int) -> None:
        if num_snapshots < 0:
            raise ValueError(f"num_snapshots must be >= 0, got {num_snapshots}")
        self.num_snapshots = num_snapshots
        self._free = list(range(num_snapshots - 1, -1, -1))  # popped from the end: entry 0 first
        self._entry_of: OrderedDict[bytes, int] = OrderedDict()  # published: hash -> entry, least recently used first
        self._superseded: set[bytes] = set()  # published, and their request has a newer snapshot
        self._reserved: set[int] = set()

    @property
    def num_published(self) -> int:
        return len(self._entry_of)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._entry_of.get(block_hash)

    def touch(self, block_hash: bytes) -> None:
        """A hit or a fresh capture: used last, and no longer superseded."""
        if block_hash in self._entry_of:
            self._entry_of.move_to_end(block_hash)
            self._superseded.discard(block_hash)

    def supersede(self, block_hash: bytes) -> None:
        """Its request has moved on to a later boundary: reuse this entry before unrelated ones."""
        if block_hash in self._entry_of:
            self._superseded.add(block_hash)

    def reserve(self, is_stale: Callable[[bytes], bool]) -> int | None:
        """An entry to capture into, taken out of the lookup; None when every entry is reserved."""
        if self._free:
            entry = self._free.pop()
        else:
            victim = self._victim(is_stale)
            if victim is None:
                return None
            entry = self._entry_of.pop(victim)
            self._superseded.discard(victim)
        self._reserved.add(entry)
        return entry

    def publish(self, entry: int, block_hash: bytes) -> bool:
        """Make a reserved entry, now holding the state at `block_hash`'s boundary, findable.
        False (the entry is freed) when another entry already holds that prefix."""
        self._check_reserved(entry)
        self._reserved.remove(entry)
        if block_hash in self._entry_of:
            self._free.append(entry)
            self.touch(block_hash)
            return False
        self._entry_of[block_hash] = entry
        return True

    def discard(self, entry: int) -> None:
        """Give back a reserved entry whose capture did not happen."""
        self._check_reserved(entry)
        self._reserved.remove(entry)
        self._free.append(entry)

    def _victim(self, is_stale: Callable[[bytes], bool]) -> bytes | None:
        if not self._entry_of:
            return None
        for block_hash in self._entry_of:  # least recently used first
            if is_stale(block_hash):
                return block_hash
        for block_hash in self._entry_of:
            if block_hash in self._superseded:
                return block_hash
        return next(iter(self._entry_of))

    def _check_reserved(self, entry: int) -> None:
        if entry not in self._reserved:
            raise ValueError(f"state snapshot {entry} is not reserved")
