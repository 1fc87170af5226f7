"""The paged KV cache: per-layer K/V tensors cut into blocks, and block tables.

Layout per layer: `[num_blocks, block_size, num_kv_heads, head_dim]` for K and
for V (the layout of vLLM's flash backend), so token `i` of a request lives in
slot `block_ids[i // block_size] * block_size + i % block_size` of the flat
view `[num_blocks * block_size, num_kv_heads, head_dim]`.

The C++ CPU kernels take a second layout, `d_major`: each block's K is stored
`[num_kv_heads, head_dim, block_size]`, so one dimension of 16 consecutive keys is one
vector load and attention scores a key per vector lane with no transposes, and each
block's V `[num_kv_heads, block_size, head_dim]`, so one head's values of a block are one
contiguous run (attention reads a head at a time; token-major V interleaves the other
heads' rows into every run: 16 requests decoding at 1k tokens of context ran 1.2x faster
head-major, `cpu_kernels/layer_ops.cpp`). `layer(i)` gives K and V as views of those shapes
permuted to the common one, so indexing them reads the same values either way; only the
bytes' order differs.

A request's block table is a plain list of block ids that the request owns;
`grow`, `truncate` and `release` are the only ways it changes.

Only full-attention layers keep KV: in a hybrid model (Qwen3.5) the DeltaNet layers
keep a fixed-size state per request instead (`recurrent_state.py`), so the cache holds
`len(config.kv_layers)` layers and `layer(i)` takes the model's layer index.
"""

from __future__ import annotations

import math

import torch

from executor_svc.kv.block_allocator import BlockAllocator
from executor_svc.weights.model_config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * len(config.kv_layers) * block_size * config.num_kv_heads * config.head_dim * element_size


KV_LAYOUTS = ("token_major", "d_major")


# How d_major stores a block of K and of V: the order of its (block_size, num_kv_heads, head_dim)
# dims in memory (K: [num_kv_heads, head_dim, block_size]; V: [num_kv_heads, block_size, head_dim]).
D_MAJOR_BLOCK_ORDER = {"keys": (1, 2, 0), "values": (1, 0, 2)}


def _stored_dims(order: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation of [num_blocks, block_size, num_kv_heads, head_dim] into a block stored in `order`."""
    return (0, *(1 + d for d in order))


def _shown_dims(order: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation that shows a block stored in `order` as [block_size, num_kv_heads, head_dim]."""
    return (0, *(1 + order.index(d) for d in range(3)))


def _in_layout(cache: torch.Tensor, part: str, kv_layout: str) -> torch.Tensor:
    if kv_layout == "token_major":
        return cache.contiguous()
    order = D_MAJOR_BLOCK_ORDER[part]
    return cache.permute(_stored_dims(order)).contiguous().permute(_shown_dims(order))


def to_key_layout(keys: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """A token-major K cache [num_blocks, block_size, num_kv_heads, head_dim] as a copy stored in
    `kv_layout`, seen in the same shape (for benchmarks and tests that build caches by hand)."""
    return _in_layout(keys, "keys", kv_layout)


def to_value_layout(values: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """A token-major V cache as a copy stored in `kv_layout`, seen in the same shape (as to_key_layout)."""
    return _in_layout(values, "values", kv_layout)


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_layout: str = "token_major",
    ) -> None:
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
        self.block_size = block_size
        self.kv_layout = kv_layout
        self.allocator = BlockAllocator(num_blocks)
        kv_layers = config.kv_layers
        shape = (len(kv_layers), 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # The storage: [num_kv_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]
        # (d-major: each block's K bytes are [num_kv_heads, head_dim, block_size], its V bytes
        # [num_kv_heads, block_size, head_dim]).
        self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        # Every layer's K and V as views, and per-layer (K, V) views in layer order, made once:
        # the forward pass asks for them every layer of every step, copy_slots every verified tree.
        self._parts = {part: self._every_layer(part) for part in ("keys", "values")}
        self.layers = [(self._parts["keys"][i], self._parts["values"][i]) for i in range(len(kv_layers))]
        self._by_model_layer = dict(zip(kv_layers, self.layers))

    def _every_layer(self, part: str) -> torch.Tensor:
        """Every layer's K ("keys") or V ("values") as [num_kv_layers, num_blocks, block_size,
        num_kv_heads, head_dim], a view of the storage whatever the layout."""
        cache = self.tensor[:, 0 if part == "keys" else 1]
        if self.kv_layout == "token_major":
            return cache
        order = D_MAJOR_BLOCK_ORDER[part]
        layers, num_blocks, *dims = cache.shape
        stored = cache.view(layers, num_blocks, *(dims[d] for d in order))
        return stored.permute(0, *(1 + d for d in _shown_dims(order)))

    def copy_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Every layer's K and V of flat slots `src_slots` into `dst_slots` (int64 [n] each,
        on the cache's device): a verified tree path moved to where decoding would have put it."""
        for cache in self._parts.values():
            cache[:, dst_slots // self.block_size, dst_slots % self.block_size] = cache[
                :, src_slots // self.block_size, src_slots % self.block_size
            ]

    @classmethod
    def from_memory_budget(
        cls,
        config: ModelConfig,
        budget_bytes: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_layout: str = "token_major",
    ) -> "KVCache":
        num_blocks = budget_bytes // bytes_per_block(config, block_size, dtype)
        if num_blocks < 2:
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes holds {num_blocks} blocks of {block_size} tokens; "
                f"need at least 2 ({bytes_per_block(config, block_size, dtype)} bytes each)"
            )
        return cls(config, int(num_blocks), block_size, dtype, device, kv_layout)

    def layer(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer by the model's layer index, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self._by_model_layer[layer_index]

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.allocator.num_usable_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def num_new_blocks_needed(self, block_ids: list[int], num_tokens: int) -> int:
        return max(0, self.num_blocks_for(num_tokens) - len(block_ids))

    def grow(self, block_ids: list[int], num_tokens: int) -> None:
        """Extend a block table in place so it holds `num_tokens` tokens."""
        needed = self.num_new_blocks_needed(block_ids, num_tokens)
        if needed:
            block_ids.extend(self.allocator.allocate(needed))

    def truncate(self, block_ids: list[int], num_tokens: int) -> None:
        """Shrink a block table in place to the blocks `num_tokens` tokens need (roll back)."""
        keep = self.num_blocks_for(num_tokens)
        if keep < len(block_ids):
            self.allocator.free(block_ids[keep:])
            del block_ids[keep:]

    def release(self, block_ids: list[int], retain_until: float | None = None) -> None:
        """Give back every block of a table and empty it (cached blocks stay reusable,
        retained until `retain_until` if given)."""
        self.allocator.free(block_ids, retain_until)
        block_ids.clear()
