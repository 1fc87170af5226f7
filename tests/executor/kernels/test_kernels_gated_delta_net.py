"""The Triton causal conv and gated delta rule against the torch reference (`TorchOps`), under the
interpreter: ragged batches (prefill chunks, single decode tokens, verify windows), odd sizes, state
updates in place at the plan's pool slots, bitwise batch invariance, verify-window replay; and
`--kernels triton` in the engine on a tiny Qwen3.5 model giving the torch tokens."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.kernels.triton_ops import TritonOps  # noqa: E402
from executor_svc.model import gated_delta_net  # noqa: E402
from executor_svc.model.gated_delta_net import DeltaRuleWindow, build_delta_net_plan  # noqa: E402
from executor_svc.model.torch_ops import TorchOps  # noqa: E402

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]
# The conv: the reference multiplies and adds in the input dtype, the kernel in float32 (rounding once).
CONV_TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=4e-3, atol=4e-3),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
}
# The delta rule reads its inputs in any dtype and computes in float32 on both sides.
DELTA_TOLERANCE = dict(rtol=2e-5, atol=2e-5)

# A ragged batch: a prefill chunk, single decode tokens (M = 1), verify runs of 4 and 2 positions,
# a one-token prompt; pool slots out of order, with slots no request holds.
LENS = [7, 1, 5, 2, 1, 9]
LOGITS = [0, 1, 4, 2, 1, 1]
SLOTS = [5, 0, 3, 7, 2, 6]
NUM_SLOTS = 8


def plan_of(lens, logits_counts, slots, conv_kernel=None):
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return build_delta_net_plan(starts, lens, logits_counts, slots, CPU, conv_kernel)


def conv_inputs(num_tokens, channels, kernel, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(num_tokens, channels + 5, generator=gen)).to(dtype)[
        :, :channels
    ]  # rows strided, as split views are
    states = torch.randn(NUM_SLOTS, kernel - 1, channels, generator=gen).to(dtype)
    weight = (0.5 * torch.randn(channels, kernel, generator=gen)).to(dtype)
    return x, states, weight


def delta_inputs(num_tokens, key_heads, heads, dk, dv, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = 2 * key_heads * dk + heads * dv
    proj = torch.randn(num_tokens, width + 2 * heads + 3, generator=gen)
    proj[:, width : width + heads] *= 4  # β's projection: strengths near 0 and 1
    proj = proj.to(dtype)
    mixed, beta, alpha = proj[:, :width], proj[:, width : width + heads], proj[:, width + heads : width + 2 * heads]
    a = (-2 * torch.rand(heads, generator=gen)).to(dtype)
    dt_bias = torch.randn(heads, generator=gen).to(dtype)
    states = torch.randn(NUM_SLOTS, heads, dk, dv, generator=gen)
    return mixed, alpha, beta, a, dt_bias, states


# ---------------------------------------------------------------- the causal conv


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("channels,kernel", [(64, 4), (300, 4), (37, 3), (8, 2)])  # one, two partial channel blocks
def test_conv_matches_torch_with_states_and_verify_windows(dtype, channels, kernel):
    x, states, weight = conv_inputs(sum(LENS), channels, kernel, dtype)
    ours, ref = states.clone(), states.clone()
    out, windows = TritonOps().causal_conv1d(x, ours, weight, plan_of(LENS, LOGITS, SLOTS))
    ref_out, ref_windows = TorchOps().causal_conv1d(x, ref, weight, plan_of(LENS, LOGITS, SLOTS, kernel))
    assert out.dtype == ref_out.dtype == dtype and out.shape == ref_out.shape
    torch.testing.assert_close(out, ref_out, **CONV_TOLERANCES[dtype])
    assert torch.equal(ours, ref)  # states are copies of inputs: exact, and untouched outside the plan's slots
    assert windows.shape == ref_windows.shape == (2, 4, kernel - 1, channels)
    for i, count in enumerate((4, 2)):  # the verifying requests' windows
        assert torch.equal(windows[i, :count], ref_windows[i, :count])


def test_conv_of_one_decode_token_reads_only_the_state():
    x, states, weight = conv_inputs(1, 16, 4, torch.float32)
    ours, ref = states.clone(), states.clone()
    out, windows = TritonOps().causal_conv1d(x, ours, weight, plan_of([1], [1], [4]))
    ref_out, _ = TorchOps().causal_conv1d(x, ref, weight, plan_of([1], [1], [4], 4))
    assert windows is None
    torch.testing.assert_close(out, ref_out, **CONV_TOLERANCES[torch.float32])
    assert torch.equal(ours[4], torch.cat([states[4, 1:], x]))


# ---------------------------------------------------------------- the gated delta rule


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(
    "key_heads,heads,dk,dv",
    [(2, 4, 16, 16), (1, 3, 12, 40), (2, 2, 32, 8)],  # tiled heads; odd dk and dv over two value tiles; no tiling
)
def test_delta_rule_matches_torch_with_states_and_verify_windows(dtype, key_heads, heads, dk, dv):
    mixed, alpha, beta, a, dt_bias, states = delta_inputs(sum(LENS), key_heads, heads, dk, dv, dtype)
    ours, ref = states.clone(), states.clone()
    plan = plan_of(LENS, LOGITS, SLOTS)
    out, window_starts = TritonOps().gated_delta_rule(mixed, alpha, beta, a, dt_bias, ours, plan)
    ref_out, ref_window_starts = TorchOps().gated_delta_rule(mixed, alpha, beta, a, dt_bias, ref, plan)
    assert out.dtype == torch.float32 and out.shape == ref_out.shape == (sum(LENS), heads, dv)
    torch.testing.assert_close(out, ref_out, **DELTA_TOLERANCE)
    torch.testing.assert_close(ours, ref, **DELTA_TOLERANCE)
    untouched = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert torch.equal(ours[untouched], states[untouched])
    torch.testing.assert_close(window_starts, ref_window_starts, **DELTA_TOLERANCE)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp of a masked-off branch
def test_extreme_gates_match_torch():
    """softplus past torch's threshold (20), decays of 0 and 1, strengths of 0 and 1."""
    mixed, alpha, beta, a, dt_bias, states = delta_inputs(4, 1, 2, 8, 8)
    alpha[:, 0] = torch.tensor([60.0, -60.0, 19.5, 20.5])
    beta[:, 1] = torch.tensor([80.0, -80.0, 0.0, 30.0])
    ours, ref = states.clone(), states.clone()
    plan = plan_of([4], [1], [1])
    out, _ = TritonOps().gated_delta_rule(mixed, alpha, beta, a, dt_bias, ours, plan)
    ref_out, _ = TorchOps().gated_delta_rule(mixed, alpha, beta, a, dt_bias, ref, plan)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, **DELTA_TOLERANCE)
    torch.testing.assert_close(ours, ref, **DELTA_TOLERANCE)


