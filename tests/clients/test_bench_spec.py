"""`swarmserve bench spec`: its pure parts (the workloads, the spread rule, repeats folded into
medians and ranges, tree-vs-chain and ours-vs-llama.cpp ratios, the noise verdict, the KV check,
the CPU accounting) and runs end to end on a tiny GGUF: ours always, llama.cpp's when
SWARMSERVE_BENCH_LLAMA_SERVER names a llama-server (it is not part of the test environment)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from clients.bench.cpu_share import CLOCK_TICKS, CpuSnapshot, cpu_share, parse_machine_busy_s, process_tree
from clients.bench.repeats import Spread, is_below_beyond_noise, paired_ratio
from clients.bench.speculation import (
    KvBudgetError,
    add_arguments,
    check_kv_budget,
    kv_blocks_needed,
    max_new_tokens,
    workload_messages,
)
from clients.bench.speculation_report import (
    config_results,
    format_report,
    sharing_lines,
    target_lines,
    tree_vs_chain,
    vs_llama_cpp,
)
from tests.support.stack import ROOT
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_model


def run(workload, batch_size, policy, shape, tokens_per_s, accepted_per_step=0.0, repeat=0, engine="swarmserve"):
    return dict(
        engine=engine,
        workload=workload,
        batch_size=batch_size,
        policy=policy if shape == "chain" or engine != "swarmserve" else f"{policy}+{shape}",
        shape=shape,
        repeat=repeat,
        tokens_per_s=tokens_per_s,
        accepted_per_step=accepted_per_step,
    )


def test_tree_rows_are_compared_with_the_chain_row_of_their_policy_workload_and_batch():
    runs = [
        run("branchy", 1, "fixed:8", "chain", 10.0, 1.0),
        run("branchy", 1, "fixed:8", "tree", 15.0, 2.0),
        run("branchy", 4, "fixed:8", "chain", 20.0, 0.5),
        run("branchy", 4, "fixed:8", "tree", 18.0, 0.5),
        run("branchy", 1, "off", "chain", 8.0, 0.0),
        run("branchy", 1, "off", "tree", 8.0, 0.0),  # no drafts: nothing to compare
        run("copy", 1, "goodput", "tree", 30.0, 3.0),  # no chain row
    ]
    ratios = tree_vs_chain(config_results(runs))
    assert [(q.workload, q.batch_size, q.policy) for q in ratios] == [
        ("branchy", 1, "fixed:8"),
        ("branchy", 4, "fixed:8"),
    ]
    assert ratios[0].tokens_per_s_ratio.median == 1.5 and ratios[0].accepted_per_step_ratio.median == 2.0
    assert ratios[1].tokens_per_s_ratio.median == 0.9 and ratios[1].accepted_per_step_ratio.median == 1.0
    assert ratios[0].is_tree_below is None  # one repeat: no verdict


def test_repeats_fold_into_one_result_per_configuration_in_repeat_order():
    runs = [
        run("branchy", 1, "goodput", "chain", tokens_per_s, repeat=r)
        for r, tokens_per_s in [(2, 30.0), (0, 10.0), (1, 20.0)]
    ] + [run("branchy", 2, "goodput", "chain", 50.0), run("branchy", 1, "llama.cpp", "plain", 9.0, engine="llama.cpp")]
    by_key = {(c.engine, c.policy, c.batch_size): c for c in config_results(runs)}
    assert set(by_key) == {("swarmserve", "goodput", 1), ("swarmserve", "goodput", 2), ("llama.cpp", "llama.cpp", 1)}
    goodput = by_key["swarmserve", "goodput", 1]
    assert goodput.tokens_per_s == (10.0, 20.0, 30.0)
    assert (goodput.speed.median, goodput.speed.low, goodput.speed.high) == (20.0, 10.0, 30.0)


def test_trees_are_below_chains_by_more_than_noise_only_when_their_ranges_part():
    def verdict(trees, chains):
        runs = [run("branchy", 1, "goodput", "tree", v, 1.0, r) for r, v in enumerate(trees)]
        runs += [run("branchy", 1, "goodput", "chain", v, 1.0, r) for r, v in enumerate(chains)]
        (comparison,) = tree_vs_chain(config_results(runs))
        return comparison

    below = verdict([8.0, 9.0, 9.5], [10.0, 12.0, 11.0])
    assert below.is_tree_below is True
    assert below.tokens_per_s_ratio.median == 0.8  # per repeat: 8/10, 9/12, 9.5/11
    assert verdict([8.0, 11.0, 9.5], [10.0, 12.0, 11.0]).is_tree_below is False  # overlapping: noise
    report = format_report(config_results([run("branchy", 1, "goodput", s, v, 1.0, r)
                                           for s, vs in (("tree", [8.0, 9.0]), ("chain", [10.0, 11.0]))
                                           for r, v in enumerate(vs)]), 2)  # fmt: skip
    assert "trees below chains by more than noise: YES" in report
    assert "8.5 (8.0–9.0)" in report


def test_ours_over_llama_cpp_pairs_the_same_workload_b_and_repeat():
    runs = [run("branchy", 1, "goodput", "tree", v, 1.0, r) for r, v in enumerate([30.0, 45.0, 40.0])]
    runs += [
        run("branchy", 1, "llama.cpp", "plain", v, repeat=r, engine="llama.cpp")
        for r, v in enumerate([20.0, 15.0, 10.0])
    ]
    runs += [run("branchy", 2, "llama.cpp", "plain", 99.0, engine="llama.cpp")]
    runs += [run("copy", 1, "goodput", "tree", 50.0)]
    configs = config_results(runs)
    tree = next(c for c in configs if c.policy == "goodput+tree" and c.workload == "branchy")
    ratio = vs_llama_cpp(tree, configs)
    assert (ratio.median, ratio.low, ratio.high) == (3.0, 1.5, 4.0)  # 30/20, 45/15, 40/10
    assert vs_llama_cpp(next(c for c in configs if c.workload == "copy"), configs) is None  # no llama.cpp run there
    assert vs_llama_cpp(next(c for c in configs if c.engine == "llama.cpp"), configs) is None
    (line,) = [line for line in target_lines(configs) if line]
    assert "goodput+tree 3.00x (1.50–4.00x): met at the median, not in every repeat" in line


@pytest.mark.parametrize(
    ("trees", "verdict"),
    [([21.0, 25.0], "met in every repeat"), ([19.0, 25.0], "met at the median"), ([12.0, 19.0], "NOT met")],
)
def test_the_issues_target_is_two_times_llama_cpp_at_one_agent_on_branchy(trees, verdict):
    runs = [run("branchy", 1, "goodput", "tree", v, 1.0, r) for r, v in enumerate(trees)]
    runs += [run("branchy", 1, "llama.cpp", "plain", 10.0, repeat=r, engine="llama.cpp") for r in range(2)]
    assert verdict in "\n".join(target_lines(config_results(runs)))
    other_b = [dict(r, batch_size=2) for r in runs]  # the target is at B = 1 only
    assert target_lines(config_results(other_b)) == []


def test_other_processes_cpu_is_the_machines_busy_time_less_the_benchmarks():
    before = CpuSnapshot(time_s=10.0, machine_busy_s=100.0, process_cpu_s={1: 5.0, 2: 1.0, 3: 0.5})
    after = CpuSnapshot(time_s=12.0, machine_busy_s=104.0, process_cpu_s={1: 7.5, 2: 1.0, 3: 0.7, 4: 9.0})
    share = cpu_share(before, after, tree={1, 2, 3, 4}, idle_pids={2, 3})
    # The machine was busy 4 s; the tree used 2.5 + 0 + 0.2 (pid 4 started meanwhile: not counted as ours).
    assert share.other_cores == pytest.approx((4.0 - 2.7) / 2.0)
    assert share.idle_engine_cpu_s == pytest.approx(0.2)
    quiet = cpu_share(before, CpuSnapshot(12.0, 102.5, {1: 7.5, 2: 1.0, 3: 0.5}), tree={1, 2, 3}, idle_pids={2, 3})
    assert (quiet.other_cores, quiet.idle_engine_cpu_s) == (0.0, 0.0)


def test_runs_that_shared_the_machine_are_flagged():
    quiet = [
        dict(run("branchy", 1, "goodput", "chain", 10.0, repeat=r), other_cores=0.1, idle_engine_cpu_s=0.0)
        for r in range(2)
    ]
    assert sharing_lines(config_results(quiet)) == []
    busy = quiet + [
        dict(run("branchy", 1, "llama.cpp", "plain", 9.0, engine="llama.cpp"), other_cores=1.2, idle_engine_cpu_s=0.5)
    ]
    warnings = "\n".join(sharing_lines(config_results(busy)))
    assert "in 1 of 3 runs" in warnings and "up to 1.20, llama.cpp B=1 branchy" in warnings
    assert "not being measured used 0.50 CPU-s" in warnings


def test_proc_stat_busy_time_leaves_out_idle_iowait_and_steal():
    line = "cpu  100 20 30 5000 70 4 6 800 0 0\ncpu0 50 10 15 2500 35 2 3 400 0 0\n"
    assert parse_machine_busy_s(line) == pytest.approx((100 + 20 + 30 + 4 + 6) / CLOCK_TICKS)


def test_the_process_tree_holds_the_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert {os.getpid(), child.pid} <= process_tree(os.getpid())
        assert os.getpid() not in process_tree(child.pid)
    finally:
        child.kill()
        child.wait()


def test_kv_blocks_are_counted_per_request_with_one_steps_drafts():
    # 100 + 48 + 16 = 164 tokens: 11 blocks of 16; 200 + 48 + 16 = 264: 17 blocks (16.5 rounded up).
    assert kv_blocks_needed([100, 200], [48, 48], 16, 16) == 11 + 17
    assert kv_blocks_needed([100], [44], 4, 16) == 10  # 148 tokens: 9.25 blocks, rounded up
    assert kv_blocks_needed([], [], 16, 16) == 0


def test_a_kv_cache_too_small_for_the_largest_b_is_an_error_naming_the_size_to_pass():
    info = SimpleNamespace(num_kv_blocks=100, kv_block_size=16, max_draft_tokens=16, kv_bytes_per_block=2**20)
    prompts = {"branchy": [200] * 16, "free": [40] * 16}
    # branchy, 16 x (200 + 48 + 16) = 16 x 17 blocks = 272 > 100; 272 MiB = 0.266 GiB, rounded up.
    with pytest.raises(KvBudgetError, match=r"branchy at B=16 may hold 272 KV blocks.*--kv-cache-gb 0.27 "):
        check_kv_budget(info, prompts, 16, 48)
    assert "the most B=4 requests may hold at once, none shared: 68 (branchy)" in check_kv_budget(info, prompts, 4, 48)
    # spread: each request its own length, 40…900 tokens: 16 + 20 + 23 + 28 + 33 + 44 + 55 + 70 blocks.
    large = SimpleNamespace(**{**vars(info), "num_kv_blocks": 1000})
    assert check_kv_budget(large, {"spread": [200] * 8}, 8, 900).endswith(": 289 (spread)")


def test_the_branchy_workload_repeats_one_context_with_different_continuations():
    for index in range(3):
        (message,) = workload_messages("branchy", index)
        assert "in the same style" in message["content"]
    assert workload_messages("branchy", 0) != workload_messages("branchy", 1)


def test_shapes_default_to_chains_alone():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).shapes == ("chain",)
    assert parser.parse_args(["--shapes", "tree,chain"]).shapes == ("tree", "chain")
    with pytest.raises(SystemExit):
        parser.parse_args(["--shapes", "chain,bush"])
    assert parser.parse_args(["--batch-sizes", "1,16", "--repeats", "3"]).batch_sizes == (1, 16)
    with pytest.raises(SystemExit):
        parser.parse_args(["--repeats", "0"])


def test_spread_lengths_are_the_seeds_scaled_so_the_longest_is_num_new_tokens():
    assert [max_new_tokens("spread", i, 900) for i in range(8)] == [40, 90, 150, 220, 300, 480, 650, 900]
    assert [max_new_tokens("spread", i, 90) for i in range(10)] == [4, 9, 15, 22, 30, 48, 65, 90, 4, 9]
    assert [max_new_tokens("spread", i, 48) for i in range(8)] == [2, 5, 8, 12, 16, 26, 35, 48]
    assert max_new_tokens("spread", 0, 10) == 1  # 40 * 10 / 900 rounds to 0: at least one token
    assert {max_new_tokens(kind, i, 48) for kind in ("copy", "branchy", "free") for i in range(9)} == {48}


def test_spread_asks_the_copy_branchy_and_free_prompts_in_turn():
    for i in range(6):
        kind = ("copy", "branchy", "free")[i % 3]
        assert workload_messages("spread", i) == workload_messages(kind, i)
    assert workload_messages("spread", 0) != workload_messages("spread", 1)


def test_workloads_are_checked_by_name():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--workloads", "branchy,spread"]).workloads == ("branchy", "spread")
    with pytest.raises(SystemExit):
        parser.parse_args(["--workloads", "branchy,sprad"])


def test_a_spread_is_the_median_and_range_of_the_repeats():
    spread = Spread.of([12.0, 10.0, 30.0])
    assert (spread.median, spread.low, spread.high, spread.num_repeats) == (12.0, 10.0, 30.0, 3)
    assert Spread.of([1.0, 2.0, 4.0, 10.0]).median == 3.0  # an even count: the middle two's mean
    assert spread.text() == "12.0 (10.0–30.0)"
    assert Spread.of([1.234]).text(2, "x") == "1.23x"  # one repeat: no range to show
    with pytest.raises(ValueError):
        Spread.of([])


def test_ratios_pair_repeat_r_with_repeat_r():
    ratio = paired_ratio([20.0, 30.0, 12.0], [10.0, 15.0, 12.0])
    assert (ratio.median, ratio.low, ratio.high) == (2.0, 1.0, 2.0)  # unpaired extremes: 12/15 to 30/10
    assert paired_ratio([1.0, 2.0], [1.0]) is None
    assert paired_ratio([1.0], [0.0]) is None
    assert paired_ratio([], []) is None


@pytest.mark.parametrize(
    ("values", "reference", "verdict"),
    [
        ([8.0, 9.0, 9.5], [10.0, 11.0, 12.0], True),  # ranges apart
        ([8.0, 9.0, 10.5], [10.0, 11.0, 12.0], False),  # overlapping: within the noise
        ([8.0, 9.0, 10.0], [10.0, 11.0, 12.0], False),  # touching is not below
        ([12.0, 13.0], [10.0, 11.0], False),  # above
        ([8.0], [10.0, 11.0], None),  # one repeat: no spread
        ([8.0, 9.0], [10.0], None),
    ],
)
def test_below_by_more_than_noise_means_the_ranges_do_not_overlap(values, reference, verdict):
    assert is_below_beyond_noise(values, reference) is verdict


def bench_spec(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    model = write_tiny_model(tmp_path / "tiny.gguf", TinyModelSpec(context_length=4096))
    return subprocess.run(
        [
            sys.executable, "-m", "clients.cli", "bench", "spec", "--model", str(model), "--policies", "goodput",
            "--shapes", "chain,tree", "--batch-sizes", "2", "--num-new-tokens", "20", "--threads", "1",
            "--kv-cache-gb", "0.01", "--out", str(tmp_path / "spec"), "--log", str(tmp_path / "log"), *flags,
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def run_bench(tmp_path, *flags: str) -> tuple[dict, str]:
    done = bench_spec(tmp_path, *flags)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads((tmp_path / "spec.json").read_text()), done.stdout


@pytest.mark.e2e
def test_repeats_of_both_shapes_take_turns_end_to_end(tmp_path):
    result, stdout = run_bench(tmp_path, "--workloads", "branchy,spread", "--batch-sizes", "2,16", "--repeats", "2")
    order = [(r["batch_size"], r["repeat"], r["workload"], r["shape"]) for r in result["runs"]]
    assert order == [
        (b, repeat, workload, shape)
        for b in (2, 16)
        for repeat in (0, 1)
        for workload in ("branchy", "spread")
        for shape in ("chain", "tree")
    ]
    for r in result["runs"]:
        assert r["tokens"] == r["expected_tokens"]  # EOS ignored: exact lengths
        assert r["num_preemptions"] == 0
    spread = {r["batch_size"]: r["expected_tokens"] for r in result["runs"] if r["workload"] == "spread"}
    # The seeds' 40…900 tokens scaled to 20: 1, 2, 3, 5, 7, 11, 14, 20; B = 2 takes the first two, B = 16 all twice.
    assert spread == {2: 1 + 2, 16: 2 * (1 + 2 + 3 + 5 + 7 + 11 + 14 + 20)}
    comparisons = result["tree_vs_chain"]
    assert [(q["workload"], q["batch_size"]) for q in comparisons] == [
        ("branchy", 2),
        ("spread", 2),
        ("branchy", 16),
        ("spread", 16),
    ]
    assert all(q["tokens_per_s_ratio"]["num_repeats"] == 2 for q in comparisons)
    assert all(q["is_tree_below_chain_beyond_noise"] in (True, False) for q in comparisons)
    configs = {(c["policy"], c["workload"], c["batch_size"]) for c in result["configs"]}
    assert configs == {(p, w, b) for p in ("goodput", "goodput+tree") for w in ("branchy", "spread") for b in (2, 16)}
    assert "trees below chains by more than noise:" in stdout


@pytest.mark.e2e
def test_a_kv_cache_too_small_stops_the_run_before_it_measures(tmp_path):
    done = bench_spec(tmp_path, "--workloads", "branchy", "--batch-sizes", "1,16", "--kv-cache-gb", "0.001")
    assert done.returncode == 2
    assert "branchy at B=16 may hold" in done.stderr and "--kv-cache-gb" in done.stderr
    assert "repeat 1" not in done.stdout and not (tmp_path / "spec.json").exists()


@pytest.mark.e2e
@pytest.mark.skipif(
    not os.environ.get("SWARMSERVE_BENCH_LLAMA_SERVER"),
    reason="set SWARMSERVE_BENCH_LLAMA_SERVER to a llama-server (../shared/anchors/llama-cpp.sh prints one)",
)
def test_llama_cpp_takes_its_turn_after_our_shapes_on_the_same_requests(tmp_path):
    flags = ("--workloads", "branchy,copy", "--batch-sizes", "1,2", "--repeats", "2")
    # No host-memory prompt cache (llama.cpp restores evicted prompts from it, sometimes): a slot
    # caches only the last prompt it ran, so only priming right before a measurement finds them all.
    llama = ("--llama-server", os.environ["SWARMSERVE_BENCH_LLAMA_SERVER"], "--llama-args=--cache-ram 0")
    result, stdout = run_bench(tmp_path, *flags, *llama)
    order = [(r["batch_size"], r["repeat"], r["workload"], r["engine"], r["shape"]) for r in result["runs"]]
    assert order == [
        (b, repeat, workload, engine, shape)
        for b in (1, 2)
        for repeat in (0, 1)
        for workload in ("branchy", "copy")
        for engine, shape in (("swarmserve", "chain"), ("swarmserve", "tree"), ("llama.cpp", "plain"))
    ]
    for ours, theirs in zip(result["runs"][::3], result["runs"][2::3]):
        assert theirs["engine"] == "llama.cpp"
        assert theirs["tokens"] == theirs["expected_tokens"] == ours["tokens"]  # EOS ignored, exact lengths
        assert theirs["prompt_tokens"] == ours["prompt_tokens"]  # both render the GGUF's chat template alike
        # Primed: every measured prompt comes from a prompt cache, in both engines (a warm-up, or the
        # other workload, would have taken the llama.cpp slot over).
        for run in (ours, theirs):
            assert sum(run["cached_tokens"]) >= 0.9 * sum(run["prompt_tokens"]), run
    assert result["machine"]["llama_server_version"]
    assert "over llama.cpp" in stdout and "largest difference for one request 0" in stdout
