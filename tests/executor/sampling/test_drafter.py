"""The model-free drafter: hand-worked proposals, incremental == brute force (hypothesis),
the swarm index (sharing, eviction, release), cost per token at 32k tokens, and the
"copy a file with one change" workload it exists for."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.sampling.drafter import Drafter, RequestIndex, SwarmIndex

# ------------------------------------------------------------------ reference


def brute_force_match(token_ids: list[int], max_ngram: int, min_ngram: int) -> tuple[int, int] | None:
    """(n, start) straight from the rule: the longest suffix n-gram that occurred earlier
    with a token after it, its most recent such occurrence; the draft is token_ids[start:]."""
    num_tokens = len(token_ids)
    for n in range(min(max_ngram, num_tokens - 1), min_ngram - 1, -1):
        suffix = token_ids[num_tokens - n :]
        for end in range(num_tokens - 1, n - 1, -1):  # occurrence token_ids[end - n : end]
            if token_ids[end - n : end] == suffix:
                return n, end
    return None


def brute_force_propose(token_ids: list[int], max_tokens: int, max_ngram: int = 8, min_ngram: int = 1) -> list[int]:
    match = brute_force_match(token_ids, max_ngram, min_ngram)
    return [] if match is None else token_ids[match[1] : match[1] + max_tokens]


def letters(text: str) -> list[int]:
    return [ord(c) for c in text.replace(" ", "")]


def as_letters(token_ids: list[int]) -> str:
    return " ".join(chr(t) for t in token_ids)


# ------------------------------------------------------------- hand-worked


@pytest.mark.parametrize(
    "history,max_ngram,min_ngram,max_tokens,expected",
    [
        # repetition; the continuation runs into the suffix and stops at the end of the history
        ("a b c a b c a b", 8, 1, 10, "c a b"),
        # no earlier occurrence of any suffix n-gram
        ("a b c d e", 8, 1, 10, ""),
        ("", 8, 1, 10, ""),
        ("a", 8, 1, 10, ""),
        # most recent occurrence of the same n-gram: [a] is followed by x, then by y
        ("a x a y a", 8, 1, 10, "y a"),
        # the longer match wins over a more recent shorter one (the module docstring's example)
        ("a b c d b c e a b c", 3, 1, 4, "d b c e"),
        # ... unless max_ngram caps the longer one: then [b c] at 4..5 is the most recent
        ("a b c d b c e a b c", 2, 1, 4, "e a b c"),
        # max_tokens caps the draft
        ("p q r s t u p", 8, 1, 3, "q r s"),
        ("p q r s t u p", 8, 1, 0, ""),
        # min_ngram: a 1-gram match is not enough ...
        ("a x a y a", 8, 2, 10, ""),
        # ... a 2-gram is
        ("a x y z a x", 8, 2, 10, "y z a x"),
        # every token the same: the longest match is max_ngram long, right before the suffix
        ("a a a a a a", 3, 1, 10, "a"),
    ],
)
def test_hand_worked_proposals(history, max_ngram, min_ngram, max_tokens, expected):
    index = RequestIndex(letters(history), max_ngram=max_ngram, min_ngram=min_ngram)
    assert as_letters(index.propose(max_tokens)) == expected
    assert index.propose(max_tokens) == brute_force_propose(letters(history), max_tokens, max_ngram, min_ngram)


def test_module_docstring_second_example():
    index = RequestIndex(letters("a b c a b c a b"), max_ngram=3)
    match = index.match()
    assert (match.num_matched_tokens, match.start) == (3, 5)
    assert as_letters(index.propose(4)) == "c a b"


def test_proposal_follows_the_history_as_it_grows():
    index = RequestIndex(letters("x a b c d y"))
    assert index.propose(3) == []
    index.extend(letters("a"))
    assert as_letters(index.propose(3)) == "b c d"
    index.extend(letters("b c"))
    assert as_letters(index.propose(3)) == "d y a"
    index.extend(letters("z"))  # a token never seen before
    assert index.propose(3) == []
    assert index.num_tokens == 10


def test_invalid_arguments_are_refused():
    with pytest.raises(ValueError):
        RequestIndex(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError):
        RequestIndex(min_ngram=0)
    with pytest.raises(ValueError):
        RequestIndex([-1])
    with pytest.raises(TypeError):
        RequestIndex([1.5])
    with pytest.raises(ValueError):
        Drafter(max_draft_tokens=-1)


# ------------------------------------------------- incremental == brute force


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    alphabet_size=st.integers(1, 5),
    max_ngram=st.integers(1, 6),
)
def test_incremental_index_proposes_what_brute_force_proposes(data, alphabet_size, max_ngram):
    min_ngram = data.draw(st.integers(1, max_ngram), label="min_ngram")
    chunks = data.draw(st.lists(st.lists(st.integers(0, alphabet_size - 1), max_size=6), max_size=25), label="chunks")
    index = RequestIndex(chunks[0] if chunks else (), max_ngram=max_ngram, min_ngram=min_ngram)
    history = list(chunks[0]) if chunks else []
    for chunk in chunks[1:] + [[]]:
        max_tokens = data.draw(st.integers(0, 12), label="max_tokens")
        expected = brute_force_propose(history, max_tokens, max_ngram, min_ngram)
        assert index.propose(max_tokens) == expected
        match = index.match()
        assert (match.num_draft_tokens(max_tokens) if match else 0) == len(expected)
        index.extend(chunk)
        history += chunk
    assert index.num_tokens == len(history)


# ------------------------------------------------------------------- drafter


def test_drafter_proposes_from_the_request_and_caps_at_max_draft_tokens():
    drafter = Drafter(max_draft_tokens=4)
    drafter.add_request("r", list(range(20)) + [0])
    assert drafter.propose("r", 100) == [1, 2, 3, 4]
    assert drafter.propose("r", 2) == [1, 2]
    assert drafter.num_draftable("r") == 4
    drafter.append("r", [1, 2, 3, 99])
    assert drafter.propose("r", 100) == []
    assert drafter.num_draftable("r") == 0
    with pytest.raises(ValueError):
        drafter.add_request("r", [1])
    drafter.release("r")
    assert not drafter.has_request("r")
    with pytest.raises(KeyError):
        drafter.propose("r", 4)


# ---------------------------------------------------------------- swarm index


def test_a_request_copying_another_ones_output_drafts_from_it():
    drafter = Drafter(use_swarm_index=True)
    drafter.add_request("a", [1, 2, 3])
    drafter.add_request("b", [1, 2, 4])
    written = list(range(100, 140))
    drafter.append("a", written)
    assert drafter.propose("b", 8) == []
    drafter.append("b", written[:3])
    assert drafter.propose("b", 8) == written[3:11]
    assert drafter.num_draftable("b") == 16
    # Without the swarm index b has nothing to go on.
    alone = Drafter()
    alone.add_request("b", [1, 2, 4])
    alone.append("b", written[:3])
    assert alone.propose("b", 8) == []


def test_prompts_are_not_in_the_swarm_index():
    drafter = Drafter(use_swarm_index=True)
    drafter.add_request("a", [50, 51, 52, 53, 54])
    drafter.add_request("b", [9])
    drafter.append("b", [50, 51])
    assert drafter.propose("b", 4) == []


def test_the_longer_match_wins_and_a_tie_goes_to_the_own_index():
    drafter = Drafter(use_swarm_index=True)
    drafter.add_request("a", [0])
    drafter.append("a", [1, 2, 3, 7, 7])  # other's output: [2 3] -> 7
    drafter.add_request("b", [1, 2, 3, 8, 8, 2, 3])  # own: [1 2 3] -> 8 (n=3), recent [2 3] -> 8
    assert drafter.propose("b", 2) == [8, 8]  # tie on [2 3] would also say own; here own is longer
    drafter.add_request("c", [9, 2, 3, 5, 5, 9])  # own: [9] -> 2 3 5 (n=1)
    drafter.append("c", [2, 3])  # own [9 2 3] n=3 -> 5; swarm [2 3] n=2 -> 7
    assert drafter.propose("c", 2) == [5, 5]
    drafter.add_request("d", [4, 2, 3, 5, 5, 4])
    drafter.append("d", [1, 2, 3])  # swarm [1 2 3] n=3 beats own [2 3] n=2
    assert drafter.propose("d", 2) == [7, 7]
    drafter.add_request("e", [6, 2, 3, 5, 5, 6])
    drafter.append("e", [0, 2, 3])  # own [2 3] n=2 ties swarm [2 3]: own wins
    assert drafter.propose("e", 2) == [5, 5]


def test_the_swarm_index_never_hands_a_request_its_own_output():
    swarm = SwarmIndex()
    swarm.append("a", [1, 2, 3, 1, 2])
    assert swarm.match([1, 2], exclude_request_id="a") is None
    match = swarm.match([1, 2], exclude_request_id="b")
    assert list(match.draft(5)) == [3, 1, 2]
    swarm.finish("a")  # once finished, its output is anyone's, a later request with the same id too
    assert swarm.match([1, 2], exclude_request_id="a") is not None


def test_released_requests_output_stays_for_the_others():
    drafter = Drafter(use_swarm_index=True)
    drafter.add_request("a", [0])
    drafter.append("a", [10, 11, 12, 13])
    drafter.release("a")
    drafter.add_request("b", [10])
    assert drafter.propose("b", 3) == [11, 12, 13]


def test_eviction_bounds_memory_and_never_proposes_evicted_output():
    drafter = Drafter(use_swarm_index=True, max_swarm_tokens=100)
    swarm = drafter.swarm_index
    drafter.add_request("old", [0])
    drafter.append("old", list(range(1000, 1060)))
    drafter.release("old")
    drafter.add_request("new", [0])
    drafter.append("new", list(range(2000, 2060)))  # 120 > 100 tokens: "old" goes
    assert swarm.num_tokens == 60 and swarm.num_documents == 1
    drafter.add_request("reader", [5])
    drafter.append("reader", [1000, 1001])
    assert drafter.propose("reader", 4) == []
    drafter.append("reader", [2000, 2001])
    assert drafter.propose("reader", 4) == [2002, 2003, 2004, 2005]
    # A running request's own output can be evicted too; its later output is indexed afresh.
    drafter.append("new", list(range(3000, 3050)))  # one document of 110 tokens > 100: evicted whole
    assert swarm.num_tokens == 4 and swarm.num_documents == 1  # only reader's output is left
    drafter.append("new", [4000, 4001, 4002])
    drafter.append("reader", [4000])
    assert drafter.propose("reader", 4) == [4001, 4002]


def test_a_node_whose_latest_occurrence_was_evicted_is_skipped():
    """Eviction goes by request age, occurrences by time: an older request's later output
    can be a trie node's latest occurrence while a younger request's earlier one survives.
    Evicting the older request must not leave the node pointing at its freed output."""
    swarm = SwarmIndex(max_num_tokens=10)
    swarm.append("a", [1])
    swarm.append("b", [5, 1, 2])  # [1] -> 2
    swarm.append("a", [7, 1, 3])  # [1] -> 3, the latest
    swarm.append("c", [8, 8, 8, 8])  # 11 tokens: "a" goes
    match = swarm.match([9, 1])
    assert match is None or match.draft(4) == [2]  # never [3]
    assert swarm.match([5, 1]).draft(4) == [2]


def test_churn_through_many_requests_keeps_the_index_bounded():
    rng = random.Random(5)
    swarm = SwarmIndex(max_num_tokens=500)
    for i in range(300):
        swarm.append(f"r{i}", [rng.randrange(30) for _ in range(rng.randrange(1, 60))])
        swarm.finish(f"r{i}")
        assert swarm.num_tokens <= 500
        assert swarm.num_nodes <= 8 * swarm.num_tokens
    # White box: freed trie nodes are reused, so the node table itself stays bounded too.
    assert len(swarm._trie._num_locations) <= 8 * (500 + 60) + 1


@settings(max_examples=150, deadline=None)
@given(
    operations=st.lists(
        st.tuples(
            st.sampled_from(["add", "append", "append", "append", "release"]),
            st.integers(0, 3),  # which request
            st.lists(st.integers(0, 3), max_size=5),  # tokens
        ),
        max_size=40,
    ),
    max_swarm_tokens=st.sampled_from([0, 6, 15, 10_000]),
    max_ngram=st.integers(1, 4),
)
def test_swarm_drafts_match_a_brute_force_swarm(operations, max_swarm_tokens, max_ngram):
    """Without eviction the drafter proposes exactly what brute force does; with eviction
    every proposal is either the own index's or a real continuation in live output."""
    drafter = Drafter(use_swarm_index=True, max_swarm_tokens=max_swarm_tokens, max_ngram=max_ngram)
    model = SwarmModel(max_swarm_tokens)
    generations = {}  # request slot -> request id, so a released slot comes back under a new id
    for kind, slot, token_ids in operations:
        request_id = f"r{slot}.{generations.get(slot, 0)}"
        if kind == "add" and request_id not in model.histories:
            drafter.add_request(request_id, token_ids)
            model.histories[request_id] = list(token_ids)
        elif kind == "append" and request_id in model.histories:
            drafter.append(request_id, token_ids)
            model.append(request_id, token_ids)
        elif kind == "release" and request_id in model.histories:
            drafter.release(request_id)
            model.release(request_id)
            generations[slot] = generations.get(slot, 0) + 1
        swarm = drafter.swarm_index
        assert swarm.num_tokens == sum(len(d.token_ids) for d in model.documents) <= max_swarm_tokens
        assert swarm.num_documents == len(model.documents)
        assert swarm.num_nodes <= max_ngram * swarm.num_tokens  # so an empty index holds no node
        for live_id in model.histories:
            proposed = drafter.propose(live_id, 6)
            assert drafter.num_draftable(live_id) == len(drafter.propose(live_id, drafter.max_draft_tokens))
            if not model.has_evicted:
                assert proposed == model.propose(live_id, 6, max_ngram)
            else:
                assert proposed == model.own_proposal(live_id, 6, max_ngram) or model.is_live_continuation(
                    live_id, proposed, 6, max_ngram
                )