# ---------------------------------------------------------------- the chunked (WY) delta rule

# The chunked kernel's tolerance, every input dtype alike (it computes in float32, its dots in IEEE
# float32): against torch's chunked form at the same C and against the recurrent form. Measured
# max abs differences here are ~2e-7 on outputs of ~0.6 and ~8e-7 on states of ~4.
CHUNKED_TOLERANCE = dict(rtol=2e-5, atol=2e-5)
# Rows of 37 (three chunks of 16, the last partial), 16 (one whole chunk), 20 and two of one token in
# the chunked form, beside a verify run of 4 in the recurrent one.
CHUNKED_LENS = [37, 1, 16, 5, 1, 20]
CHUNKED_LOGITS = [1, 1, 0, 4, 0, 1]
CHUNKED_SLOTS = [5, 0, 3, 7, 2, 6]
C = 16  # the kernel's chunk here: small, so tiny prefills span several chunks


def chunked_plan_of(lens, logits_counts, slots, min_chunked_tokens=1):
    """min_chunked_tokens=1: every row without a verify window takes the chunked form, one-token rows too."""
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return build_delta_net_plan(starts, lens, logits_counts, slots, CPU, min_chunked_tokens=min_chunked_tokens)


def torch_chunked(mixed, alpha, beta, a, dt_bias, states, plan, chunk_tokens):
    """TorchOps' gated_delta_rule with its chunked form at C = chunk_tokens."""
    reference = gated_delta_net.chunked_gated_delta_rule
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            gated_delta_net, "chunked_gated_delta_rule", lambda *args: reference(*args, chunk_size=chunk_tokens)
        )
        return TorchOps().gated_delta_rule(mixed, alpha, beta, a, dt_bias, states, plan)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(
    "key_heads,heads,dk,dv", [(2, 4, 16, 16), (1, 3, 12, 40)]
)  # tiled heads; odd dk, two value tiles
def test_chunked_delta_rule_matches_torch_chunked_and_recurrent_forms(dtype, key_heads, heads, dk, dv):
    mixed, alpha, beta, a, dt_bias, states = delta_inputs(sum(CHUNKED_LENS), key_heads, heads, dk, dv, dtype)
    plan = chunked_plan_of(CHUNKED_LENS, CHUNKED_LOGITS, CHUNKED_SLOTS)
    assert plan.chunked == (True, True, True, False, True, True)
    ours, chunked_ref, recurrent_ref = states.clone(), states.clone(), states.clone()
    out, window_starts = TritonOps(delta_rule_chunk_tokens=C).gated_delta_rule(
        mixed, alpha, beta, a, dt_bias, ours, plan
    )
    ref_out, ref_window_starts = torch_chunked(mixed, alpha, beta, a, dt_bias, chunked_ref, plan, C)
    recurrent_out, _ = TorchOps().gated_delta_rule(
        mixed, alpha, beta, a, dt_bias, recurrent_ref, plan_of(CHUNKED_LENS, CHUNKED_LOGITS, CHUNKED_SLOTS)
    )
    torch.testing.assert_close(out, ref_out, **CHUNKED_TOLERANCE)
    torch.testing.assert_close(ours, chunked_ref, **CHUNKED_TOLERANCE)
    torch.testing.assert_close(out, recurrent_out, **CHUNKED_TOLERANCE)
    torch.testing.assert_close(ours, recurrent_ref, **CHUNKED_TOLERANCE)
    torch.testing.assert_close(window_starts, ref_window_starts, **DELTA_TOLERANCE)
    untouched = [s for s in range(NUM_SLOTS) if s not in CHUNKED_SLOTS]
    assert torch.equal(ours[untouched], states[untouched])


