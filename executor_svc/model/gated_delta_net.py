"""Gated DeltaNet in plain torch: the short causal conv and the gated delta rule over a ragged batch.

A DeltaNet layer keeps, per request, a fixed-size state instead of KV:
- the conv state: the last `kernel - 1` inputs of the depthwise causal conv, [kernel - 1, channels];
- the recurrent state S, one [key_dim, value_dim] matrix per value head, float32.

For each token, with q, k L2-normalised (q also scaled by key_dim^-1/2), decay
γ = exp(g) and write strength β:

    S ← γ·S                      # forget
    S ← S + k ⊗ β·(v − Sᵀk)      # delta rule: write the part of v that S does not yet predict
    o = Sᵀq

These functions are the reference the Triton kernels (`kernels/causal_conv1d.py`,
`kernels/gated_delta_rule.py`) are tested against, and the CPU path. Both take the
same `DeltaNetPlan` and the same inputs: the conv's raw output (q, k, v side by side),
the raw gate projections, and a layer's whole state pool, whose rows at the plan's
slots they update in place.

`gated_delta_rule` runs the recurrence token by token for each request on its own
[H, dk, dv] state, the same op sequence per token, so a request's state after token t
is the same bits whatever the batch, the prefill chunking or the verify window around
it. For a request verifying drafts it also hands back its state before the verify
window; `DeltaRuleWindow` keeps that with the window's raw inputs and restores the
state after any kept draft by running the same ops over the kept positions again
(one state per request instead of K + 1).

`chunked_gated_delta_rule` is the same function evaluated a chunk of C tokens at a
time (the WY/UT form of the DeltaNet papers: within a chunk, the C sequential
rank-1 updates become one triangular solve and a few matmuls). It is much faster for
long prefills, and equal to the recurrent form up to float rounding, which depends on
where chunks start; so a plan sends prefills to it only when batch invariance is not asked for.

Value head h reads key head h mod num_key_heads: the "tiled" order llama.cpp's
converter stores the value heads in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from executor_svc.model.invariant_elementwise import invariant_map


@dataclass(frozen=True)
class ConvPlan:
    """Gather indices of the torch causal conv for one step."""

    window_rows: torch.Tensor  # [num_tokens, kernel]: rows of cat(conv states, inputs) each token's window reads
    state_rows: torch.Tensor  # [num_requests, kernel - 1]: rows that become each request's next conv state
    # [num_windows, max_window, kernel - 1]: the conv state after each verify position (None: no verify)
    window_state_rows: torch.Tensor | None


@dataclass(frozen=True)
class DeltaNetPlan:
    """One step's requests as the DeltaNet ops read them, built once per step and used by every DeltaNet layer.

    A request verifying drafts (more than one logits row) has a verify window: its last
    `window_lens[r]` positions, whose states the step keeps so a partial acceptance can be rolled back.
    """

    query_starts: list[int]
    query_lens: list[int]
    window_lens: list[int]  # [R]: verify positions (0: the request does not verify)
    chunked: tuple[bool, ...]  # [R]: the request's rows take the chunked delta rule
    state_slots: list[int]  # [R]: each request's row in the layers' state pools
    slots: torch.Tensor  # [R] int64: the same, on the device
    # [6, R] int32 on the device, for the kernels: query starts, query lens, the row where the
    # verify window starts (-1: none), the request's index among the windows (-1: none), slots,
    # and the requests in launch order: those taking the recurrent delta rule, then the chunked ones
    kernel_table: torch.Tensor
    token_requests: torch.Tensor  # [num_tokens] int32: the request of each row
    conv: ConvPlan | None  # the torch conv's gather rows (None: a plan for the kernels or a replay)

    @property
    def window_requests(self) -> list[int]:
        """Requests that verify drafts, in the order their windows are stacked."""
        return [r for r, n in enumerate(self.window_lens) if n]

    @property
    def max_window(self) -> int:
        return max(self.window_lens, default=0)

    @property
    def num_chunked(self) -> int:
        return sum(self.chunked)


def build_delta_net_plan(
    query_starts: list[int],
    query_lens: list[int],
    logits_counts: list[int],
    state_slots: list[int],
    device: torch.device,
    conv_kernel: int | None = None,
    min_chunked_tokens: int | None = None,
) -> DeltaNetPlan:
    """The plan of a step; `conv_kernel` builds the torch conv's gather rows, `min_chunked_tokens`
    sends prefills (one logits row at most) at least that long to the chunked delta rule."""
    if not len(query_starts) == len(query_lens) == len(logits_counts) == len(state_slots):
        raise ValueError("query_starts, query_lens, logits_counts and state_slots must have one entry per request")
    if len(set(state_slots)) != len(state_slots) or min(state_slots, default=0) < 0:
        raise ValueError(f"each request needs its own recurrent-state slot, got {state_slots}")
    window_lens = [n if n > 1 else 0 for n in logits_counts]
    chunked = tuple(
        min_chunked_tokens is not None and n >= min_chunked_tokens and w == 0 for n, w in zip(query_lens, window_lens)
    )
    window_starts = [start + n - w if w else -1 for start, n, w in zip(query_starts, query_lens, window_lens)]
    window_index, num_windows = [], 0
    for w in window_lens:
        window_index.append(num_windows if w else -1)
        num_windows += bool(w)
    launch_order = [r for r, c in enumerate(chunked) if not c] + [r for r, c in enumerate(chunked) if c]
    table = torch.tensor(
        [query_starts, query_lens, window_starts, window_index, state_slots, launch_order], dtype=torch.int32
    )
    lens = torch.tensor(query_lens, dtype=torch.int64)
    token_requests = torch.repeat_interleave(torch.arange(len(query_lens), dtype=torch.int32), lens)
    return DeltaNetPlan(
        query_starts=list(query_starts),
        query_lens=list(query_lens),
        window_lens=window_lens,
        chunked=chunked,
        state_slots=list(state_slots),
        slots=torch.tensor(state_slots, dtype=torch.int64, device=device),
        kernel_table=table.reshape(6, -1).to(device),
        token_requests=token_requests.to(device),
        conv=None if conv_kernel is None else _conv_rows(query_starts, query_lens, window_lens, conv_kernel, device),
    )


def _conv_rows(query_starts: list[int], query_lens: list[int], window_lens: list[int], kernel: int, device) -> ConvPlan:
    """Token i of request r (at offset o of its query) convolves `kernel` rows ending at itself:
    the request's previous conv state (row r·(k−1) + j of the states) for offsets before its
    first new token, its own new inputs (row R·(k−1) + query_start + o') after."""
    num_requests, width = len(query_lens), kernel - 1
    base = num_requests * width  # inputs follow the R stacked conv states

    def row(r: int, offset: int) -> int:  # offset in the request's window; offset < width is the old state
        return r * width + offset if offset < width else base + query_starts[r] + offset - width

    window_rows, state_rows, window_states = [], [], []
    max_window = max(window_lens, default=0)
    for r, n in enumerate(query_lens):
        for o in range(n):
            window_rows.append([row(r, o + j) for j in range(kernel)])
        state_rows.append([row(r, n + j) for j in range(width)])
        if window_lens[r]:  # after position e of the query, the state is the `width` rows ending at e
            ends = [n - window_lens[r] + i for i in range(window_lens[r])] + [n - 1] * (max_window - window_lens[r])
            window_states.append([[row(r, e + 1 + j) for j in range(width)] for e in ends])
    as_tensor = lambda rows, shape: torch.tensor(rows, dtype=torch.int64, device=device).reshape(shape)  # noqa: E731
    return ConvPlan(
        window_rows=as_tensor(window_rows, (-1, kernel)),
        state_rows=as_tensor(state_rows, (num_requests, width)),
        window_state_rows=as_tensor(window_states, (-1, max_window, width)) if window_states else None,
    )


def causal_conv1d(
    x: torch.Tensor,  # [num_tokens, channels]: the new inputs of every request, end to end
    # [num_slots, kernel - 1, channels]: a layer's pool; the plan's slots are updated IN PLACE
    conv_states: torch.Tensor,
    weight: torch.Tensor,  # [channels, kernel]
    plan: DeltaNetPlan,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv then SiLU → (out [num_tokens, channels] in x's dtype, the conv state
    after each verify position [num_windows, max_window, kernel − 1, channels] or None).

    The taps are summed in a fixed order, one elementwise multiply-add each, so a
    token's output never depends on the batch or the chunking around it.
    """
    if plan.conv is None:
        raise ValueError("the torch causal conv needs a plan built with conv_kernel")
    rows = torch.cat([conv_states[plan.slots].reshape(-1, conv_states.shape[-1]), x.to(conv_states.dtype)])
    windows = rows[plan.conv.window_rows]  # [num_tokens, kernel, channels]
    out = windows[:, 0] * weight[:, 0]
    for j in range(1, weight.shape[1]):
        out = out + windows[:, j] * weight[:, j]
    window_states = rows[plan.conv.window_state_rows] if plan.conv.window_state_rows is not None else None
    conv_states[plan.slots] = rows[plan.conv.state_rows]
    return invariant_map(F.silu, out).to(x.dtype), window_states


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim (FLA's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qkv(
    mixed: torch.Tensor, num_key_heads: int, num_value_heads: int, key_head_dim: int, value_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv's output [T, conv_dim] → q, k [T, value_heads, key_head_dim] (normalised, q scaled,
    repeated tiled over value heads) and v [T, value_heads, value_head_dim], float32."""
    key_dim = num_key_heads * key_head_dim
    q, k, v = mixed.float().split([key_dim, key_dim, num_value_heads * value_head_dim], dim=-1)
    q = l2_normalize(q.reshape(-1, num_key_heads, key_head_dim)) * key_head_dim**-0.5
    k = l2_normalize(k.reshape(-1, num_key_heads, key_head_dim))
    repeats = num_value_heads // num_key_heads
    if repeats > 1:
        q, k = q.repeat(1, repeats, 1), k.repeat(1, repeats, 1)
    return q, k, v.reshape(-1, num_value_heads, value_head_dim)


def gates(
    alpha: torch.Tensor, beta: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-decay g = a · softplus(alpha + dt_bias), write strength sigmoid(beta)), each [T, value_heads] float32."""
    g = a.float() * invariant_map(F.softplus, alpha.float() + dt_bias.float())
    return g, invariant_map(torch.sigmoid, beta.float())


def num_key_heads_of(mixed: torch.Tensor, states: torch.Tensor) -> int:
    """Key heads, from the conv output's width (2 · key_heads · dk + value_heads · dv) and the state's shape."""
    heads, dk, dv = states.shape[1:]
    num_key_heads, rest = divmod(mixed.shape[1] - heads * dv, 2 * dk)
    if rest or num_key_heads < 1 or heads % num_key_heads:
        raise ValueError(
            f"mixed of width {mixed.shape[1]} does not hold q, k, v for states of shape {tuple(states.shape)}"
        )
    return num_key_heads


def gated_delta_rule(
    mixed: torch.Tensor,  # [T, 2 · key_dim + value_dim]: the conv's output, q | k | v
    alpha: torch.Tensor,  # [T, H]: the decay projection
    beta: torch.Tensor,  # [T, H]: the write-strength projection
    a: torch.Tensor,  # [H]: -exp(A_log)
    dt_bias: torch.Tensor,  # [H]
    states: torch.Tensor,  # [num_slots, H, dk, dv] float32: a layer's pool; the plan's slots are updated IN PLACE
    plan: DeltaNetPlan,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over every request → (o [T, H, dv] float32, the state of each verifying
    request before its window [num_windows, H, dk, dv] or None)."""
    heads, dk, dv = states.shape[1:]
    q, k, v = prepare_qkv(mixed, num_key_heads_of(mixed, states), heads, dk, dv)
    g, b = gates(alpha, beta, a, dt_bias)
    decay = invariant_map(torch.exp, g)
    request_states = states[plan.slots]  # [R, H, dk, dv], a copy
    out = torch.empty_like(v)
    windows = plan.window_requests
    window_starts = states.new_empty(len(windows), heads, dk, dv) if windows else None
    for r, (start, n) in enumerate(zip(plan.query_starts, plan.query_lens)):
        rows = slice(start, start + n)
        if plan.chunked[r]:
            out[rows], request_states[r] = chunked_gated_delta_rule(
                q[rows], k[rows], v[rows], g[rows], b[rows], request_states[r]
            )
            continue
        s = request_states[r]
        window_offset = n - plan.window_lens[r] if plan.window_lens[r] else -1
        for o in range(n):
            if o == window_offset:
                window_starts[windows.index(r)] = s
            t = start + o
            s = s * decay[t][:, None, None]
            predicted = (s * k[t][:, :, None]).sum(dim=-2)  # [H, dv]: what S already returns for k
            s = s + k[t][:, :, None] * ((v[t] - predicted) * b[t][:, None])[:, None, :]
            out[t] = (s * q[t][:, :, None]).sum(dim=-2)
        request_states[r] = s
    states[plan.slots] = request_states
    return out, window_starts


@dataclass(frozen=True)
class DeltaRuleWindow:
    """One DeltaNet layer's verify window of one request: the state before it and the raw inputs of
    its positions, from which `state_after` rebuilds the state after any of them with the very ops
    (and so the very bits) the forward pass ran."""

    start: torch.Tensor  # [H, dk, dv] float32
    mixed: torch.Tensor  # [window, conv_dim]
    alpha: torch.Tensor  # [window, H]
    beta: torch.Tensor  # [window, H]
    a: torch.Tensor  # [H]: the layer's weights (shared, not copied)
    dt_bias: torch.Tensor
    ops: Any  # TorchOps, CpuOps or TritonOps: whichever ran the forward pass

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.start, self.mixed, self.alpha, self.beta))

    def state_after(self, num_tokens: int) -> torch.Tensor:
        """The state after the window's first `num_tokens` positions [H, dk, dv]."""
        states = self.start[None].clone()
        plan = build_delta_net_plan([0], [num_tokens], [1], [0], states.device)
        rows = slice(0, num_tokens)
        self.ops.gated_delta_rule(
            self.mixed[rows], self.alpha[rows], self.beta[rows], self.a, self.dt_bias, states, plan
        )
        return states[0]