@dataclass
class SwarmDocument:
    request_id: str | None  # None once finished
    token_ids: list[int] = field(default_factory=list)
    times: list[int] = field(default_factory=list)  # when each token was indexed


@dataclass
class SwarmModel:
    """The swarm policy written plainly: whole documents, oldest first, brute-force search."""

    max_tokens: int
    histories: dict[str, list[int]] = field(default_factory=dict)
    documents: list[SwarmDocument] = field(default_factory=list)  # oldest first
    clock: int = 0
    has_evicted: bool = False

    def append(self, request_id, token_ids):
        self.histories[request_id] += token_ids
        if not token_ids:
            return
        document = next((d for d in self.documents if d.request_id == request_id), None)
        if document is None:
            document = SwarmDocument(request_id)
            self.documents.append(document)
        for token_id in token_ids:
            document.token_ids.append(token_id)
            document.times.append(self.clock)
            self.clock += 1
        while sum(len(d.token_ids) for d in self.documents) > self.max_tokens:
            self.documents.pop(0)
            self.has_evicted = True

    def release(self, request_id):
        del self.histories[request_id]
        for document in self.documents:
            if document.request_id == request_id:
                document.request_id = None

    def own_proposal(self, request_id, max_tokens, max_ngram):
        return brute_force_propose(self.histories[request_id], max_tokens, max_ngram)

    def propose(self, request_id, max_tokens, max_ngram):
        history = self.histories[request_id]
        own = brute_force_match(history, max_ngram, 1)
        own_n = own[0] if own else 0
        for n in range(min(max_ngram, len(history)), 0, -1):
            occurrences = [
                (d.times[end], d, end)
                for d in self.documents
                for end in range(n, len(d.token_ids))
                if d.token_ids[end - n : end] == history[len(history) - n :]
            ]
            if occurrences:
                _, document, end = max(occurrences, key=lambda o: o[0])
                if document.request_id != request_id and n > own_n:
                    return document.token_ids[end : end + max_tokens]
                break
        return self.own_proposal(request_id, max_tokens, max_ngram)

    def is_live_continuation(self, request_id, proposed, max_tokens, max_ngram):
        history = self.histories[request_id]
        own = brute_force_match(history, max_ngram, 1)
        own_n = own[0] if own else 0
        return any(
            d.token_ids[end - n : end] == history[len(history) - n :]
            and d.token_ids[end : end + max_tokens] == proposed
            for d in self.documents
            if d.request_id != request_id
            for n in range(own_n + 1, max_ngram + 1)
            for end in range(n, len(d.token_ids))
        )