def test_chunked_delta_rule_at_the_default_chunk_over_several_chunks():
    """C = 64 (the engine's), a 150-token prefill (two whole chunks and a partial one), with
    strong decays and strengths (the unit-triangular inverse's entries grow with both)."""
    mixed, alpha, beta, a, dt_bias, states = delta_inputs(151, 1, 2, 16, 16)
    beta[:150] = 3 * beta[:150].abs()
    plan = chunked_plan_of([150, 1], [1, 1], [4, 1], min_chunked_tokens=64)
    assert plan.chunked == (True, False)
    ours, recurrent_ref = states.clone(), states.clone()
    out, _ = TritonOps().gated_delta_rule(mixed, alpha, beta, a, dt_bias, ours, plan)
    recurrent_out, _ = TorchOps().gated_delta_rule(
        mixed, alpha, beta, a, dt_bias, recurrent_ref, plan_of([150, 1], [1, 1], [4, 1])
    )
    torch.testing.assert_close(out, recurrent_out, **CHUNKED_TOLERANCE)
    torch.testing.assert_close(ours, recurrent_ref, **CHUNKED_TOLERANCE)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp of a masked-off branch
def test_chunked_delta_rule_with_extreme_gates():
    """Decays of 0 and 1 and strengths of 0 and 1 inside one chunk."""
    mixed, alpha, beta, a, dt_bias, states = delta_inputs(6, 1, 2, 8, 8)
    alpha[:, 0] = torch.tensor([60.0, -60.0, 19.5, 20.5, 60.0, -60.0])
    beta[:, 1] = torch.tensor([80.0, -80.0, 0.0, 30.0, -30.0, 80.0])
    ours, ref = states.clone(), states.clone()
    out, _ = TritonOps(delta_rule_chunk_tokens=C).gated_delta_rule(
        mixed, alpha, beta, a, dt_bias, ours, chunked_plan_of([6], [1], [1])
    )
    ref_out, _ = TorchOps().gated_delta_rule(mixed, alpha, beta, a, dt_bias, ref, plan_of([6], [1], [1]))
    assert torch.isfinite(out).all() and torch.isfinite(ours).all()
    torch.testing.assert_close(out, ref_out, **CHUNKED_TOLERANCE)
    torch.testing.assert_close(ours, ref, **CHUNKED_TOLERANCE)


