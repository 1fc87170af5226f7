"""The prompt-bound workloads of `swarmserve bench vs`, generated the same way every
run so that runs on different days, branches and engines measure the same thing.

- **prefill**: N requests of `num_tokens` random token ids each (seeded, special tokens
  left out), sent to every engine as the same ids through /v1/completions.
- **swarm**: coding agents sharing a system prompt with tool descriptions (~1.5k tokens);
  each agent pages through one source file of this repository, ~1k tokens a turn, and
  answers each turn with a length from the seeds' spread (their 40…900 tokens, halved:
  20…450); between turns it "runs a tool" for a pause drawn from 0.3…2 s.

Pure functions of their arguments (the only I/O is `load_source_files`), so a test can
check that the same seed gives the same workload. `workload_fingerprint` names a
workload's contents, so two runs' reports say whether they measured the same prompts.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

# The seeds' eight agents (a tool-call check … a long refactor plan) wrote 40…900 tokens;
# the swarm halved them.
SEED_OUTPUT_LENGTHS = (40, 90, 150, 220, 300, 480, 650, 900)
SWARM_OUTPUT_SCALE = 0.5

# One file per agent, paged through a chunk per turn. Large, long-lived files of this
# repository; a file that no longer holds its chunks is an error (the workload would change
# without saying so), to be fixed by picking another here.
SWARM_SOURCE_FILES = (
    "scheduler_svc/planner.py",
    "scheduler_svc/step_loop.py",
    "scheduler_svc/cost_model.py",
    "executor_svc/engine/engine.py",
    "executor_svc/kv/kv_manager.py",
    "executor_svc/sampling/drafter.py",
    "executor_svc/weights/tokenizer.py",
    "clients/serve.py",
)

# Python source of this repository tokenizes at ~3.6 characters a token with the embedded
# model's tokenizer: 3,300 characters and the tool-result header came to 846…1,314 tokens a
# turn over SWARM_SOURCE_FILES, 993 on average (the system prompt: 1,513).
CHARS_PER_CHUNK = 3300

AGENT_TASKS = (
    "Find why a request can wait forever when the KV cache is full, and fix it.",
    "Add a test for the step loop's handling of an executor restart.",
    "The cost model's fit drifts after a long idle period: find out why.",
    "Profile a decode step and list the three largest costs with evidence.",
    "Explain how prefix-cached blocks are shared and when they are evicted.",
    "Review the drafter for off-by-one errors at the end of a request.",
    "Make the tokenizer's error for an unknown token name the token.",
    "Document the supervisor's restart policy in the module docstring.",
)

TOOLS = (
    ("read_file", "Read a file of the repository, optionally a range of lines. Returns the text with line numbers.",
     {"path": ("string", "path relative to the repository root"),
      "start_line": ("integer", "first line to return, 1-based (default 1)"),
      "num_lines": ("integer", "how many lines to return (default: 120)")}),
    ("write_file", "Create or overwrite a file with the given content. Parent folders are created.",
     {"path": ("string", "path relative to the repository root"), "content": ("string", "the whole new content")}),
    ("edit_file", "Replace one exact occurrence of old_text with new_text in a file. Fails when old_text is missing or appears more than once.",
     {"path": ("string", "path relative to the repository root"), "old_text": ("string", "text to replace, exactly as in the file"),
      "new_text": ("string", "the replacement")}),
    ("grep", "Search the repository for a regular expression. Returns matching lines as path:line:text, at most 200.",
     {"pattern": ("string", "a Python regular expression"), "path": ("string", "folder or file to search (default: the root)"),
      "glob": ("string", "only files whose name matches this glob, e.g. *.py")}),
    ("list_dir", "List a folder's entries with their sizes; folders end with a slash.",
     {"path": ("string", "folder relative to the repository root"), "depth": ("integer", "levels to descend (default 1)")}),
    ("run_tests", "Run pytest on the given paths and return its summary and the first failures' tracebacks.",
     {"paths": ("array", "test files or folders"), "keyword": ("string", "only tests matching this -k expression"),
      "timeout_s": ("integer", "stop after this many seconds (default 600)")}),
    ("run_shell", "Run a shell command in the repository root and return its exit status, stdout and stderr (truncated to 20,000 characters).",
     {"command": ("string", "the command line"), "timeout_s": ("integer", "stop after this many seconds (default 120)")}),
    ("git_diff", "Show the working tree's changes against a revision, as a unified diff.",
     {"revision": ("string", "what to compare against (default HEAD)"), "paths": ("array", "limit the diff to these paths")}),
    ("git_log", "Show recent commits touching the given paths: hash, author, date, subject.",
     {"paths": ("array", "limit the log to these paths"), "max_count": ("integer", "how many commits (default 20)")}),
    ("ask_agent", "Send a question to another agent of the team and wait for its answer.",
     {"agent": ("string", "the other agent's name"), "question": ("string", "what to ask, with enough context to answer it")}),
    ("finish", "End your turn with a summary of what you changed and why.",
     {"summary": ("string", "what changed, which tests cover it, what is left")}),
)  # fmt: skip

HOUSE_RULES = (
    "Read the code before you change it; quote the lines you rely on.",
    "Prefer small, well-named functions; one idea per file.",
    "Every public function has a docstring that says why, not what.",
    "Tests use the real parts: real servers on loopback, the real model; no mocks standing in for them.",
    "Errors carry a message a person can act on, naming the field as the client spelled it.",
    "Greedy output must never change with batching, chunking, speculation or prefix hits.",
    "Configuration is a frozen dataclass validated once, built from flags; no environment globals.",
    "Use structured logs with bound request ids; no print in library code.",
    "Keep the hot path free of allocations you can hoist out of the loop.",
    "The scheduler never imports executor code or torch.",
    "Commit small steps with messages that say what changed and why.",
    "When a test is flaky, find the race; never add a sleep or a retry to hide it.",
)


def tool_descriptions() -> str:
    """The tools as an agent framework lists them in the system prompt: one JSON schema each."""
    schemas = [
        {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": kind, "description": text} for p, (kind, text) in params.items()},
                "required": [next(iter(params))],
            },
        }
        for name, description, params in TOOLS
    ]
    return "\n".join(json.dumps(schema) for schema in schemas)


def swarm_system_prompt() -> str:
    """The system prompt every agent shares: role, house rules, tools (~1.5k tokens)."""
    rules = "\n".join(f"{i + 1}. {rule}" for i, rule in enumerate(HOUSE_RULES))
    return (
        "You are a coding agent in a team of eight agents working on one repository, swarmserve: an LLM "
        "serving engine made of a stateless gRPC scheduler and a stateful executor that owns the model, "
        "the paged KV cache and the kernels. Each agent has its own task; agents may ask each other "
        "questions. Work in small steps: read, then change, then test.\n\n"
        f"House rules:\n{rules}\n\n"
        "You can call these tools. To call one, answer with a JSON object "
        '{"tool": NAME, "arguments": {...}} and nothing else; the result comes back in the next message.\n'
        f"{tool_descriptions()}\n\n"
        "When you have finished the task, call finish."
    )


# -- prefill: random token ids -------------------------------------------------------------


def random_prompts(
    num_prompts: int,
    num_tokens: int,
    *,
    vocab_size: int,
    excluded_ids: Sequence[int] = (),
    seed: int = 0,
    purpose: str = "measure",
) -> list[list[int]]:
    """`num_prompts` prompts of `num_tokens` token ids drawn uniformly from the vocabulary
    minus `excluded_ids` (its special tokens), the same for the same arguments.

    The generator is seeded by (seed, purpose, num_prompts, num_tokens), so each row of a run
    (N=1, 8, 16) and its warm-up (`purpose="warm-up"`) have their own prompts: no engine's
    prefix cache finds one row's prompts in another's.
    """
    if num_prompts <= 0 or num_tokens <= 0:
        raise ValueError(f"num_prompts and num_tokens must be positive, got {num_prompts} and {num_tokens}")
    excluded = set(excluded_ids)
    candidates = [i for i in range(vocab_size) if i not in excluded]
    if not candidates:
        raise ValueError(f"no token ids left to draw from (vocab_size {vocab_size}, {len(excluded)} excluded)")
    rng = random.Random(f"prefill:{seed}:{purpose}:{num_prompts}:{num_tokens}")
    return [[rng.choice(candidates) for _ in range(num_tokens)] for _ in range(num_prompts)]


# -- swarm: agents, turns, files -----------------------------------------------------------


@dataclass(frozen=True)
class SwarmConfig:
    num_agents: int = 8
    num_turns: int = 3
    chars_per_chunk: int = CHARS_PER_CHUNK  # the file text one turn adds (~1k tokens)
    output_scale: float = SWARM_OUTPUT_SCALE  # times the seeds' output lengths
    min_pause_s: float = 0.3  # a tool's run time between turns, uniform in [min, max]
    max_pause_s: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_agents <= 0 or self.num_turns <= 0 or self.chars_per_chunk <= 0:
            raise ValueError("num_agents, num_turns and chars_per_chunk must be positive")
        if self.output_scale <= 0:
            raise ValueError(f"output_scale must be positive, got {self.output_scale}")
        if not 0 <= self.min_pause_s <= self.max_pause_s:
            raise ValueError(f"need 0 <= min_pause_s <= max_pause_s, got {self.min_pause_s} and {self.max_pause_s}")


@dataclass(frozen=True)
class AgentTurn:
    user_content: str  # what the agent's framework appends before this turn's request
    max_tokens: int  # the answer's length (EOS ignored, so exact)
    pause_s: float  # the tool's run time after this turn's answer (0 after the last)


@dataclass(frozen=True)
class AgentScript:
    agent: int
    session_id: str
    turns: tuple[AgentTurn, ...]


def file_chunks(text: str, num_chunks: int, chars_per_chunk: int, *, path: str = "") -> list[str]:
    """The first `num_chunks` pieces of `text`, each whole lines adding up to at least
    `chars_per_chunk` characters (a paged read_file)."""
    lines = text.splitlines(keepends=True)
    chunks, start = [], 0
    for _ in range(num_chunks):
        end, size = start, 0
        while size < chars_per_chunk and end < len(lines):
            size += len(lines[end])
            end += 1
        if size < chars_per_chunk:
            raise ValueError(
                f"workload source {path or '<text>'} has {len(text)} characters, too few for {num_chunks} chunks "
                f"of {chars_per_chunk}: pick a larger file in SWARM_SOURCE_FILES"
            )
        chunks.append("".join(lines[start:end]))
        start = end
    return chunks


def output_length(agent: int, turn: int, scale: float) -> int:
    """The seeds' spread over agents and turns: agent a's turn t takes the (a + 3t)-th length,
    so every turn has all eight lengths among eight agents."""
    return max(1, round(SEED_OUTPUT_LENGTHS[(agent + 3 * turn) % len(SEED_OUTPUT_LENGTHS)] * scale))


def agent_scripts(config: SwarmConfig, sources: Sequence[tuple[str, str]]) -> list[AgentScript]:
    """Each agent's turns. `sources` are (path, text) pairs; agent a reads sources[a % len]."""
    if not sources:
        raise ValueError("the swarm needs at least one source file")
    scripts = []
    for agent in range(config.num_agents):
        path, text = sources[agent % len(sources)]
        chunks = file_chunks(text, config.num_turns, config.chars_per_chunk, path=path)
        rng = random.Random(f"swarm:{config.seed}:{agent}")
        turns, line = [], 1
        for turn, chunk in enumerate(chunks):
            num_lines = chunk.count("\n")
            tool_output = (
                f'Result of read_file({{"path": "{path}", "start_line": {line}, "num_lines": {num_lines}}}):\n'
                f"```python\n{chunk}```"
            )
            line += num_lines
            content = (
                f"Your task: {AGENT_TASKS[agent % len(AGENT_TASKS)]}\n\n{tool_output}" if turn == 0 else tool_output
            )
            is_last = turn + 1 == config.num_turns
            pause = 0.0 if is_last else round(rng.uniform(config.min_pause_s, config.max_pause_s), 3)
            turns.append(AgentTurn(content, output_length(agent, turn, config.output_scale), pause))
        scripts.append(AgentScript(agent, f"bench-agent-{agent}", tuple(turns)))
    return scripts


def load_source_files(root: Path, paths: Sequence[str] = SWARM_SOURCE_FILES) -> list[tuple[str, str]]:
    """(path, text) of each of `paths` under `root`, with a clear error for a missing one."""
    sources = []
    for path in paths:
        file = root / path
        if not file.is_file():
            raise FileNotFoundError(f"workload source {path} is not in {root}: pick another in SWARM_SOURCE_FILES")
        sources.append((path, file.read_text()))
    return sources


def workload_fingerprint(*parts) -> str:
    """A short hash of a workload's contents (prompts, lengths, pauses): equal between two
    runs exactly when they sent the same requests."""
    blob = json.dumps([asdict(p) if hasattr(p, "__dataclass_fields__") else p for p in parts], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]
