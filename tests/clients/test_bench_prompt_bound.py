"""`swarmserve bench vs`'s prompt-bound rows (issue 23): the workloads are the same every run,
the report's arithmetic is right, and a tiny run goes end to end against real services, with
a second swarmserve standing in for vLLM (started by `--vllm-command`, as vLLM would be)."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import sys
from dataclasses import replace

import pytest

from clients.bench import prompt_bound, prompt_bound_report, workloads
from clients.bench.openai_stream import StreamedRequest
from clients.bench.prompt_bound import Endpoint, advantage, percentile, prefill_summary, swarm_summary
from clients.bench.services import PeerServer
from clients.bench.vllm_server import vllm_command
from clients.bench.vs_llama_cpp import REPO_ROOT, format_report
from clients.cli import parse_args
from clients.serve import free_port
from tests.support.stack import ROOT
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_model

# -- workloads ------------------------------------------------------------------------------


def test_random_prompts_are_fixed_by_their_arguments_and_avoid_special_tokens():
    make = lambda n, **kw: workloads.random_prompts(n, 1024, vocab_size=49152, excluded_ids=range(17), **kw)  # noqa: E731
    rows = {n: make(n) for n in (1, 8, 16)}
    assert rows == {n: make(n) for n in (1, 8, 16)}  # the same ids every run
    for n, prompts in rows.items():
        assert len(prompts) == n and all(len(p) == 1024 for p in prompts)
        assert all(17 <= i < 49152 for p in prompts for i in p)
    every = [tuple(p) for prompts in rows.values() for p in prompts]
    assert len(set(every)) == 1 + 8 + 16  # no row repeats another's prompts (no prefix-cache hits)
    warm_up = make(1, purpose="warm-up")
    assert warm_up != rows[1] and warm_up == make(1, purpose="warm-up")
    assert make(1, seed=1) != rows[1]
    with pytest.raises(ValueError, match="no token ids left"):
        workloads.random_prompts(1, 4, vocab_size=3, excluded_ids=[0, 1, 2])


def _sources():
    return workloads.load_source_files(REPO_ROOT)


def test_swarm_scripts_are_fixed_and_spread_like_the_seeds():
    config = workloads.SwarmConfig()
    scripts = workloads.agent_scripts(config, _sources())
    assert scripts == workloads.agent_scripts(config, _sources())
    assert workloads.swarm_system_prompt() == workloads.swarm_system_prompt()
    assert len(scripts) == 8 and all(len(s.turns) == 3 for s in scripts)
    assert len({s.session_id for s in scripts}) == 8
    for turn in range(3):  # every turn has the seeds' eight lengths, halved: 20 … 450
        assert sorted(s.turns[turn].max_tokens for s in scripts) == [20, 45, 75, 110, 150, 240, 325, 450]
    for script in scripts:
        assert all(0.3 <= t.pause_s <= 2.0 for t in script.turns[:-1]) and script.turns[-1].pause_s == 0
    assert len({t.pause_s for s in scripts for t in s.turns[:-1]}) > 8  # drawn, not one constant
    assert workloads.agent_scripts(replace(config, seed=1), _sources()) != scripts


def test_each_turn_adds_the_next_piece_of_the_agents_file():
    path, text = _sources()[2]
    script = workloads.agent_scripts(workloads.SwarmConfig(), _sources())[2]
    chunks = workloads.file_chunks(text, 3, workloads.CHARS_PER_CHUNK)
    assert text.startswith("".join(chunks))  # consecutive pages from the top
    assert all(len(c) >= workloads.CHARS_PER_CHUNK for c in chunks)
    for turn, chunk in zip(script.turns, chunks):
        assert f'read_file({{"path": "{path}", "start_line": ' in turn.user_content
        assert chunk in turn.user_content
    assert script.turns[0].user_content.startswith("Your task: ")
    assert '"start_line": 1,' in script.turns[0].user_content
    assert f'"start_line": {chunks[0].count(chr(10)) + 1},' in script.turns[1].user_content


def test_a_workload_source_that_changed_too_much_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="short.py has 11 characters, too few for 3 chunks of 100"):
        workloads.file_chunks("x = 1\ny = 2", 3, 100, path="short.py")
    with pytest.raises(FileNotFoundError, match="workload source gone.py is not in"):
        workloads.load_source_files(tmp_path, ["gone.py"])


def test_the_system_prompt_lists_every_tool_as_a_json_schema():
    prompt = workloads.swarm_system_prompt()
    schemas = [json.loads(line) for line in workloads.tool_descriptions().splitlines()]
    assert [s["name"] for s in schemas] == [name for name, _, _ in workloads.TOOLS]
    assert all(s["parameters"]["required"] for s in schemas)
    assert workloads.tool_descriptions() in prompt
    assert 5000 < len(prompt) < 7000  # ~1.5k tokens of the embedded model (measured: see the bench's report)


def test_fingerprints_name_the_contents():
    scripts = workloads.agent_scripts(workloads.SwarmConfig(), _sources())
    a = workloads.workload_fingerprint("system", *scripts)
    assert a == workloads.workload_fingerprint("system", *scripts)
    assert a != workloads.workload_fingerprint("system.", *scripts)
    changed = replace(scripts[0], turns=(replace(scripts[0].turns[0], pause_s=0.31), *scripts[0].turns[1:]))
    assert a != workloads.workload_fingerprint("system", changed, *scripts[1:])
    assert workloads.workload_fingerprint([[1, 2]]) != workloads.workload_fingerprint([[2, 1]])


# -- the report's arithmetic ----------------------------------------------------------------


def test_percentiles_interpolate_between_ranks():
    assert percentile([], 50) is None
    assert percentile([3.0], 90) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # the mean of the middle two
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0


def _request(sent, first, end, tokens, prompt=1024, cached=None):
    return StreamedRequest(sent, first, end, tokens, prompt, cached, "x")


def test_ttft_and_tpot_of_one_request():
    r = _request(10.0, 10.5, 13.04, 128)
    assert r.ttft_s == 0.5
    assert r.tpot_s == pytest.approx(2.54 / 127)
    assert _request(10.0, 10.5, 10.5, 1).tpot_s is None  # one token: no time between tokens
    assert _request(10.0, None, 11.0, 0).ttft_s is None


def test_prefill_summary_rates_the_whole_wave():
    t0 = 100.0
    requests = [_request(t0, t0 + 1.0, t0 + 3.0, 128), _request(t0, t0 + 2.0, t0 + 4.0, 128)]
    summary = prefill_summary(requests, t0)
    assert summary["output_tokens"] == 256
    assert summary["duration_s"] == 4.0
    assert summary["output_tokens_per_s"] == 64.0
    assert summary["ttft_median_s"] == 1.5
    assert summary["ttft_p90_s"] == pytest.approx(1.9)
    assert summary["tpot_median_s"] == pytest.approx(2.0 / 127)
    assert summary["prompt_tokens"] == [1024]
    assert [r["sent_s"] for r in summary["requests"]] == [0.0, 0.0]


def test_a_prefill_row_over_waves_takes_the_median_wave_and_every_request():
    """Three waves of two requests: out tok/s is the middle wave's rate (not the mean, which the
    slow wave would drag), TTFT and TPOT pool all six requests, each request keeps its wave."""
    waves = [
        prefill_summary([_request(0.0, 0.5, 2.5, 128), _request(0.0, 0.7, 2.0, 128)], 0.0),  # 256 tok in 2.5 s
        prefill_summary([_request(10.0, 10.6, 14.0, 128), _request(10.0, 11.0, 12.0, 128)], 10.0),  # in 4.0 s
        prefill_summary([_request(20.0, 20.4, 22.0, 128), _request(20.0, 20.5, 22.0, 128)], 20.0),  # in 2.0 s
    ]
    summary = prompt_bound.prefill_waves_summary(waves)
    assert summary["output_tokens_per_s_by_wave"] == [256 / 2.5, 64.0, 128.0]
    assert summary["output_tokens_per_s"] == 256 / 2.5
    assert summary["ttft_median_s"] == pytest.approx(0.55)  # of 0.4, 0.5, 0.5, 0.6, 0.7, 1.0
    assert summary["ttft_p90_s"] == pytest.approx(0.85)
    assert summary["output_tokens"] == 768 and summary["num_requests"] == 6 and summary["waves"] == 3
    assert summary["duration_s"] == pytest.approx(8.5)
    assert summary["prompt_tokens"] == [1024]
    assert [r["wave"] for r in summary["requests"]] == [0, 0, 1, 1, 2, 2]


def test_swarm_summary_takes_the_makespan_and_ttft_over_all_turns():
    t0 = 0.0
    turns = [
        prompt_bound.SwarmTurn(agent, turn, _request(start, start + ttft, start + 5, 20, 2000, 1500))
        for agent, turn, start, ttft in [(0, 0, 0.0, 1.0), (0, 1, 6.0, 0.5), (1, 0, 0.0, 3.0), (1, 1, 9.0, 2.0)]
    ]
    summary = swarm_summary(turns, t0, 14.0)
    assert summary["makespan_s"] == 14.0
    assert summary["ttft_p50_s"] == 1.5
    assert summary["ttft_p90_s"] == pytest.approx(2.7)
    assert (summary["output_tokens"], summary["prompt_tokens"], summary["cached_tokens"]) == (80, 8000, 6000)
    assert summary["output_tokens_per_s"] == pytest.approx(80 / 14)
    assert [(t["agent"], t["turn"]) for t in summary["turns"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert summary["ttft_p50_s_by_turn"] == [2.0, 1.25]  # turn 0: 1.0 and 3.0; turn 1: 0.5 and 2.0
    turns[0] = prompt_bound.SwarmTurn(0, 0, _request(0.0, 1.0, 5.0, 20, None, None))
    summary = swarm_summary(turns, t0, 14.0)
    assert summary["prompt_tokens"] is None and summary["cached_tokens"] is None  # not reported by every turn


def test_advantage_is_above_one_when_swarmserve_is_better():
    assert advantage(60.0, 30.0, higher_is_better=True) == 2.0  # tok/s: ours / theirs
    assert advantage(0.5, 2.0, higher_is_better=False) == 4.0  # a time: theirs / ours
    assert advantage(None, 2.0, higher_is_better=False) is None
    assert advantage(1.0, 0.0, higher_is_better=True) is None


def _prefill_row(n, engines):
    row = {"kind": "prefill", "streams": n, "prompt_tokens": 1024, "max_tokens": 128, "fingerprint": "abc"}
    row["engines"] = {
        engine: {
            "output_tokens_per_s": tps,
            "ttft_median_s": ttft,
            "tpot_median_s": tpot,
            "load_avg_1m": 1.0,
            "prompt_tokens": [1024],
            "output_tokens": n * 128,
        }
        for engine, (tps, ttft, tpot) in engines.items()
    }
    row["errors"] = {}
    row["advantage"] = prompt_bound.row_advantages(row, prompt_bound.PREFILL_METRICS)
    return row


def test_rows_compare_swarmserve_with_each_peer_that_ran():
    row = _prefill_row(
        8, {"llama.cpp": (17.0, 26.0, 0.25), "vllm": (100.0, 1.5, 0.06), "swarmserve": (40.0, 3.0, 0.15)}
    )
    assert row["advantage"]["llama.cpp"]["output_tokens_per_s"] == pytest.approx(40 / 17)
    assert row["advantage"]["vllm"]["ttft_median_s"] == pytest.approx(0.5)
    assert row["advantage"]["vllm"]["tpot_median_s"] == pytest.approx(0.4)
    lines = prompt_bound_report.format_rows(
        [row], prompt_bound.PREFILL_METRICS, "title", prompt_bound_report.prefill_label
    )
    cells = lambda line: [c.strip() for c in line.split("|")]  # noqa: E731
    assert cells(next(line for line in lines if "vLLM-CPU" in line and "vs" not in line)) == [
        "N=8 1024+128", "vLLM-CPU", "100.0", "1.50 s", "60 ms", "1.0",
    ]  # fmt: skip
    assert cells(next(line for line in lines if "vs vLLM-CPU" in line)) == [
        "", "vs vLLM-CPU", "0.40x", "0.50x", "0.40x", "",
    ]  # fmt: skip
    assert cells(next(line for line in lines if "vs llama.cpp" in line))[2] == "2.35x"
    failed = _prefill_row(16, {"vllm": (120.0, 1.7, 0.09), "swarmserve": (50.0, 3.0, 0.2)})
    failed["engines"]["llama.cpp"] = None
    failed["advantage"] = prompt_bound.row_advantages(failed, prompt_bound.PREFILL_METRICS)
    assert set(failed["advantage"]) == {"vllm"}
    lines = prompt_bound_report.format_rows(
        [failed], prompt_bound.PREFILL_METRICS, "t", prompt_bound_report.prefill_label
    )
    assert cells(next(line for line in lines if "llama.cpp" in line)) == [
        "N=16 1024+128", "llama.cpp", "–", "–", "–", "–",
    ]  # fmt: skip


def test_an_engine_that_counted_another_prompt_is_noted():
    row = _prefill_row(1, {"llama.cpp": (15.0, 5.0, 0.02), "swarmserve": (30.0, 3.0, 0.01)})
    assert prompt_bound_report.workload_checks([row]) == []
    row["engines"]["llama.cpp"]["prompt_tokens"] = [1025]
    row["engines"]["swarmserve"]["output_tokens"] = 100
    assert prompt_bound_report.workload_checks([row]) == [
        "  NOTE: llama.cpp counted [1025] prompt tokens in N=1 1024+128 (sent 1024 ids)",
        "  NOTE: swarmserve generated 100 tokens in N=1 1024+128, not 128",
    ]


def test_endpoint_routes():
    endpoint = Endpoint("vllm", "http://127.0.0.1:8000/", "smollm2-135m-instruct")
    assert endpoint.completions_url == "http://127.0.0.1:8000/v1/completions"
    assert endpoint.chat_url == "http://127.0.0.1:8000/v1/chat/completions"


# -- flags ----------------------------------------------------------------------------------


def test_workload_and_peer_flags():
    args = parse_args(["bench", "vs"])
    assert args.workloads == ("streams", "copy", "prefill", "swarm")
    assert (args.vllm_server, args.vllm_command, args.vllm_model) == (None, None, "smollm2-135m-instruct")
    assert (args.prefill_streams, args.prefill_tokens, args.prefill_max_tokens) == ((1, 8, 16), 1024, 128)
    assert args.prefill_waves == 3
    assert (args.agents, args.turns, args.kv_cache_gb) == (8, 3, 2.0)
    args = parse_args(["bench", "vs", "--workloads", "swarm,prefill", "--vllm-command", "serve {port} --x"])
    assert args.workloads == ("prefill", "swarm")  # in the order they run
    assert vllm_command(args.vllm_command, 8000) == ["serve", "8000", "--x"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--workloads", "prefil"],
        ["--workloads", ""],
        ["--vllm-command", "vllm serve"],  # no {port}
        ["--vllm-server", "http://x:1", "--vllm-command", "serve {port}"],
        ["--prefill-max-tokens", "1"],  # TPOT needs two tokens
        ["--prefill-waves", "0"],
    ],
)
def test_bad_workload_and_peer_flags_are_usage_errors(argv):
    with pytest.raises(SystemExit) as exited:
        parse_args(["bench", "vs", *argv])
    assert exited.value.code == 2


def process_states(pids: list[int]) -> list[str]:
    """Each process's state letter from /proc (T: stopped)."""
    return [open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] for pid in pids]


