"""The mixture-of-experts FFN (qwen3moe, qwen35moe): route, run each expert on its rows, combine.

Routing follows the models (and llama.cpp's `build_moe_ffn` for them): softmax over
the router's logits in float32, the top-k experts, their probabilities renormalised
to sum to one. Tokens are then grouped by expert, so each expert's matmuls run once
over all the rows routed to it (grouped GEMM through the weight-format layer's
`linear`), and the weighted outputs are added back per token in ascending expert
order. A row's result does not depend on which other rows share an expert: the
packed-weight kernels are row-invariant, and the per-token sum order is fixed.

qwen35moe adds a shared expert that every token runs, scaled by sigmoid(x · w_gate).
"""

from __future__ import annotations

import torch

from executor_svc.model.invariant_elementwise import invariant_map
from executor_svc.weights.model_weights import MoeWeights
from executor_svc.weights.weight_format import linear


def route(router_logits: torch.Tensor, num_experts_per_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (expert ids [T, k] int64, weights [T, k] float32 summing to 1 per row)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, num_experts_per_token, dim=-1)
    return experts, weights / weights.sum(dim=-1, keepdim=True)


def moe_ffn(x: torch.Tensor, moe: MoeWeights, num_experts_per_token: int, ops) -> torch.Tensor:
    """x [T, hidden] → the sparse FFN's output [T, hidden] in x's dtype."""
    experts, weights = route(linear(x, moe.router), num_experts_per_token)
    k = num_experts_per_token
    # Every (token, choice) pair, grouped by expert; a stable sort keeps tokens in order within a group.
    order = torch.argsort(experts.reshape(-1), stable=True)
    counts = torch.bincount(experts.reshape(-1), minlength=len(moe.expert_down)).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start : start + count]
        start += count
        rows = pairs // k
        y = linear(ops.silu_mul(linear(x[rows], moe.expert_gate_up[expert])), moe.expert_down[expert])
        out.index_add_(0, rows, y * weights.reshape(-1)[pairs, None].to(y.dtype))
    if moe.shared_gate_up is not None:
        shared = linear(ops.silu_mul(linear(x, moe.shared_gate_up)), moe.shared_down)
        # One logit per token: a row reduction (not a GEMV, whose result would depend on the row count).
        gate_logits = (x * moe.shared_gate).sum(dim=-1, keepdim=True)
        out = out + invariant_map(torch.sigmoid, gate_logits) * shared
    return out
