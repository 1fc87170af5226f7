"""Draft verification of chains (the tree walk on parents -1, 0, 1, ...): greedy keeps exactly the
argmax prefix; speculative sampling with point-mass drafts reproduces the target distribution exactly."""

from __future__ import annotations

import pytest
import torch

from executor_svc.sampling.sampler import draw
from executor_svc.sampling.verifier import accept_tree, chain_parents


def accept_greedy(argmax, drafts):
    """A chain verified greedily (argmax of rows 0..m): (emitted tokens, drafts kept)."""
    emitted, kept = accept_tree(lambda row, _: argmax[row], drafts, chain_parents(len(drafts)))
    return emitted, len(kept)


def accept_sampled(probs_of_row, drafts, uniform_at):
    """A chain verified by sampling: row j's token drawn with output offset j's uniform."""
    emitted, kept = accept_tree(
        lambda row, j: draw(probs_of_row(row), uniform_at(j)), drafts, chain_parents(len(drafts))
    )
    return emitted, len(kept)


GRID = 200  # each uniform on a midpoint grid: the integral over it is exact up to 1/GRID


class _Unassigned(Exception):
    pass


def output_distribution(rows, drafts, grid_size=None):
    """The exact distribution of the emitted tokens, integrating every uniform the verifier
    actually draws over a midpoint grid (uniforms it never asks for are not enumerated)."""
    n = grid_size or GRID
    points = [(i + 0.5) / n for i in range(n)]
    dist: dict[tuple[int, ...], float] = {}
    pending = [{}]  # partial assignments of position -> uniform
    while pending:
        assignment = pending.pop()

        def uniform_at(j, assignment=assignment):
            key = j
            if key not in assignment:
                raise _Unassigned(key)
            return assignment[key]

        try:
            emitted, _ = accept_sampled(lambda j: rows[j], drafts, uniform_at)
        except _Unassigned as missing:
            (key,) = missing.args
            pending.extend({**assignment, key: u} for u in points)
            continue
        dist[tuple(emitted)] = dist.get(tuple(emitted), 0.0) + n ** -len(assignment)
    return dist


@pytest.mark.parametrize(
    "argmax,drafts,emitted,kept",
    [
        ([5], [], [5], 0),
        ([5, 6], [5], [5, 6], 1),
        ([5, 6, 7], [5, 9], [5, 6], 1),
        ([4, 6, 7], [5, 6], [4], 0),
        ([1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4], 3),
    ],
)
def test_greedy_keeps_drafts_while_they_equal_the_argmax(argmax, drafts, emitted, kept):
    assert accept_greedy(argmax, drafts) == (emitted, kept)


def test_one_draft_first_token_has_exactly_the_target_distribution():
    p0 = torch.tensor([0.1, 0.5, 0.3, 0.1], dtype=torch.float64)
    p1 = torch.tensor([0.25, 0.25, 0.4, 0.1], dtype=torch.float64)  # the model after the draft
    for draft in range(4):
        dist = output_distribution([p0, p1], [draft])
        first = torch.zeros(4, dtype=torch.float64)
        for seq, mass in dist.items():
            first[seq[0]] += mass
        torch.testing.assert_close(first, p0, atol=2.0 / GRID, rtol=0)
        # After the draft is kept, the bonus token follows the model's next distribution.
        kept = {seq[1]: mass for seq, mass in dist.items() if len(seq) == 2}
        total = sum(kept.values())
        assert abs(total - float(p0[draft])) < 2.0 / GRID
        for token, mass in kept.items():
            assert abs(mass / total - float(p1[token])) < 3.0 / GRID


def test_a_draft_the_model_never_picks_is_always_rejected_and_never_emitted():
    p0 = torch.tensor([0.0, 0.7, 0.3], dtype=torch.float64)
    dist = output_distribution([p0, p0], [0])
    assert all(seq == (1,) or seq == (2,) for seq in dist)
    assert abs(dist[(1,)] - 0.7) < 2.0 / GRID


def test_two_drafts_joint_distribution_matches_plain_sampling():
    grid_size = 40
    p0 = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    p1 = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)  # after draft 0
    p2 = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)  # after drafts 0, 2
    dist = output_distribution([p0, p1, p2], [0, 2], grid_size)
    tol = 3.0 / grid_size
    # P(first token) = p0; P(0 then y) = p0[0] p1[y]; P(0, 2, z) = p0[0] p1[2] p2[z].
    first = [sum(m for s, m in dist.items() if s[0] == x) for x in range(3)]
    assert max(abs(a - float(b)) for a, b in zip(first, p0)) < tol
    for y in range(3):
        mass = sum(m for s, m in dist.items() if s[:2] == (0, y))
        assert abs(mass - float(p0[0] * p1[y])) < tol
    for z in range(3):
        assert abs(dist.get((0, 2, z), 0.0) - float(p0[0] * p1[2] * p2[z])) < tol
    assert abs(sum(dist.values()) - 1.0) < 1e-9


def test_sampled_verification_emits_exactly_the_tokens_plain_decoding_draws():
    """Issue 12, item 7: with the same uniforms, whatever was drafted, the emitted tokens are
    plain decoding's (row j stands for the model after the first j drafts, which is the
    context plain decoding had whenever those drafts were kept)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(500):
        m = int(torch.randint(0, 5, (), generator=generator))
        rows = [torch.softmax(torch.randn(6, generator=generator, dtype=torch.float64) * 2, -1) for _ in range(m + 1)]
        uniforms = torch.rand(m + 1, generator=generator, dtype=torch.float64).tolist()
        plain = [draw(rows[j], uniforms[j]) for j in range(m + 1)]
        # Drafts that follow plain decoding for a while, then (maybe) diverge.
        drafts = [
            plain[j] if torch.rand((), generator=generator) < 0.7 else int(torch.randint(0, 6, (), generator=generator))
            for j in range(m)
        ]
        emitted, kept = accept_sampled(lambda j: rows[j], drafts, lambda j: uniforms[j])
        assert emitted == plain[: len(emitted)] and kept == len(emitted) - 1
        assert kept == next((j for j in range(m) if drafts[j] != plain[j]), m)