def test_a_peer_started_for_the_run_is_stopped_except_while_it_is_measured():
    """vLLM's worker busy-waits on a core while idle, so a peer started for the run is kept stopped
    (its whole process group, children too) between its turns and resumed for them."""

    async def main():
        process = await asyncio.create_subprocess_exec(
            "sh", "-c", "sleep 30 & wait", start_new_session=True, stdout=subprocess.DEVNULL
        )
        try:
            await asyncio.sleep(0.3)
            child = int(open(f"/proc/{process.pid}/task/{process.pid}/children").read().split()[0])
            server = PeerServer("http://127.0.0.1:1", process, group=True)
            server.pause()
            await asyncio.sleep(0.1)
            assert process_states([process.pid, child]) == ["T", "T"]
            async with server.running():
                await asyncio.sleep(0.1)
                assert "T" not in process_states([process.pid, child])
            await asyncio.sleep(0.1)
            assert process_states([process.pid, child]) == ["T", "T"]
            server.resume()
        finally:
            os.killpg(process.pid, 9)
            await process.wait()

    asyncio.run(main())


# -- end to end -----------------------------------------------------------------------------


@pytest.mark.e2e
def test_prompt_bound_rows_end_to_end_against_a_peer_started_by_command(tmp_path):
    """Tiny sizes on a tiny model; the "vLLM" peer is a second swarmserve, started by
    --vllm-command in its own process group and stopped with it."""
    # The tiny tokenizer spends about a token a byte: the real ~6k-character system prompt needs the room.
    model = write_tiny_model(tmp_path / "tiny.gguf", TinyModelSpec(context_length=16384))
    peer = shlex.join(
        [
            sys.executable, "-m", "clients.cli", "serve", "--model", str(model), "--kv-cache-gb", "0.05",
            "--no-calibration", "--executor-listen", f"127.0.0.1:{free_port()}",
            "--scheduler-listen", f"127.0.0.1:{free_port()}",
        ]
    ) + " --http-listen 127.0.0.1:{port}"  # fmt: skip
    out = tmp_path / "vs.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "clients.cli", "bench", "vs", "--model", str(model), "--workloads", "prefill,swarm",
            "--prefill-streams", "1,3", "--prefill-tokens", "40", "--prefill-max-tokens", "5", "--prefill-waves", "2",
            "--agents", "2",
            "--turns", "2", "--swarm-chunk-chars", "300", "--swarm-output-scale", "0.02", "--threads", "1",
            "--kv-cache-gb", "0.05", "--vllm-command", peer, "--vllm-model", "tiny", "--json", str(out),
            "--log", str(tmp_path / "log"),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["kind"], r.get("streams")) for r in result["rows"]] == [("prefill", 1), ("prefill", 3), ("swarm", None)]
    for row in result["rows"][:2]:
        assert set(row["engines"]) == {"vllm", "swarmserve"} and row["errors"] == {} and row["waves"] == 2
        for summary in row["engines"].values():
            assert summary["output_tokens"] == 2 * row["streams"] * 5  # EOS ignored: exact lengths, two waves
            assert summary["prompt_tokens"] == [40]  # the ids went in as sent
            assert summary["ttft_median_s"] > 0 and summary["tpot_median_s"] > 0
            assert [r["wave"] for r in summary["requests"]] == [0] * row["streams"] + [1] * row["streams"]
        assert set(row["advantage"]) == {"vllm"}
    swarm = result["rows"][2]
    for summary in swarm["engines"].values():
        assert len(summary["turns"]) == 2 * 2
        assert summary["output_tokens"] == sum(t["output_tokens"] for t in summary["turns"]) > 0
        assert summary["makespan_s"] > 0 and summary["ttft_p90_s"] >= summary["ttft_p50_s"] > 0
    # The system prompt is shared and each agent's first turn is its second's prefix: the cache serves them.
    assert swarm["engines"]["swarmserve"]["cached_tokens"] > swarm["workload_tokens"]["system_prompt"]
    assert "vs vLLM-CPU" in done.stdout and "makespan" in done.stdout
    assert format_report(result) in done.stdout
    assert not os.path.exists(str(out) + ".partial")