def chunked_gated_delta_rule(
    q: torch.Tensor,  # [n, H, dk] float32 (one request), normalised and scaled
    k: torch.Tensor,  # [n, H, dk]
    v: torch.Tensor,  # [n, H, dv]
    g: torch.Tensor,  # [n, H]
    beta: torch.Tensor,  # [n, H]
    state: torch.Tensor,  # [H, dk, dv] float32: the state before the first token
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule over one request's tokens, C at a time → (o [n, H, dv], state after the last token).

    Within a chunk, with cumulative log-decays c_i and decays D_ij = exp(c_i − c_j) for j ≤ i:
    the C updates' new values u solve the unit lower-triangular system
    (I + strictly_lower(β_i k_i·k_j D_ij)) u = β v − β·exp(c) (K S₀), the outputs are
    o_i = exp(c_i) q_i S₀ + Σ_{j≤i} (q_i·k_j) D_ij u_j, and the state leaves the chunk as
    S = exp(c_C) S₀ + Σ_j exp(c_C − c_j) k_j ⊗ u_j.
    """
    n = q.shape[0]
    pad = (-n) % chunk_size

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [n, H, ...] → [H, num_chunks, C, ...], zero-padded
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])]).transpose(0, 1)
        return x.reshape(x.shape[0], -1, chunk_size, *x.shape[2:])

    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    gc, bc = chunks(g), chunks(beta)  # [H, N, C]
    cum = gc.cumsum(dim=-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, N, C, C]
    k_beta = kc * bc[..., None]
    system = (k_beta @ kc.transpose(-1, -2)) * decay  # its diagonal is read as ones (unitriangular)
    values = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
    state_reads = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    scores = (qc @ kc.transpose(-1, -2)) * decay
    q_decayed = qc * cum.exp()[..., None]
    k_to_end = kc * (cum[..., -1:] - cum).exp()[..., None]
    out = torch.empty_like(vc)
    s = state
    for i in range(qc.shape[1]):
        u = values[:, i] - state_reads[:, i] @ s  # [H, C, dv]
        out[:, i] = q_decayed[:, i] @ s + scores[:, i] @ u
        s = s * cum[:, i, -1].exp()[:, None, None] + k_to_end[:, i].transpose(-1, -2) @ u
    out = out.reshape(out.shape[0], -1, out.shape[-1])[:, :n].transpose(0, 1)
    return out, s