@pytest.mark.slow
def test_chunked_requests_bits_do_not_depend_on_the_batch():
    """Each chunked request alone, and in batches of other compositions and orders: the same bits."""
    ops = TritonOps(delta_rule_chunk_tokens=C)
    mixed, alpha, beta, a, dt_bias, states = delta_inputs(sum(CHUNKED_LENS), 2, 4, 16, 16)
    starts = [sum(CHUNKED_LENS[:i]) for i in range(len(CHUNKED_LENS))]
    rows = [slice(s, s + n) for s, n in zip(starts, CHUNKED_LENS)]

    def run(requests):
        """The requests (indices into CHUNKED_*) in this order in one launch → (per request: out, state)."""
        pool = states.clone()
        pick = lambda t: torch.cat([t[rows[r]] for r in requests])  # noqa: E731
        plan = chunked_plan_of(
            [CHUNKED_LENS[r] for r in requests],
            [CHUNKED_LOGITS[r] for r in requests],
            [CHUNKED_SLOTS[r] for r in requests],
        )
        out, _ = ops.gated_delta_rule(pick(mixed), pick(alpha), pick(beta), a, dt_bias, pool, plan)
        offsets = [sum(CHUNKED_LENS[q] for q in requests[:i]) for i in range(len(requests))]
        return {r: (out[o : o + CHUNKED_LENS[r]], pool[CHUNKED_SLOTS[r]]) for r, o in zip(requests, offsets)}

    batch = run(list(range(len(CHUNKED_LENS))))
    others = [run([5, 0, 3]), run([2, 4, 1, 0])]
    for r in (0, 2, 4, 5):
        alone = run([r])[r]
        for result in [batch, *others]:
            if r in result:
                assert torch.equal(alone[0], result[r][0]) and torch.equal(alone[1], result[r][1]), r


@pytest.mark.slow
def test_chunked_prefill_split_at_a_chunk_multiple_gives_the_same_bits():
    """What holds for the engine's prefill chunking: a prompt prefilled in one step and in two split
    at a multiple of C gives the same bits; split elsewhere, the same values up to rounding."""
    ops = TritonOps(delta_rule_chunk_tokens=C)
    n = 45
    mixed, alpha, beta, a, dt_bias, states = delta_inputs(n, 2, 4, 16, 16)

    def run(cuts):
        pool, outs = states.clone(), []
        for start, end in zip([0, *cuts], [*cuts, n]):
            rows = slice(start, end)
            out, _ = ops.gated_delta_rule(
                mixed[rows], alpha[rows], beta[rows], a, dt_bias, pool, chunked_plan_of([end - start], [1], [2])
            )
            outs.append(out)
        return torch.cat(outs), pool[2]

    whole = run([])
    for cuts in ([16], [32], [16, 32]):
        split = run(cuts)
        assert torch.equal(split[0], whole[0]) and torch.equal(split[1], whole[1]), cuts
    for cuts in ([7], [20, 33]):
        split = run(cuts)
        torch.testing.assert_close(split[0], whole[0], **CHUNKED_TOLERANCE)
        torch.testing.assert_close(split[1], whole[1], **CHUNKED_TOLERANCE)


def test_bad_chunk_sizes_are_refused():
    for chunk_tokens in (8, 48):
        with pytest.raises(ValueError, match="delta_rule_chunk_tokens must be a power of two >= 16"):
            TritonOps(delta_rule_chunk_tokens=chunk_tokens)


# ---------------------------------------------------------------- batch invariance, replay