def test_the_report_of_a_run_cut_short_still_formats():
    """The JSON is rewritten after every row: a partial result (no end-of-run fields) formats."""
    result = {
        "model": "/m/SmolLM2.gguf",
        "gguf_bytes": 100 * 2**20,
        "threads": 2,
        "cpu_count": 2,
        "executor_args": [],
        "scheduler_args": [],
        "llama_server_version": "version: 1 (abc)",
        "rows": [_prefill_row(1, {"llama.cpp": (15.0, 5.0, 0.02), "swarmserve": (30.0, 3.0, 0.01)})],
    }
    report = format_report(result)
    assert "N=1 1024+128" in report and "vs llama.cpp" in report and "abc" in report


@pytest.mark.e2e
@pytest.mark.skipif(
    not os.environ.get("SWARMSERVE_BENCH_LLAMA_SERVER"),
    reason="set SWARMSERVE_BENCH_LLAMA_SERVER to a llama-server (and SWARMSERVE_BENCH_VLLM_COMMAND to a vLLM "
    "command with {port}) to run the prompt-bound rows against the real peers",
)
def test_prompt_bound_rows_against_the_real_peers(tmp_path):
    """The peers take the same token ids and count them as sent, and stream exact lengths:
    llama.cpp always, vLLM when its command is given (../shared/anchors/vllm-cpu.sh)."""
    vllm = os.environ.get("SWARMSERVE_BENCH_VLLM_COMMAND")
    out = tmp_path / "vs.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "clients.cli", "bench", "vs", "--workloads", "prefill,swarm",
            "--prefill-streams", "2", "--prefill-tokens", "64", "--prefill-max-tokens", "4", "--agents", "2",
            "--turns", "2", "--swarm-chunk-chars", "300", "--swarm-output-scale", "0.05",
            "--llama-server", os.environ["SWARMSERVE_BENCH_LLAMA_SERVER"], "--json", str(out),
            "--log", str(tmp_path / "log"), *(["--vllm-command", vllm] if vllm else []),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    prefill, swarm = json.loads(out.read_text())["rows"]
    engines = {"llama.cpp", "swarmserve", *(["vllm"] if vllm else [])}
    assert set(prefill["engines"]) == set(swarm["engines"]) == engines
    for engine in engines:
        assert prefill["errors"] == swarm["errors"] == {}
        assert prefill["engines"][engine]["prompt_tokens"] == [64], engine
        assert prefill["engines"][engine]["output_tokens"] == 2 * 4, engine
        turns = swarm["engines"][engine]["turns"]
        assert [t["output_tokens"] for t in turns] == [2, 11, 4, 15], engine  # 40, 220, 90, 300 x 0.05


