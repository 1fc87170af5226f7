"""What a draft tree could gain over a chain: the drafter replayed over real greedy output, beside
two ceilings that no drafter proposing continuations of its context can pass.

    python -m executor_svc.tools.draft_replay [--workloads branchy,copy] [--requests 3]
        [--num-new-tokens 200] [--budgets 8,16]

`bench spec` measures trees against chains end to end, where the machine's noise (±10% a run)
hides a few percent and the goodput policy's budgets mix in. This asks the drafter's part alone,
exactly: the embedded model writes `bench spec`'s requests of each workload greedily (no
speculation; the same chat messages), then each request's verify steps are replayed with its
true continuation known. A verify step of a draft that matches the output for `a` tokens emits
a + 1 tokens, and the next step drafts from the context that leaves. For each draft budget k:

- **chain**: `Drafter.propose(k)`; accepted = the draft's prefix equal to the output.
- **tree**: `Drafter.propose_tree(k)`; accepted = its longest root path equal to the output.
  Both keep one index per request, appended to as the engine does, and the tree's node
  calibration learns from every verified tree (`observe_tree`).
- **best occurrence**: the best k-token continuation after *any* earlier occurrence of *any*
  suffix of the context (one token long or more): what a tree would accept if one of its
  branches were always the history's right continuation, whatever its size. No tree whose
  branches follow occurrences (ours, SuffixDecoding's) accepts more.
- **any path**: the longest run of the output, at most k deep, in which every token followed the
  two tokens before it somewhere earlier in the context (or in the path so far): a tree of
  unbounded breadth over every bigram's followers, which switches occurrences at will.

Printed per request and budget: verify steps and accepted tokens per step of each, and each
one's steps over the chain's (fewer steps: more tokens per verify). Where the ceilings sit close
to the chain, no tree shape or scoring can pay on that output: the misses are tokens the
context never held. Greedy output of one model, so the same on every machine.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Sequence

from executor_svc.config import DEFAULT_MAX_NGRAM
from executor_svc.sampling.drafter import Drafter, DraftTree

ANY_PATH_MIN_NGRAM = 2  # a one-token context is followed by nearly everything: no bound at all


def accepted_by_chain(draft: Sequence[int], output: Sequence[int]) -> int:
    """Draft tokens a verify step keeps: the longest prefix of the draft equal to the output."""
    return sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(draft, output)))


def kept_path(tree: DraftTree, output: Sequence[int]) -> list[int]:
    """The nodes of the tree's longest root path equal to the output, root side first (a parent
    precedes its children)."""
    path_of = {-1: []}  # node -> its path, for nodes whose path equals the output
    for node, (token_id, parent) in enumerate(zip(tree.token_ids, tree.parent_indexes)):
        path = path_of.get(parent)
        if path is not None and len(path) < len(output) and output[len(path)] == token_id:
            path_of[node] = path + [node]
    return max(path_of.values(), key=len)


def best_occurrence(context: Sequence[int], output: Sequence[int], depth: int) -> int:
    """The most output tokens the `depth` tokens after any earlier occurrence of any suffix of
    `context` (its last token at least) match."""
    best = 0
    last = len(context) - 1
    for end in range(last):  # an occurrence of the suffix ending at `end`, continued from end + 1
        if context[end] == context[last]:
            best = max(best, accepted_by_chain(context[end + 1 : end + 1 + depth], output))
    return best


def any_path(context: Sequence[int], output: Sequence[int], depth: int, min_ngram: int = ANY_PATH_MIN_NGRAM) -> int:
    """The longest run of the output, at most `depth`, whose every token followed its preceding
    `min_ngram` tokens somewhere earlier in the context extended by the run so far."""
    history = list(context)
    accepted = 0
    while accepted < min(depth, len(output)):
        if output[accepted] not in _followers(history, min_ngram):
            break
        history.append(output[accepted])
        accepted += 1
    return accepted


def _followers(history: Sequence[int], n: int) -> set[int]:
    """Tokens that followed an earlier occurrence of the history's last n tokens."""
    if len(history) < n:
        return set()
    suffix = list(history[-n:])
    return {
        history[end + 1] for end in range(n - 1, len(history) - 1) if list(history[end - n + 1 : end + 1]) == suffix
    }


class DrafterReplay:
    """The real drafter as the engine runs it for one request: one index over the prompt and
    every emitted token, its trees' node calibration learning from each verified tree."""

    def __init__(self, prompt: Sequence[int], shape: str, budget: int, max_ngram: int) -> None:
        self.shape, self.budget = shape, budget
        self.drafter = Drafter(max_draft_tokens=budget, max_ngram=max_ngram)
        self.drafter.add_request("r", prompt)

    def accepted(self, context: Sequence[int], rest: Sequence[int]) -> int:
        if self.shape == "chain":
            return accepted_by_chain(self.drafter.propose("r", self.budget), rest)
        tree = self.drafter.propose_tree("r", self.budget)
        kept = kept_path(tree, rest)
        self.drafter.observe_tree(tree, kept)
        return len(kept)

    def emitted(self, token_ids: Sequence[int]) -> None:
        self.drafter.append("r", token_ids)