def test_a_requests_bits_do_not_depend_on_its_batch_or_its_chunking():
    """Request 2 alone, inside the ragged batch, and prefilled in two chunks: the same bits."""
    ops, kernel, channels = TritonOps(), 4, 2 * 2 * 16 + 4 * 16
    mixed, alpha, beta, a, dt_bias, states = delta_inputs(sum(LENS), 2, 4, 16, 16)
    x, conv_states, weight = conv_inputs(sum(LENS), channels, kernel, torch.float32)
    start, n = sum(LENS[:2]), LENS[2]
    rows = slice(start, start + n)

    def run(parts, lens, logits, slots):
        """parts: row ranges of the inputs laid end to end → (conv out, delta out, conv states, states)."""
        conv, recurrent = conv_states.clone(), states.clone()
        pick = lambda t: torch.cat([t[p] for p in parts])  # noqa: E731
        plan = plan_of(lens, logits, slots)
        conv_out, _ = ops.causal_conv1d(pick(x), conv, weight, plan)
        delta_out, _ = ops.gated_delta_rule(pick(mixed), pick(alpha), pick(beta), a, dt_bias, recurrent, plan)
        return conv_out, delta_out, conv, recurrent

    batch = run([slice(0, sum(LENS))], LENS, LOGITS, SLOTS)
    alone = run([rows], [n], [4], [3])
    for ours, theirs in zip(alone[:2], batch[:2]):
        assert torch.equal(ours, theirs[rows])
    assert torch.equal(alone[2][3], batch[2][3]) and torch.equal(alone[3][3], batch[3][3])
    # In two steps (2 then 3 tokens), the second beside a one-token decode of another request.
    first = run([slice(start, start + 2)], [2], [0], [3])
    conv_states[3], states[3] = first[2][3], first[3][3]
    second = run([slice(0, 1), slice(start + 2, start + n)], [1, 3], [1, 1], [0, 3])
    assert torch.equal(torch.cat([first[0], second[0][1:]]), batch[0][rows])
    assert torch.equal(torch.cat([first[1], second[1][1:]]), batch[1][rows])
    assert torch.equal(second[3][3], batch[3][3])


def test_a_verify_window_replays_to_the_state_after_each_kept_position():
    ops = TritonOps()
    mixed, alpha, beta, a, dt_bias, states = delta_inputs(sum(LENS), 2, 4, 16, 16)
    after = states.clone()
    _, window_starts = ops.gated_delta_rule(mixed, alpha, beta, a, dt_bias, after, plan_of(LENS, LOGITS, SLOTS))
    start = sum(LENS[:2])  # request 2: 5 tokens, the last 4 verified, in slot 3
    window_rows = slice(start + 1, start + 5)
    window = DeltaRuleWindow(
        window_starts[0], mixed[window_rows], alpha[window_rows], beta[window_rows], a, dt_bias, ops
    )
    for j in range(4):
        plain = states[3:4].clone()
        rows = slice(start, start + 2 + j)
        ops.gated_delta_rule(mixed[rows], alpha[rows], beta[rows], a, dt_bias, plain, plan_of([2 + j], [1], [0]))
        assert torch.equal(window.state_after(j + 1), plain[0]), j
    assert torch.equal(window.state_after(4), after[3])


def test_bad_arguments_are_refused_with_the_argument_named():
    ops = TritonOps()
    mixed, alpha, beta, a, dt_bias, states = delta_inputs(3, 2, 4, 16, 16)
    plan = plan_of([3], [1], [0])
    with pytest.raises(ValueError, match="mixed of width"):
        ops.gated_delta_rule(mixed[:, :-1], alpha, beta, a, dt_bias, states, plan)
    with pytest.raises(ValueError, match="alpha"):
        ops.gated_delta_rule(mixed, alpha[:, :3], beta, a, dt_bias, states, plan)
    with pytest.raises(ValueError, match="plan schedules 2 tokens"):
        ops.gated_delta_rule(mixed, alpha, beta, a, dt_bias, states, plan_of([2], [1], [0]))
    with pytest.raises(ValueError, match="its own recurrent-state slot"):
        plan_of([1, 2], [1, 1], [4, 4])  # two requests on one slot would race on it
    with pytest.raises(ValueError, match="states has dtype"):
        ops.gated_delta_rule(mixed, alpha, beta, a, dt_bias, states.double(), plan)
    x, conv_states, weight = conv_inputs(3, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="one conv"):
        ops.causal_conv1d(x, conv_states, weight[:, :3], plan)
    with pytest.raises(ValueError, match="stride"):
        ops.causal_conv1d(x.t(), conv_states, weight, plan)


# ---------------------------------------------------------------- in the engine