def test_an_engine_that_cannot_be_reached_fails_its_cells_not_the_run():
    closed = lambda: Endpoint("vllm", f"http://127.0.0.1:{free_port()}", "m")  # noqa: E731 - nothing listens there
    peers = prompt_bound.Peers(vllm=closed())
    row = asyncio.run(
        prompt_bound.prefill_row(peers, replace(closed(), engine="swarmserve"), [[[5, 6, 7]], [[8, 9, 10]]], [5], 4)
    )
    assert row["engines"] == {"vllm": None, "swarmserve": None}
    assert set(row["errors"]) == {"vllm", "swarmserve"} and "ConnectError" in row["errors"]["vllm"]
    assert row["advantage"] == {}
    assert "vLLM-CPU failed in prefill: ConnectError" in "\n".join(prompt_bound_report.format_prompt_bound([row]))


def test_a_swarm_row_reports_the_median_ttft_of_each_turn():
    """Turn 1 (every agent queued behind the others' prompts) and later turns (one prompt at long
    context) are different problems: the report splits the overall p50 by turn, per engine."""
    turns = [
        prompt_bound.SwarmTurn(agent, turn, _request(start, start + ttft, start + 5, 20, 2000, 1500))
        for agent, turn, start, ttft in [(0, 0, 0.0, 4.0), (1, 0, 0.0, 8.0), (0, 1, 9.0, 2.5), (1, 1, 13.0, 3.5)]
    ]
    ours = swarm_summary(turns, 0.0, 18.0)
    theirs = {**ours, "ttft_p50_s_by_turn": [6.0, None]}  # a peer whose second turns never streamed a token
    row = {"kind": "swarm", "engines": {"vllm": theirs, "swarmserve": ours, "llama.cpp": None}}
    assert prompt_bound_report.ttft_by_turn_lines(row) == [
        "  TTFT p50 by turn, vLLM-CPU: 6.00 / – s",
        "  TTFT p50 by turn, swarmserve: 6.00 / 3.00 s",
    ]
