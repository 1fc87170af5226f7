"""The recurrent-state pool of a hybrid model: one fixed-size slot per running request.

Beside the paged KV of its attention layers, a hybrid model (Qwen3.5) keeps per
request, per DeltaNet layer, a conv state [kernel − 1, conv_dim] (compute dtype) and
a recurrent state [value_heads, key_head_dim, value_head_dim] (float32: it integrates
every token of the request, so it keeps full precision like FLA's kernels do). Unlike
KV, their size does not grow with the request: a slot is taken when a request is first
computed and given back when it is released or preempted (a preempted request's
tokens are recomputed from position 0, which rebuilds the state).

Paired verbs, all or nothing, as the block allocator: `can_allocate` / `allocate`
(a zeroed slot) / `free`. Invariants: a slot is either free or held by exactly one
request; free slots are never read.

**Verify windows.** A step that verifies drafts computes K + 1 positions of a request
and would leave the state after the last one. The forward pass therefore also keeps,
per DeltaNet layer, the conv states after each position (small: kernel − 1 rows each),
and a `DeltaRuleWindow`: the recurrent state before the window and the window's raw
inputs (`keep_window`); once the verifier has kept j drafts, `restore_window(slot, j)`
replays the j + 1 updates from the window start with the ops that ran the forward pass
(the same per-token arithmetic), so exactly the state plain decoding has after the
same tokens. That keeps
one recurrent state per verifying request instead of K + 1 (for Qwen3.5-9B, 51 MB
against 51 MB × (K + 1)). The window lives only until the next step.

**Snapshots** (the prefix cache of a hybrid model, see `kv_manager.py`): `num_snapshots`
more rows after the slots, each the state of some request at a block boundary. `save`
copies a slot into one (the step ended on the boundary), `save_window` writes the state
after a verify position into one (the boundary fell inside a verify window), `load` copies
one into a fresh slot (a prefix hit). A boundary inside a prefill chunk is captured by
the forward pass itself: `capture_in_step(slot, num_tokens, snapshot)` asks it to write
the state after the slot's first `num_tokens` tokens of the step into the snapshot (see
`hybrid_model.CapturePlan`: the state before a window starting at the boundary, or those
tokens' updates replayed onto a copy of the state before the step; the conv state is just
the inputs before the boundary), with the very ops and per-token arithmetic of the step,
so the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.errors import OutOfStateSlotsError
from executor_svc.model.gated_delta_net import DeltaRuleWindow
from executor_svc.weights.model_config import ModelConfig


def bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
    """Resident bytes of one request's recurrent state over all DeltaNet layers."""
    element_size = torch.empty((), dtype=dtype).element_size()
    conv = (config.conv_kernel - 1) * config.conv_dim * element_size
    recurrent = config.num_linear_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    return len(config.recurrent_layer_indices) * (conv + recurrent)


@dataclass
class _Window:
    """One request's verify window, per DeltaNet layer."""

    conv: list[torch.Tensor]  # per layer [num_positions, kernel - 1, conv_dim]: conv state after each position
    delta_rule: list[DeltaRuleWindow]  # per layer: the recurrent state before the window, and its inputs


@dataclass(frozen=True)
class StepCapture:
    """A snapshot the forward pass writes: the state after the slot's first `num_tokens` tokens of the step."""

    slot: int
    num_tokens: int
    row: int  # the snapshot's row in the layers' tensors


