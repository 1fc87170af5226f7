"""The paged KV cache: per-layer K/V tensors cut into blocks, and block tables.

Layout per layer: `[num_blocks, block_size, num_kv_heads, head_dim]` for K and
for V (the layout of vLLM's flash backend), so token `i` of a request lives in
slot `block_ids[i // block_size] * block_size + i % block_size` of the flat
view `[num_blocks * block_size, num_kv_heads, head_dim]`.

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


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        kv_layers = config.kv_layers
        shape = (len(kv_layers), 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # [num_kv_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]
        self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        # Per-layer (K, V) views by model layer index, made once: the forward pass asks for them
        # every layer of every step.
        self._layers = {layer: (self.tensor[i, 0], self.tensor[i, 1]) for i, layer in enumerate(kv_layers)}

    def copy_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Every layer's K and V of flat slots `src_slots` into `dst_slots` (int64 [n] each,
        on the cache's device): a verified tree path moved to where decoding would have put it."""
        flat = self.tensor.view(*self.tensor.shape[:2], -1, *self.tensor.shape[4:])  # [L, 2, slots, Hkv, D]
        flat[:, :, dst_slots] = flat[:, :, src_slots]

    @classmethod
    def from_memory_budget(
        cls,
        config: ModelConfig,
        budget_bytes: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> "KVCache":
        num_blocks = budget_bytes // bytes_per_block(config, block_size, dtype)
        if num_blocks < 2:
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes holds {num_blocks} blocks of {block_size} tokens; "
                f"need at least 2 ({bytes_per_block(config, block_size, dtype)} bytes each)"
            )
        return cls(config, int(num_blocks), block_size, dtype, device)

    def layer(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self._layers[layer_index]

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