# --------------------------------------------------------------- determinism


def test_proposals_do_not_depend_on_the_hash_seed():
    script = (
        "import random\n"
        "from executor_svc.sampling.drafter import Drafter\n"
        "rng = random.Random(3)\n"
        "d = Drafter(use_swarm_index=True, max_swarm_tokens=300)\n"
        "out = []\n"
        "for i in range(6):\n"
        "    d.add_request(f'req-{i}', [rng.randrange(20) for _ in range(50)])\n"
        "for step in range(100):\n"
        "    for i in range(6):\n"
        "        d.append(f'req-{i}', [rng.randrange(20)])\n"
        "        out.append(d.propose(f'req-{i}', 5))\n"
        "print(out)\n"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1


# ------------------------------------------------------------------------ cost


def code_like_tokens(rng: random.Random, num_tokens: int) -> list[int]:
    """Lines of a few common tokens (indentation, newline) around rarer identifiers, with
    some lines copied from earlier: the repetition that makes deep trie paths."""
    token_ids: list[int] = []
    lines: list[list[int]] = []
    while len(token_ids) < num_tokens:
        if lines and rng.random() < 0.3:
            line = rng.choice(lines)
        else:
            line = [1] * rng.randrange(4) + [rng.randrange(2, 2000) for _ in range(rng.randrange(2, 10))] + [0]
            lines.append(line)
        token_ids += line
    return token_ids[:num_tokens]


def append_and_propose(index: RequestIndex, token_ids: list[int]) -> float:
    start = time.perf_counter()
    for token_id in token_ids:
        index.extend((token_id,))
        index.propose(16)
    return time.perf_counter() - start


def test_32k_history_builds_and_drafts_fast():
    rng = random.Random(0)
    token_ids = code_like_tokens(rng, 32 * 1024 + 1000)
    start = time.perf_counter()
    index = RequestIndex(token_ids[: 32 * 1024])
    append_and_propose(index, token_ids[32 * 1024 :])
    assert time.perf_counter() - start < 2.0
    assert index.num_nodes <= index.max_ngram * index.num_tokens


def test_cost_per_token_does_not_grow_with_the_history():
    """Trie lookups per (append + propose) are bounded by max_ngram, not by the history's
    length; and, loosely, a step at 32k tokens costs about what it costs at 4k."""

    class CountingDict(dict):
        num_lookups = 0

        def get(self, key, default=None):
            CountingDict.num_lookups += 1
            return super().get(key, default)

    rng = random.Random(1)
    token_ids = code_like_tokens(rng, 32 * 1024 + 2000)
    tail = token_ids[-2000:]

    index = RequestIndex(token_ids[: 32 * 1024])
    index._trie._child_ids = CountingDict(index._trie._child_ids)  # white box: count the lookups
    for token_id in tail[:1000]:
        CountingDict.num_lookups = 0
        index.extend((token_id,))
        index.propose(16)
        assert CountingDict.num_lookups <= 2 * index.max_ngram

    seconds = {
        num_tokens: min(append_and_propose(RequestIndex(token_ids[:num_tokens]), tail) for _ in range(3))
        for num_tokens in (4 * 1024, 32 * 1024)
    }
    assert seconds[32 * 1024] < 4 * seconds[4 * 1024] + 0.01  # a rescan would be ~8x


# --------------------------------------------------------------- the workload


def test_copying_a_file_with_one_change_is_drafted_almost_entirely():
    """An agent reads a 300-token file and writes it back with one token changed: after
    the first few output tokens, the previous step's draft predicts nearly every token,
    and greedy verification of 16-token drafts needs a handful of steps, not 300."""
    rng = random.Random(7)
    system = [rng.randrange(2, 2000) for _ in range(40)]
    file = code_like_tokens(rng, 300)
    instruction = [rng.randrange(2, 2000) for _ in range(20)]
    change_at = 150
    output = file[:change_at] + [5000] + file[change_at + 1 :]

    drafter = Drafter(max_draft_tokens=16)
    drafter.add_request("agent", system + file + instruction)
    is_predicted = []
    for token_id in output:
        draft = drafter.propose("agent", 16)
        is_predicted.append(bool(draft) and draft[0] == token_id)
        drafter.append("agent", [token_id])
    counted = [ok for i, ok in enumerate(is_predicted) if i >= 4 and not change_at <= i <= change_at + 8]
    assert sum(counted) / len(counted) > 0.9

    # The same output under greedy verification: keep drafts while they match, plus one token.
    drafter.add_request("verified", system + file + instruction)
    num_steps = num_emitted = 0
    while num_emitted < len(output):
        draft = drafter.propose("verified", 16)
        num_kept = 0
        expected = output[num_emitted : num_emitted + len(draft)]
        while num_kept < len(expected) and draft[num_kept] == expected[num_kept]:
            num_kept += 1
        emitted = output[num_emitted : num_emitted + num_kept + 1]
        drafter.append("verified", emitted)
        num_emitted += len(emitted)
        num_steps += 1
    assert num_steps < len(output) / 8