class RecurrentStatePool:
    def __init__(
        self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device, num_snapshots: int = 0
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"a hybrid model needs at least one recurrent-state slot, got {num_slots}")
        if num_snapshots < 0:
            raise ValueError(f"num_snapshots must be >= 0, got {num_snapshots}")
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self.bytes_per_slot = bytes_per_slot(config, dtype)  # a snapshot takes as much
        layers = config.recurrent_layer_indices
        self._layer_index = {layer: i for i, layer in enumerate(layers)}
        num_rows = num_slots + num_snapshots  # the slots, then the snapshots
        conv_shape = (num_rows, config.conv_kernel - 1, config.conv_dim)
        recurrent_shape = (
            num_rows,
            config.num_linear_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
        )
        self.conv = [torch.zeros(conv_shape, dtype=dtype, device=device) for _ in layers]
        self.recurrent = [torch.zeros(recurrent_shape, dtype=torch.float32, device=device) for _ in layers]
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._windows: dict[int, _Window] = {}
        self._captures: list[StepCapture] = []

    # ---------------------------------------------------------------- slots

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def can_allocate(self, num_slots: int) -> bool:
        return num_slots <= len(self._free)

    def allocate(self) -> int:
        """A zeroed slot: the state before a request's first token."""
        if not self._free:
            raise OutOfStateSlotsError(f"all {self.num_slots} recurrent-state slots are in use")
        slot = self._free.pop()
        for conv, recurrent in zip(self.conv, self.recurrent):
            conv[slot].zero_()
            recurrent[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"recurrent-state slot {slot} is not allocated")
        self._windows.pop(slot, None)
        self.cancel_captures(slot)
        self._free.append(slot)

    # ------------------------------------------------------- layer access

    def layer(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv states [rows, kernel − 1, conv_dim], recurrent states [rows, heads, dk, dv]) of a DeltaNet
        layer; rows are the slots, then the snapshots."""
        i = self._layer_index[layer_index]
        return self.conv[i], self.recurrent[i]

    # ------------------------------------------------------------ snapshots

    def snapshot_row(self, snapshot: int) -> int:
        if not 0 <= snapshot < self.num_snapshots:
            raise ValueError(f"state snapshot {snapshot} outside [0, {self.num_snapshots})")
        return self.num_slots + snapshot

    def save(self, slot: int, snapshot: int) -> None:
        """Copy the slot's state into the snapshot."""
        self._copy_rows(slot, self.snapshot_row(snapshot))

    def load(self, snapshot: int, slot: int) -> None:
        """Make the slot hold the snapshot's state (a prefix hit)."""
        self._copy_rows(self.snapshot_row(snapshot), slot)

    def save_window(self, slot: int, position: int, snapshot: int) -> None:
        """Write the state after the slot's verify position `position` (as `restore_window`) into the snapshot."""
        self._write_window_state(slot, position, self.snapshot_row(snapshot))

    def capture_in_step(self, slot: int, num_tokens: int, snapshot: int) -> None:
        """Ask the next forward pass to write the state after the slot's first `num_tokens` tokens
        of the step (a boundary inside its prefill chunk) into the snapshot."""
        if num_tokens < 1:
            raise ValueError(f"a capture inside a step needs at least one token before it, got {num_tokens}")
        self._captures.append(StepCapture(slot, num_tokens, self.snapshot_row(snapshot)))

    def cancel_captures(self, slot: int) -> None:
        """Drop the captures asked of the slot for the next forward pass."""
        self._captures = [c for c in self._captures if c.slot != slot]

    def _copy_rows(self, source: int, target: int) -> None:
        for conv, recurrent in zip(self.conv, self.recurrent):
            conv[target].copy_(conv[source])
            recurrent[target].copy_(recurrent[source])

    # ------------------------------------------------------ verify windows

    def begin_step(self) -> list[StepCapture]:
        """Forget the previous step's verify windows; hand the forward pass the captures asked of it (once)."""
        self._windows.clear()
        captures, self._captures = self._captures, []
        return captures

    def keep_window(self, layer_index: int, slot: int, conv: torch.Tensor, delta_rule: DeltaRuleWindow) -> None:
        """Keep one layer's verify window of the request in `slot`: conv states after each position
        [positions, kernel − 1, conv_dim], and what replays its recurrent state."""
        window = self._windows.setdefault(slot, _Window([], []))
        if len(window.conv) != self._layer_index[layer_index]:
            raise ValueError(f"verify window of slot {slot}: layer {layer_index} kept out of order")
        window.conv.append(conv)
        window.delta_rule.append(delta_rule)

    def window_size(self, slot: int) -> int:
        """Positions whose states were kept for `slot` this step (0: none)."""
        window = self._windows.get(slot)
        return window.conv[0].shape[0] if window and window.conv else 0

    def restore_window(self, slot: int, position: int) -> None:
        """Make the slot hold the state after verify position `position` (0 = the first computed token)."""
        self._write_window_state(slot, position, slot)

    def _write_window_state(self, slot: int, position: int, row: int) -> None:
        """Row `row` gets the state after the slot's verify position `position`, replayed from its window."""
        window = self._windows.get(slot)
        if window is None or len(window.conv) != len(self.conv) or not 0 <= position < window.conv[0].shape[0]:
            raise ValueError(f"slot {slot} has no kept state for verify position {position}")
        for i, (conv, recurrent) in enumerate(zip(self.conv, self.recurrent)):
            conv[row].copy_(window.conv[i][position])
            recurrent[row].copy_(window.delta_rule[i].state_after(position + 1))

    @property
    def window_bytes(self) -> int:
        """Bytes the kept verify-window states take now (what speculation costs on top of the slots)."""
        conv = sum(t.numel() * t.element_size() for w in self._windows.values() for t in w.conv)
        return conv + sum(d.num_bytes for w in self._windows.values() for d in w.delta_rule)