class Ceiling:
    """A bound (best_occurrence or any_path) as a replay strategy: it drafts from the context alone."""

    def __init__(self, bound: Callable[[Sequence[int], Sequence[int], int], int], budget: int) -> None:
        self.bound, self.budget = bound, budget

    def accepted(self, context: Sequence[int], rest: Sequence[int]) -> int:
        return self.bound(context, rest, self.budget)

    def emitted(self, token_ids: Sequence[int]) -> None:
        pass


def replay(prompt: Sequence[int], output: Sequence[int], strategy: DrafterReplay | Ceiling) -> int:
    """Verify steps to emit `output` after `prompt` when each step keeps the strategy's accepted
    drafts and adds one token."""
    emitted = steps = 0
    while emitted < len(output):
        context = list(prompt) + list(output[:emitted])
        accepted = strategy.accepted(context, output[emitted:])
        step_tokens = output[emitted : emitted + accepted + 1]
        strategy.emitted(step_tokens)
        emitted += len(step_tokens)
        steps += 1
    return steps


STRATEGIES = ("chain", "tree", "best occurrence", "any path")


def replay_all(prompt: Sequence[int], output: Sequence[int], budget: int, max_ngram: int) -> dict[str, int]:
    """Verify steps of each strategy at this draft budget."""
    strategies = {
        "chain": DrafterReplay(prompt, "chain", budget, max_ngram),
        "tree": DrafterReplay(prompt, "tree", budget, max_ngram),
        "best occurrence": Ceiling(best_occurrence, budget),
        "any path": Ceiling(any_path, budget),
    }
    return {name: replay(prompt, output, strategy) for name, strategy in strategies.items()}


def greedy_outputs(model: str, workloads: list[str], num_requests: int, num_new_tokens: int) -> dict[str, tuple]:
    """name -> (prompt ids, greedy output ids) for `bench spec`'s first requests of each workload."""
    from clients.bench.speculation import workload_messages
    from executor_svc.engine.engine import Engine, EngineConfig, ScheduledRequest, StepRequest
    from executor_svc.engine.request_state import NewRequest
    from scheduler_svc.chat_template import render_chat_template
    from service_common.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=model, kv_cache_bytes=512 << 20))
    info = engine.tokenizer
    outputs = {}
    for kind in workloads:
        for index in range(num_requests):
            text = render_chat_template(
                info.chat_template,
                workload_messages(kind, index),
                add_generation_prompt=True,
                bos_token=info.bos_token,
                eos_token=info.eos_token,
            )
            prompt = info.tokenizer.encode(text, add_special_tokens=False).ids
            name = f"{kind}[{index}]"
            request = NewRequest(name, prompt, SamplingParams(), num_new_tokens, ignore_eos=True)
            step = StepRequest(scheduled=[ScheduledRequest(name, len(prompt))], new_requests=[request])
            output: list[int] = []
            while True:
                (result,) = engine.step(step).outputs
                output += result.new_token_ids
                if result.finish_reason is not None:
                    break
                step = StepRequest(scheduled=[ScheduledRequest(name, 1)])
            outputs[name] = (prompt, output)
    return outputs


def report(outputs: dict[str, tuple], budgets: list[int], max_ngram: int) -> list[str]:
    lines = [
        f"verify steps (accepted tokens per step) to emit each greedy output; drafter max_ngram {max_ngram}",
        f"{'request':>12} {'k':>3} | "
        + " | ".join(f"{s:>18}" for s in STRATEGIES)
        + " | tree, best occ., any path ÷ chain",
    ]
    for name, (prompt, output) in outputs.items():
        for budget in budgets:
            steps = replay_all(prompt, output, budget, max_ngram)
            cells = [f"{steps[s]:>7} ({(len(output) - steps[s]) / steps[s]:5.2f})    " for s in STRATEGIES]
            ratios = ", ".join(f"{steps['chain'] / steps[s]:.2f}x" for s in STRATEGIES[1:])
            lines.append(f"{name:>12} {budget:>3} | " + " | ".join(cells) + f" | {ratios}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--workloads", default="branchy,copy", help="of bench spec's copy,branchy,free")
    p.add_argument("--requests", type=int, default=3, help="requests of each workload (bench spec's first ones)")
    p.add_argument("--num-new-tokens", type=int, default=200)
    p.add_argument("--budgets", default="8,16", help="draft budgets (chain tokens, tree nodes)")
    p.add_argument("--max-ngram", type=int, default=DEFAULT_MAX_NGRAM, help="the drafter's (default %(default)s)")
    args = p.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    outputs = greedy_outputs(args.model, workloads, args.requests, args.num_new_tokens)
    print("\n".join(report(outputs, [int(b) for b in args.budgets.split(",")], args.max_ngram)))


if __name__ == "__main__":
    main()
