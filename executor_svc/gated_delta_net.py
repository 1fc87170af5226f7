"""Gated DeltaNet in plain torch: the short causal conv and the gated delta rule over a ragged batch.

A DeltaNet layer keeps, per request, a fixed-size state instead of KV:
- the conv state: the last `kernel - 1` inputs of the depthwise causal conv, [kernel - 1, channels];
- the recurrent state S, one [key_dim, value_dim] matrix per value head, float32.

For each token, with q, k L2-normalised (q also scaled by key_dim^-1/2), decay
γ = exp(g) and write strength β:

    S ← γ·S                      # forget
    S ← S + k ⊗ β·(v − Sᵀk)      # delta rule: write the part of v that S does not yet predict
    o = Sᵀq

`recurrent_gated_delta_rule` runs exactly that, token by token, for every request of
the batch at once. It is the reference and the batch-invariant path: a request's
state after token t is the same bits whatever the batch, the prefill chunking or the
verify window around it, because every step is the same elementwise arithmetic on
that request's rows. For a request verifying drafts it also hands back the state
before the verify window and the window's update inputs, from which the state after
any kept draft is replayed bit for bit (one state per request instead of K + 1).

`chunked_gated_delta_rule` is the same function evaluated a chunk of C tokens at a
time (the WY/UT form of the DeltaNet papers: within a chunk, the C sequential
rank-1 updates become one triangular solve and a few matmuls). It is much faster for
long prefills, and equal to the recurrent form up to float rounding, which depends on
where chunks start; so it serves prefills only when batch invariance is not asked for.

Value head h reads key head h mod num_key_heads: the "tiled" order llama.cpp's
converter stores the value heads in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor_svc.invariant_elementwise import invariant_map


@dataclass(frozen=True)
class ConvPlan:
    """Gather indices of the causal conv for one step, built once and used by every DeltaNet layer."""

    window_rows: torch.Tensor  # [num_tokens, kernel]: rows of cat(conv states, inputs) each token's window reads
    state_rows: torch.Tensor  # [num_requests, kernel - 1]: rows that become each request's next conv state
    # [num_requests, num_logits, kernel - 1]: the conv state after each verify position (None: no verify)
    window_state_rows: torch.Tensor | None


def build_conv_plan(query_starts: list[int], query_lens: list[int], logits_counts: list[int], kernel: int, device) -> ConvPlan:
    """Token i of request r (at offset o of its query) convolves `kernel` rows ending at itself:
    the request's previous conv state (row r·(k−1) + j of the states) for offsets before its
    first new token, its own new inputs (row R·(k−1) + query_start + o') after."""
    num_requests, width = len(query_lens), kernel - 1
    base = num_requests * width  # inputs follow the R stacked conv states

    def row(r: int, offset: int) -> int:  # offset in the request's window; offset < width is the old state
        return r * width + offset if offset < width else base + query_starts[r] + offset - width

    window_rows, state_rows = [], []
    max_logits = max(logits_counts, default=0)
    window_states = []
    for r, n in enumerate(query_lens):
        for o in range(n):
            window_rows.append([row(r, o + j) for j in range(kernel)])
        state_rows.append([row(r, n + j) for j in range(width)])
        # After position p of the query, the state is the window's `width` rows ending at p.
        ends = [n - logits_counts[r] + i for i in range(logits_counts[r])] + [n - 1] * (max_logits - logits_counts[r])
        window_states.append([[row(r, e + 1 + j) for j in range(width)] for e in ends])
    as_tensor = lambda rows, shape: torch.tensor(rows, dtype=torch.int64, device=device).reshape(shape)  # noqa: E731
    return ConvPlan(
        window_rows=as_tensor(window_rows, (-1, kernel)),
        state_rows=as_tensor(state_rows, (num_requests, width)),
        window_state_rows=as_tensor(window_states, (num_requests, max_logits, width)) if max_logits > 1 else None,
    )


def causal_conv1d(
    x: torch.Tensor,  # [num_tokens, channels]: the new inputs of every request, end to end
    conv_states: torch.Tensor,  # [num_requests, kernel - 1, channels]: each request's previous inputs
    weight: torch.Tensor,  # [channels, kernel]
    plan: ConvPlan,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv then SiLU → (out [num_tokens, channels], next conv states
    [num_requests, kernel - 1, channels], conv states after each verify position or None).

    The taps are summed in a fixed order, one elementwise multiply-add each, so a
    token's output never depends on the batch or the chunking around it.
    """
    rows = torch.cat([conv_states.reshape(-1, conv_states.shape[-1]), x.to(conv_states.dtype)])
    windows = rows[plan.window_rows]  # [num_tokens, kernel, channels]
    out = windows[:, 0] * weight[:, 0]
    for j in range(1, weight.shape[1]):
        out = out + windows[:, j] * weight[:, j]
    window_states = rows[plan.window_state_rows] if plan.window_state_rows is not None else None
    return invariant_map(F.silu, out).to(x.dtype), rows[plan.state_rows], window_states


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


def gates(alpha: torch.Tensor, beta: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-decay g = a · softplus(alpha + dt_bias), write strength sigmoid(beta)), each [T, value_heads] float32."""
    g = a.float() * invariant_map(F.softplus, alpha.float() + dt_bias.float())
    return g, invariant_map(torch.sigmoid, beta.float())


@dataclass(frozen=True)
class DeltaRuleInputs:
    """What the state update of some tokens reads, per token: decay [n, H, 1, 1], k [n, H, dk, 1],
    v [n, H, dv], beta [n, H, 1] (float32), shaped for `delta_rule_step`."""

    decay: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor

    def __getitem__(self, rows) -> "DeltaRuleInputs":
        return DeltaRuleInputs(self.decay[rows], self.k[rows], self.v[rows], self.beta[rows])

    def copy(self) -> "DeltaRuleInputs":
        return DeltaRuleInputs(self.decay.clone(), self.k.clone(), self.v.clone(), self.beta.clone())


def delta_rule_step(s: torch.Tensor, inputs: DeltaRuleInputs, t: int) -> torch.Tensor:
    """One token's update of one request's state s [H, dk, dv]: S ← γS, then S ← S + k ⊗ β(v − Sᵀk)."""
    s = s * inputs.decay[t]
    predicted = (s * inputs.k[t]).sum(dim=-2)  # [H, dv]: what S already returns for k
    return s + inputs.k[t] * ((inputs.v[t] - predicted) * inputs.beta[t])[:, None, :]


def replay_delta_rule(state: torch.Tensor, inputs: DeltaRuleInputs, num_tokens: int) -> torch.Tensor:
    """The state after the first `num_tokens` tokens of `inputs`, from `state` (the very bits the
    forward pass had there: the same steps on the same shapes)."""
    for t in range(num_tokens):
        state = delta_rule_step(state, inputs, t)
    return state


def recurrent_gated_delta_rule(
    q: torch.Tensor,  # [T, H, dk] float32, normalised and scaled
    k: torch.Tensor,  # [T, H, dk] float32, normalised
    v: torch.Tensor,  # [T, H, dv] float32
    g: torch.Tensor,  # [T, H] log-decay (≤ 0)
    beta: torch.Tensor,  # [T, H]
    states: torch.Tensor,  # [R, H, dk, dv] float32: each request's state before its first token; updated IN PLACE
    query_starts: list[int],
    query_lens: list[int],
    logits_counts: list[int] | None = None,
) -> tuple[torch.Tensor, dict[int, torch.Tensor], DeltaRuleInputs]:
    """The delta rule token by token → (o [T, H, dv] float32; for each request r verifying drafts
    (logits_counts[r] > 1) a copy of its state before the verify window [H, dk, dv]; the
    per-token update inputs).

    Each request runs on its own [H, dk, dv] state with the same op sequence per token,
    so its bits depend on nothing but its own tokens (not the batch, not the chunking).
    The state after any position of a verify window is `replay_delta_rule` of the window
    start over the window's inputs: speculation keeps one state per request, not K + 1.
    """
    num_requests = len(query_lens)
    out = torch.empty_like(v)
    counts = logits_counts or [0] * num_requests
    window_starts: dict[int, torch.Tensor] = {}
    inputs = DeltaRuleInputs(invariant_map(torch.exp, g)[..., None, None], k[..., None], v, beta[..., None])
    q_col = q[..., None]  # [T, H, dk, 1]
    for r, (start, n) in enumerate(zip(query_starts, query_lens)):
        s = states[r]
        window_start = start + n - counts[r] if counts[r] > 1 else -1
        for t in range(start, start + n):
            if t == window_start:
                window_starts[r] = s.clone()
            s = delta_rule_step(s, inputs, t)
            out[t] = (s * q_col[t]).sum(dim=-2)
        states[r] = s
    return out, window_starts, inputs


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