@pytest.mark.slow
def test_triton_kernels_in_the_hybrid_engine_give_the_torch_tokens(tmp_path):
    """A tiny Qwen3.5 (three DeltaNet layers, one attention layer) decoding a ragged batch with
    chunked prefills and partly kept drafts: every state rollback goes through the Triton replay."""
    from executor_svc.engine.engine import Engine, EngineConfig
    from executor_svc.engine.request_state import NewRequest
    from service_common.sampling_params import SamplingParams
    from tests.support.engine_driver import ScriptedDrafter, drive
    from tests.support.tiny_hybrid_gguf import TinyHybridSpec, write_tiny_hybrid_model

    _, path = write_tiny_hybrid_model(tmp_path / "qwen35.gguf", TinyHybridSpec("qwen35"))
    prompts = [[3, 80, 71, 72, 79, 79, 82, 3, 90, 82, 85], [150, 200, 260]]
    requests = [NewRequest(f"r{i}", p, SamplingParams(), 5, ignore_eos=True) for i, p in enumerate(prompts)]
    engines = {
        kernels: Engine(EngineConfig(model=str(path), kv_cache_bytes=4 << 20, kernels=kernels, num_state_slots=4))
        for kernels in ("torch", "triton")
    }
    assert isinstance(engines["triton"].model_runner.ops, TritonOps)
    expected = drive(engines["torch"], requests).tokens
    engine = engines["triton"]
    engine.drafter = ScriptedDrafter(expected, "partial", engine.model_config.vocab_size)
    run = drive(engine, requests, chunk_size=4, arrival_steps={"r1": 1}, draft_budget=3)
    assert 0 < run.num_accepted < run.num_drafted
    assert run.tokens == expected


@pytest.mark.slow
def test_triton_chunked_prefills_in_the_hybrid_engine_give_the_torch_tokens(tmp_path, monkeypatch):
    """Batch invariance off: prefills of ≥ 64 tokens take the chunked kernel. A 100-token prompt
    prefilled in one step (a whole chunk and a partial one), then in steps of 64 (one chunk, then a
    36-token recurrent step), while
    another request decodes with partly kept drafts beside it: the tokens of the torch engine in
    its batch-invariant (recurrent) mode. Equal tokens are what the tolerance buys on this model,
    not a bitwise promise (the chunked form rounds differently from the recurrent one)."""
    from executor_svc.engine.engine import Engine, EngineConfig
    from executor_svc.engine.request_state import NewRequest
    from executor_svc.kernels import gated_delta_rule as triton_delta_rule
    from service_common.sampling_params import SamplingParams
    from tests.support.engine_driver import ScriptedDrafter, drive
    from tests.support.tiny_hybrid_gguf import TinyHybridSpec, write_tiny_hybrid_model

    _, path = write_tiny_hybrid_model(tmp_path / "qwen35.gguf", TinyHybridSpec("qwen35"))
    long_prompt = [(7 * i) % 250 + 3 for i in range(100)]
    prompts = [long_prompt, [3, 80, 71, 72, 79, 79, 82, 3, 90, 82, 85]]
    requests = [NewRequest(f"r{i}", p, SamplingParams(), 5, ignore_eos=True) for i, p in enumerate(prompts)]
    config = dict(model=str(path), kv_cache_bytes=4 << 20, num_state_slots=4)
    expected = drive(Engine(EngineConfig(**config, kernels="torch")), requests).tokens
    # No prefix cache: the second pass must prefill the long prompt again, not resume from the first pass's snapshot.
    engine = Engine(EngineConfig(**config, kernels="triton", batch_invariant=False, enable_prefix_caching=False))
    launches = []
    launch_chunked = triton_delta_rule.launch_chunked
    monkeypatch.setattr(triton_delta_rule, "launch_chunked", lambda *a: launches.append(a[8]) or launch_chunked(*a))
    for chunk_size in (None, 64):
        launches.clear()
        engine.drafter = ScriptedDrafter(expected, "partial", engine.model_config.vocab_size)
        run = drive(engine, requests, chunk_size=chunk_size, arrival_steps={"r0": 1}, draft_budget=3)
        # The long prompt's one chunked step, in each of the 3 DeltaNet layers.
        assert launches == [[chunk_size or len(long_prompt)]] * 3, launches
        assert 0 < run.num_accepted < run.num_drafted
        assert run.tokens == expected, chunk_size
