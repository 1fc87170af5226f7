"""The model-free drafter: draft tokens from the longest recent suffix match.

Speculation needs a guess of the next few tokens that is often right and costs
next to nothing. Coding agents copy a lot from their context (files they read,
tool output, their own earlier edits), so the guess is: find the most recent
earlier place where the last few tokens occurred and propose what followed there
(prompt-lookup / suffix decoding). No model and no device, just an index over
each request's own tokens (prompt + output), and optionally a swarm-wide index
over every request's output, because agents in one swarm repeat each other.

The rule, exactly (`max_ngram >= n >= min_ngram`):
  1. take the longest n such that the last n tokens occurred earlier in the
     history with at least one token after them;
  2. of the occurrences of that n-gram take the most recent one;
  3. propose the tokens that followed it, at most `max_tokens`, ending at the
     current end of the history (a continuation may run into the suffix itself).

Worked example, max_ngram=3, max_tokens=4:

    position   0 1 2 3 4 5 6 7 8 9
    token      a b c d b c e a b c

    n=3: [a b c] occurred at 0..2, followed by d  -> the longest match
    (n=2: [b c] occurred more recently at 4..5, but a longer match wins)
    propose positions 3..6: [d b c e]

    position   0 1 2 3 4 5 6 7
    token      a b c a b c a b

    n=3: [c a b] occurred at 2..4 (and nowhere later but the suffix itself)
    propose positions 5..7: [c a b], which runs into the suffix and stops at the end

A draft *tree* bets on several continuations at once, for a context the history
followed in different ways (an agent rewriting one of several near-identical
functions). It starts from the occurrences of the history's longest match (n
tokens, n >= min_ngram; the most recent MAX_TREE_SOURCES of them) and follows
them: a node's candidate children are the tokens that followed the occurrences
that went on along the path down to it, each occurrence one vote, with an
estimated acceptance probability

    p(child) = votes(child) / votes(all children) * (1 - 2**-(n + depth))

where depth is the path's length: those occurrences matched n + depth tokens (a
one-token match is weak evidence, an eight-token one strong). That product is a node's
*evidence*; the drafter's NodeCalibration turns it into the chance the node is accepted
once its parent is, learned from the trees verification has kept and rejected (before
any, the evidence itself), and every p below is that calibrated chance. Following
occurrences keeps a branch in its place in the copied text, as a chain's slice
does: at the next point where the near-identical functions differ, a branch
copying the third one votes for the third one's tokens. Re-matching the last
max_ngram tokens instead forgets which function a branch copies once they fall
out of the window, and splits its votes over all of them (on the branchy copy
workload, simulated over the model's own greedy output: 3.27 accepted tokens per
16-node tree against 3.04 re-matching and 2.80 for a 16-token chain). An
occurrence never runs dry: one that reaches the end of the history goes on into
the path itself, as a chain's slice runs into the suffix. Where the swarm's output
matches the history longer than the request's own does, the tree follows no
occurrences: every node's children are then the followers of the longest match of
the history plus the path, counted by the tries below (the swarm's where it matches
longer), with n that match's length. A node's *path
probability* is the product of p down from the root: the chance that every token
to it is accepted. The tree grows greedily: of all candidates, add the one with
the highest path probability (a tie goes to the candidate found first; siblings
are found by count, a tie going to the most recent occurrence's follower), until
`max_nodes`. Its expected accepted tokens are the sum of its nodes' path
probabilities (`DraftTree.expected_num_accepted_tokens`), what a node budget buys.
The executor reports, with each step's result, the expected accepted tokens of the
first n nodes of the tree it would grow next (`Drafter.next_tree`), for every n: the
scheduler's goodput policy prices a node budget by it (scheduler_svc/draft_policy.py),
scaled by how well this request's trees have met the drafter's expectation.

When every context has one follower the tree is a chain, and it begins with the
chain of the rule above (the tree may go on where that chain stops at the end of
the history, because the path itself is matched too).

Worked tree example, max_ngram=3, max_nodes=4:

    position   0 1 2 3 4 5 6 7 8 9 10
    token      x a b c y a b d z a b

    n=2: [a b] occurred at 1..2 followed by c and at 5..6 followed by d
         ([z a b] nowhere earlier): votes {d: 1, c: 1}, p = 1/2 * 3/4 each

    node  token  parent  path p          occurrences followed -> children
    0     d      root    0.375           the one at 5..6 (the most recent first)
    1     c      root    0.375           the one at 1..2
    2     z      0       0.375 * 0.875   5..7 [a b d] -> {z: 1}
    3     y      1       0.375 * 0.875   1..3 [a b c] -> {y: 1}

The index is a trie of reversed contexts. Each position p (a token with tokens
before it) is filed under its context read backwards, t[p-1], t[p-2], ...,
t[p-max_ngram]: the node at depth n is the n-gram t[p-n:p], and it remembers the
latest position that followed it. Proposing walks the current suffix backwards
down the same trie; the deepest node reached is the longest match and its latest
position the most recent occurrence. Appending a token files one position and
proposing walks one path, each at most max_ngram dict lookups plus O(1) work per
level, whatever the history's length; the draft is a slice of the history.

Most contexts longer than a few tokens occur once, so a node that only one
position has reached stays a *lazy leaf*: its subtree is implied by that
position's own tokens, which a query compares in place, and it is expanded one
level when a second position arrives. Text that repeats costs at most max_ngram
nodes per token, fresh text one or two (code-like text: ~2 nodes and ~250 bytes a
token, 8 MB for a 32k-token request; measured at max_ngram 8, and 12, the default, has
1.19x the nodes there and 1.6x on text that repeats).

Follower counts live only on expanded nodes (a lazy leaf's one location is its
one follower): appending a token adds one count on each of at most max_ngram
nodes of its path, and at most max_ngram new (node, follower) entries, so memory
and time per appended token stay O(max_ngram) whatever the history (code-like
text, 32k tokens: ~65k counts on ~36k expanded nodes, ~2 counts a token), plus 8
bytes a token for the history's array copy that occurrences are searched in. Proposing a
tree of m nodes finds the root match's occurrences in one vectorised pass over the
history, then groups at most MAX_TREE_SOURCES of them per node: O(history) numpy
work once plus O(m * MAX_TREE_SOURCES); without occurrences to follow, it walks the
trie once per node: O(m * max_ngram) lookups, plus sorting each added node's
followers. Measured (Zen 4, a branchy history, next_tree then propose_tree at 16
nodes): 72 µs at 1.3k tokens, 99 at 8k, 152 at 32k, against 130-135 re-matching.
"""

from __future__ import annotations

import bisect
import heapq
import operator
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from executor_svc.config import DEFAULT_MAX_NGRAM

# A tree follows at most this many occurrences of the history's longest match (the most recent):
# enough for every near-identical block an agent's context holds, and a bound on the work per node.
MAX_TREE_SOURCES = 32
_ROOT_NODE_ID = 0
# Trie keys pack (node id, token id) into one int, and a location packs
# (document id, offset): both halves fit in 32 bits.
_ID_BITS = 32
_ID_MASK = (1 << _ID_BITS) - 1


def _as_token_ids(token_ids: Sequence[int]) -> list[int]:
    """A private copy of plain ints (numpy or torch scalars welcome) that fit a trie key."""
    copied = list(map(operator.index, token_ids))
    if copied and (min(copied) < 0 or max(copied) > _ID_MASK):
        raise ValueError(f"token ids must be in [0, 2**{_ID_BITS}), got {min(copied)}..{max(copied)}")
    return copied


def _check_ngram_range(max_ngram: int, min_ngram: int) -> None:
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")


class SuffixMatch(NamedTuple):
    """The longest recent suffix match: the draft is `token_ids[start:]`, capped."""

    num_matched_tokens: int  # n, the length of the matched suffix
    token_ids: Sequence[int]  # the history that holds the continuation; read, never kept
    start: int  # where the continuation begins in token_ids

    def draft(self, max_tokens: int) -> list[int]:
        return list(self.token_ids[self.start : self.start + max(max_tokens, 0)])

    def num_draft_tokens(self, max_tokens: int) -> int:
        """len(draft(max_tokens)) without copying."""
        return max(0, min(max_tokens, len(self.token_ids) - self.start))


class DraftTree(NamedTuple):
    """Draft nodes in the order they were added, so a parent precedes its children.

    Node i is token_ids[i]; its parent is parent_indexes[i], -1 for the root (the
    request's last token, which is not a node). A chain has parents -1, 0, 1, ...
    """

    token_ids: list[int]
    parent_indexes: list[int]
    path_probabilities: list[float]  # estimated chance that every token root..i is accepted
    # Each node's evidence before calibration: its votes' share times match_confidence, the
    # NodeCalibration key its verified outcome is filed under (empty for a hand-made tree).
    node_evidence: Sequence[float] = ()

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def expected_num_accepted_tokens(self) -> float:
        """Sum over nodes of P(path to it accepted): the accepted path's expected length."""
        return sum(self.path_probabilities)

    def first(self, num_nodes: int) -> DraftTree:
        """The first num_nodes nodes: a tree, since a parent precedes its children (for a tree
        grow_tree made, exactly what it grows with max_nodes=num_nodes)."""
        return DraftTree(
            self.token_ids[:num_nodes],
            self.parent_indexes[:num_nodes],
            self.path_probabilities[:num_nodes],
            self.node_evidence[:num_nodes],
        )

    def expected_num_accepted_tokens_by_nodes(self) -> list[float]:
        """Element n-1: the expected accepted tokens of this tree's first n nodes, n = 1 .. num_nodes.

        For a tree grow_tree made at a budget of N nodes, that is what a budget of n <= N buys:
        growth takes the likeliest candidate first, so path probabilities never rise in node
        order, the first n nodes are a tree (a parent precedes its children), and no n-node
        tree has a larger sum; and grow_tree with max_nodes=n adds exactly these n nodes.
        """
        curve, total = [], 0.0
        for probability in self.path_probabilities:
            total += probability
            curve.append(total)
        return curve

    @property
    def depth(self) -> int:
        """The deepest node's depth: the most tokens the tree can have accepted (0 when empty)."""
        return max(self.depths(), default=0)

    @property
    def num_leaves(self) -> int:
        """Nodes without children: the tree's branches (1 for a chain, 0 when empty)."""
        return self.num_nodes - len({parent for parent in self.parent_indexes if parent >= 0})

    def depths(self) -> list[int]:
        """Depth of each node, 1 for the root's children."""
        depths: list[int] = []
        for parent in self.parent_indexes:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def path(self, node_index: int) -> list[int]:
        """The tokens root..node_index."""
        token_ids = []
        while node_index >= 0:
            token_ids.append(self.token_ids[node_index])
            node_index = self.parent_indexes[node_index]
        return token_ids[::-1]

    def is_chain(self) -> bool:
        return self.parent_indexes == list(range(-1, self.num_nodes - 1))


class _WithPath:
    """The history followed by a tree path, read as one sequence (only len and
    indexing, which is all a trie walk needs), so nothing is copied."""

    def __init__(self, token_ids: Sequence[int], path_token_ids: list[int]) -> None:
        self._token_ids = token_ids
        self._path_token_ids = path_token_ids
        self._num_history_tokens = len(token_ids)

    def __len__(self) -> int:
        return self._num_history_tokens + len(self._path_token_ids)

    def __getitem__(self, index: int) -> int:
        if index < self._num_history_tokens:
            return self._token_ids[index]
        return self._path_token_ids[index - self._num_history_tokens]


class TreeSources(NamedTuple):
    """Where the history's longest match occurred before: the continuations a tree follows."""

    token_ids: Sequence[int]  # the history; read, never kept
    num_matched_tokens: int  # n, the longest match's length
    locations: list[int]  # each occurrence's follower position in token_ids, the most recent first


def match_confidence(num_matched_tokens: int) -> float:
    """How much a match of n tokens is believed: 1/2 for one token, ~1 for eight."""
    return 1.0 - 0.5**num_matched_tokens


class NodeCalibration:
    """What a node's evidence has turned out to be worth: the chance a node is accepted once its
    parent is, learned from verified trees, by bins of the evidence (votes' share times
    match_confidence).

    The evidence alone overstates a copy: the model leaves the copied text more often than
    "a 9-token match is all but certain" says, and a path multiplies that error at every node.
    On the branchy copy workload (the model's own greedy output, 16-node trees) nodes whose
    evidence said 0.9-1.0 were accepted 83-96% of the time, and whole paths estimated at 0.98
    were accepted 51% of the time, so a budget priced by the evidence bought deep branches
    that were rarely reached. A bin's estimate is its decayed accepted count over its decayed
    node count, with the evidence itself as a prior worth PRIOR_NODES nodes: before any
    verification it is the evidence, exactly. Trees are grown by the calibrated probabilities,
    so the expected accepted tokens the scheduler prices a node budget by are calibrated too.

    Worked example (decay 1): five nodes of evidence 0.98 were verified, three accepted. The
    0.95-0.99 bin then says (3 + 2 * 0.98) / (5 + 2) = 0.709 for evidence 0.98.
    """

    EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)  # bin i: evidence below EDGES[i]
    PRIOR_NODES = 2.0
    DECAY = 0.99  # per node filed in a bin: a bin remembers its last ~100 outcomes

    def __init__(self, decay: float = DECAY) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self._accepted = [0.0] * (len(self.EDGES) + 1)
        self._nodes = [0.0] * (len(self.EDGES) + 1)

    def __call__(self, evidence: float) -> float:
        """The calibrated chance that a node of this evidence is accepted, given its parent is."""
        b = bisect.bisect_right(self.EDGES, evidence)
        return (self._accepted[b] + self.PRIOR_NODES * evidence) / (self._nodes[b] + self.PRIOR_NODES)

    def totals(self) -> tuple[float, float]:
        """(nodes, accepted) filed so far over every bin, decayed."""
        return sum(self._nodes), sum(self._accepted)

    def observe(self, tree: DraftTree, kept_nodes: Sequence[int]) -> None:
        """File the outcome of every node of a verified tree whose parent was kept (the root's
        children always): accepted when it was kept too. Nodes under a rejected node say nothing."""
        kept = set(kept_nodes)
        for node, (parent, evidence) in enumerate(zip(tree.parent_indexes, tree.node_evidence)):
            if parent < 0 or parent in kept:
                b = bisect.bisect_right(self.EDGES, evidence)
                self._accepted[b] = self.decay * self._accepted[b] + (node in kept)
                self._nodes[b] = self.decay * self._nodes[b] + 1.0


def grow_tree(
    followers_of: Callable[[list[int]], tuple[int, list[tuple[int, int]]]],
    max_nodes: int,
    sources: TreeSources | None = None,
    calibrate: Callable[[float], float] | None = None,
) -> DraftTree:
    """Grow a draft tree greedily by path probability (see the module docstring).

    A node's children are voted by the `sources` occurrences followed down its path; without
    sources they come from followers_of(path): (n, [(token, count)]) for the history followed
    by `path`, the preferred follower first, n = 0 meaning no match. `calibrate` maps a
    node's evidence to the chance it is accepted once its parent is (NodeCalibration);
    None takes the evidence as that chance.
    """
    tree = DraftTree([], [], [], [])
    # (-path p, order found, parent, token, evidence, the occurrences it follows or None)
    candidates: list[tuple[float, int, int, int, float, list[int] | None]] = []
    num_found = 0

    def push(parent: int, parent_probability: float, evidence: float, token_id: int, locations: list[int] | None):
        nonlocal num_found
        probability = parent_probability * (calibrate(evidence) if calibrate is not None else evidence)
        heapq.heappush(candidates, (-probability, num_found, parent, token_id, evidence, locations))
        num_found += 1

    def add_followed(parent: int, parent_probability: float, path: list[int], locations: list[int]) -> None:
        """Children voted by the occurrences followed down `path` (each has a token after it:
        one at the history's end goes on into the path)."""
        sequence = _WithPath(sources.token_ids, path)
        voters: dict[int, list[int]] = {}  # token -> the occurrences it continues, most recent first
        for location in locations:
            voters.setdefault(sequence[location], []).append(location + 1)
        total = sum(map(len, voters.values()))
        confidence = match_confidence(sources.num_matched_tokens + len(path))
        ranked = sorted(voters.items(), key=lambda voted: -len(voted[1]))  # stable: a tie keeps the most recent first
        for token_id, next_locations in ranked[: max_nodes - tree.num_nodes]:
            push(parent, parent_probability, len(next_locations) / total * confidence, token_id, next_locations)

    def add_candidates(parent: int, parent_probability: float, path: list[int], locations: list[int] | None) -> None:
        if locations is not None:
            add_followed(parent, parent_probability, path, locations)
            return
        num_matched_tokens, counted = followers_of(path)
        if num_matched_tokens == 0 or not counted:
            return
        total = sum(count for _, count in counted)
        confidence = match_confidence(num_matched_tokens)
        # Only the best (max_nodes - size) children can ever be added.
        for token_id, count in counted[: max_nodes - tree.num_nodes]:
            push(parent, parent_probability, count / total * confidence, token_id, None)

    if max_nodes > 0:
        add_candidates(-1, 1.0, [], sources.locations if sources is not None else None)
    while candidates and tree.num_nodes < max_nodes:
        negative_probability, _, parent, token_id, evidence, locations = heapq.heappop(candidates)
        tree.token_ids.append(token_id)
        tree.parent_indexes.append(parent)
        tree.path_probabilities.append(-negative_probability)
        tree.node_evidence.append(evidence)
        node_index = tree.num_nodes - 1
        add_candidates(node_index, -negative_probability, tree.path(node_index), locations)
    return tree


class _ContextTrie:
    """The reversed-context trie over a set of documents (see the module docstring).

    A *location* is a position in a document, packed as doc_id << 32 | offset.
    Every node keeps the latest location filed under it and how many are, so a
    document can be removed again (the swarm index evicts). `documents` belongs to
    the owner, which appends tokens before filing them and deletes a document only
    after removing it from the trie.
    """

    def __init__(self, documents: dict[int, list[int]], max_ngram: int) -> None:
        self._documents = documents
        self._max_ngram = max_ngram
        self._child_ids: dict[int, int] = {}  # node_id << 32 | token_id -> child node id
        self._latest_locations = array("q", [0])  # per node
        self._num_locations = array("q", [0])  # per node; 0 = unused
        self._is_expanded = bytearray(b"\x01")  # per node; 0 = a lazy leaf (exactly one location under it)
        self._free_node_ids: list[int] = []
        # Expanded nodes only: how many locations under a node each token followed.
        self._follower_counts: dict[int, int] = {}  # node_id << 32 | token_id -> count > 0
        self._follower_ids: dict[int, list[int]] = {}  # node_id -> its followers, first seen first

    @property
    def num_nodes(self) -> int:
        """Nodes in use, the root excluded: the trie's memory, about one per indexed token."""
        return len(self._num_locations) - 1 - len(self._free_node_ids)

    def insert(self, doc_id: int, offset: int) -> None:
        """File the position `offset` of a document under its context (the document already holds it)."""
        token_ids = self._documents[doc_id]
        location = doc_id << _ID_BITS | offset
        node_id = _ROOT_NODE_ID
        for depth in range(min(self._max_ngram, offset)):
            key = node_id << _ID_BITS | token_ids[offset - 1 - depth]
            child_id = self._child_ids.get(key)
            if child_id is None:
                self._child_ids[key] = self._new_lazy_leaf(location)
                return
            if not self._is_expanded[child_id]:
                self._expand(child_id, depth + 1)
            self._num_locations[child_id] += 1
            self._latest_locations[child_id] = location
            self._count_follower(child_id, token_ids[offset], +1)
            node_id = child_id

    def remove(self, doc_id: int, offset: int) -> None:
        """Undo insert(doc_id, offset); nodes no location needs any more are freed.

        A node may go on remembering the removed location as its latest when other
        locations remain under it (we do not know which of them is the newest);
        longest_match skips such a node rather than point at removed data.
        """
        token_ids = self._documents[doc_id]
        node_id = _ROOT_NODE_ID
        for depth in range(min(self._max_ngram, offset)):
            key = node_id << _ID_BITS | token_ids[offset - 1 - depth]
            child_id = self._child_ids[key]
            self._num_locations[child_id] -= 1
            if self._is_expanded[child_id]:
                self._count_follower(child_id, token_ids[offset], -1)
            if self._num_locations[child_id] == 0:
                # Its children, if any, lie on this same path and are freed next.
                del self._child_ids[key]
                self._free_node_ids.append(child_id)
                self._follower_ids.pop(child_id, None)
            if not self._is_expanded[child_id]:
                return
            node_id = child_id

    def followers(self, token_ids: Sequence[int]) -> tuple[int, list[tuple[int, int]]]:
        """(n, [(token, count)]): the longest suffix n-gram of `token_ids` filed in the
        trie and how often each token followed it: by count (descending), a tie going
        to the most recent occurrence's follower, then to the first seen; (0, []) when none."""
        path_node_ids, lazy_match = self._walk_suffix(token_ids)
        if lazy_match is not None:
            depth, location = lazy_match
            return depth, [(self._follower_at(location), 1)]
        if not path_node_ids:
            return 0, []
        node_id, depth = path_node_ids[-1], len(path_node_ids)
        # Every location counted here is live (remove uncounts), but the latest may
        # not be: then no follower is preferred as the most recent.
        location = self._latest_locations[node_id]
        latest_id = self._follower_at(location) if location >> _ID_BITS in self._documents else -1
        counted = [
            (token_id, self._follower_counts[node_id << _ID_BITS | token_id])
            for token_id in self._follower_ids[node_id]
        ]
        counted.sort(key=lambda pair: (-pair[1], pair[0] != latest_id))
        return depth, counted

    def _follower_at(self, location: int) -> int:
        return self._documents[location >> _ID_BITS][location & _ID_MASK]

    def _count_follower(self, node_id: int, token_id: int, delta: int) -> None:
        key = node_id << _ID_BITS | token_id
        count = self._follower_counts.get(key, 0) + delta
        if count > 0:
            if key not in self._follower_counts:
                self._follower_ids.setdefault(node_id, []).append(token_id)
            self._follower_counts[key] = count
        else:
            del self._follower_counts[key]
            self._follower_ids[node_id].remove(token_id)

    def longest_match(self, token_ids: Sequence[int]) -> tuple[int, int]:
        """(n, location): the longest suffix n-gram of `token_ids` (n <= max_ngram) filed
        in the trie and the latest location that followed it; (0, -1) when none."""
        path_node_ids, lazy_match = self._walk_suffix(token_ids)
        if lazy_match is not None:
            return lazy_match
        for depth in range(len(path_node_ids), 0, -1):
            location = self._latest_locations[path_node_ids[depth - 1]]
            if location >> _ID_BITS in self._documents:
                return depth, location
        return 0, -1

    def _walk_suffix(self, token_ids: Sequence[int]) -> tuple[list[int], tuple[int, int] | None]:
        """Down the trie along `token_ids`' suffix, newest token first (max_ngram deep at most):
        the expanded nodes passed (element n - 1 at depth n) and, when the walk ends in a lazy
        leaf, that leaf's match (n, location)."""
        num_tokens = len(token_ids)
        max_depth = min(self._max_ngram, num_tokens)
        node_id, depth = _ROOT_NODE_ID, 0
        path_node_ids: list[int] = []
        while depth < max_depth:
            child_id = self._child_ids.get(node_id << _ID_BITS | token_ids[num_tokens - 1 - depth])
            if child_id is None:
                break
            node_id, depth = child_id, depth + 1
            if not self._is_expanded[node_id]:
                return path_node_ids, self._match_lazy_leaf(node_id, depth, token_ids, max_depth)
            path_node_ids.append(node_id)
        return path_node_ids, None

    def _match_lazy_leaf(self, node_id: int, depth: int, token_ids: Sequence[int], max_depth: int) -> tuple[int, int]:
        """Below a lazy leaf the one location's own tokens are the trie: compare them in place.
        A lazy leaf's location is always live: removing it frees the leaf."""
        location = self._latest_locations[node_id]
        leaf_token_ids = self._documents[location >> _ID_BITS]
        offset = location & _ID_MASK
        num_tokens = len(token_ids)
        max_depth = min(max_depth, offset)
        while depth < max_depth and leaf_token_ids[offset - 1 - depth] == token_ids[num_tokens - 1 - depth]:
            depth += 1
        return depth, location

    def _expand(self, node_id: int, depth: int) -> None:
        """A lazy leaf at `depth` is about to get a second location: make its one
        location's next level explicit (if its context goes deeper)."""
        location = self._latest_locations[node_id]
        offset = location & _ID_MASK
        if depth < min(self._max_ngram, offset):
            token_id = self._documents[location >> _ID_BITS][offset - 1 - depth]
            self._child_ids[node_id << _ID_BITS | token_id] = self._new_lazy_leaf(location)
        self._is_expanded[node_id] = 1
        self._count_follower(node_id, self._follower_at(location), +1)

    def _new_lazy_leaf(self, location: int) -> int:
        if self._free_node_ids:
            node_id = self._free_node_ids.pop()
            self._latest_locations[node_id] = location
            self._num_locations[node_id] = 1
            self._is_expanded[node_id] = 0
            return node_id
        self._latest_locations.append(location)
        self._num_locations.append(1)
        self._is_expanded.append(0)
        return len(self._num_locations) - 1


class RequestIndex:
    """One request's tokens (prompt + accepted output) and their suffix index.

    Only accepted tokens enter: rejected drafts never do, so nothing is ever
    taken back.
    """

    def __init__(
        self, token_ids: Sequence[int] = (), *, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = 1
    ) -> None:
        _check_ngram_range(max_ngram, min_ngram)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._token_ids: list[int] = []
        # The same tokens as an array, which occurrences() searches as numpy without a copy. The
        # trie reads the list: an array alone boxes an int at every read (3.69 against 2.76 µs an
        # appended token at 32k tokens, measured on Zen 4).
        self._token_array = array("q")
        self._trie = _ContextTrie({0: self._token_ids}, max_ngram)
        self.extend(token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def token_ids(self) -> Sequence[int]:
        """The history itself, not a copy: read it, do not change it."""
        return self._token_ids

    @property
    def num_nodes(self) -> int:
        return self._trie.num_nodes

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append accepted tokens; O(max_ngram) per token."""
        token_ids = _as_token_ids(token_ids)
        self._token_array.extend(token_ids)
        for token_id in token_ids:
            self._token_ids.append(token_id)
            self._trie.insert(0, len(self._token_ids) - 1)

    def match(self) -> SuffixMatch | None:
        """The longest recent suffix match of the history, None when there is none."""
        num_matched_tokens, location = self._trie.longest_match(self._token_ids)
        if num_matched_tokens < self.min_ngram:
            return None
        return SuffixMatch(num_matched_tokens, self._token_ids, location & _ID_MASK)

    def propose(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` draft tokens; [] when the suffix matches nothing earlier."""
        match = self.match()
        return match.draft(max_tokens) if match is not None else []

    def followers(self, path_token_ids: list[int] = ()) -> tuple[int, list[tuple[int, int]]]:
        """(n, [(token, count)]) after the history followed by `path_token_ids`; (0, []) below min_ngram."""
        num_matched_tokens, counted = self._trie.followers(_WithPath(self._token_ids, list(path_token_ids)))
        return (num_matched_tokens, counted) if num_matched_tokens >= self.min_ngram else (0, [])

    def occurrences(self, num_tokens: int, limit: int) -> list[int]:
        """Where the history's last `num_tokens` tokens occurred before with a token after them:
        each occurrence's follower position, the most recent first, at most `limit`. One
        vectorised pass over the history (tens of µs at 32k tokens)."""
        end = len(self._token_ids)
        if not 0 < num_tokens < end:
            return []
        history = np.frombuffer(self._token_array, dtype=np.int64)
        # Occurrences ending at e = num_tokens - 1 .. end - 2 (the suffix itself ends at end - 1).
        ends = np.flatnonzero(history[num_tokens - 1 : end - 1] == history[end - 1]) + (num_tokens - 1)
        for back in range(1, num_tokens):
            ends = ends[history[ends - back] == history[end - 1 - back]]
        del history  # the array may grow again once no view of it is left
        return (ends[::-1][:limit] + 1).tolist()

    def tree_sources(self) -> TreeSources | None:
        """The occurrences of the longest match a tree follows; None when nothing matches."""
        match = self.match()
        if match is None:
            return None
        n = match.num_matched_tokens
        return TreeSources(self._token_ids, n, self.occurrences(n, MAX_TREE_SOURCES))

    def propose_tree(self, max_nodes: int) -> DraftTree:
        """A draft tree of at most `max_nodes` nodes (empty when nothing matches)."""
        return grow_tree(self.followers, max_nodes, self.tree_sources())


class SwarmIndex:
    """Every request's output tokens, so one agent can draft from what another wrote.

    Only outputs: prompts are mostly a shared system prompt, already in each
    request's own index. Each request's output is one document, appended to while
    it runs and kept after it finishes, until the index holds more than
    `max_num_tokens` tokens; then whole documents go, oldest first (by when their
    first token arrived), a running request's included: its later output starts a
    new document. Document ids are never reused, so a trie node that still
    remembers an evicted location as its latest is recognised and skipped in
    favour of a shorter match: an eviction may cost a proposal, never give a
    wrong one.
    """

    def __init__(
        self, *, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = 1, max_num_tokens: int = 1_000_000
    ) -> None:
        _check_ngram_range(max_ngram, min_ngram)
        if max_num_tokens < 0:
            raise ValueError(f"max_num_tokens must be >= 0, got {max_num_tokens}")
        self.min_ngram = min_ngram
        self.max_num_tokens = max_num_tokens
        self.num_tokens = 0
        self.num_appended_tokens = 0  # ever: what a tree grown from this index was grown at
        self._documents: dict[int, list[int]] = {}
        self._trie = _ContextTrie(self._documents, max_ngram)
        self._doc_ids_oldest_first: deque[int] = deque()
        self._doc_ids_by_request_id: dict[str, int] = {}  # requests whose document is still growing
        self._request_ids_by_doc_id: dict[int, str] = {}
        self._next_doc_id = 0

    @property
    def num_nodes(self) -> int:
        return self._trie.num_nodes

    @property
    def num_documents(self) -> int:
        return len(self._documents)

    def append(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Index a request's newly accepted output tokens, then evict down to the bound."""
        token_ids = _as_token_ids(token_ids)
        if not token_ids:
            return
        doc_id = self._doc_ids_by_request_id.get(request_id)
        if doc_id is None:
            doc_id = self._open_document(request_id)
        document = self._documents[doc_id]
        for token_id in token_ids:
            document.append(token_id)
            self._trie.insert(doc_id, len(document) - 1)
        self.num_tokens += len(token_ids)
        self.num_appended_tokens += len(token_ids)
        while self.num_tokens > self.max_num_tokens:
            self._evict_oldest()

    def finish(self, request_id: str) -> None:
        """The request produces no more output; its document stays until evicted."""
        doc_id = self._doc_ids_by_request_id.pop(request_id, None)
        if doc_id is not None:
            del self._request_ids_by_doc_id[doc_id]

    def match(self, token_ids: Sequence[int], *, exclude_request_id: str | None = None) -> SuffixMatch | None:
        """The longest recent match of the suffix of `token_ids` in anyone's output.

        A match in `exclude_request_id`'s own output is dropped: that request's own
        index holds the same occurrence with at least as long a match.
        """
        num_matched_tokens, location = self._trie.longest_match(token_ids)
        if num_matched_tokens < self.min_ngram:
            return None
        doc_id = location >> _ID_BITS
        if exclude_request_id is not None and self._doc_ids_by_request_id.get(exclude_request_id) == doc_id:
            return None
        return SuffixMatch(num_matched_tokens, self._documents[doc_id], location & _ID_MASK)

    def followers(self, token_ids: Sequence[int]) -> tuple[int, list[tuple[int, int]]]:
        """(n, [(token, count)]) after `token_ids` over everyone's output; (0, []) below min_ngram.

        Unlike match, a requester's own output is not left out: its counts are
        the swarm's too, and the caller picks one source, never a sum.
        """
        num_matched_tokens, counted = self._trie.followers(token_ids)
        return (num_matched_tokens, counted) if num_matched_tokens >= self.min_ngram else (0, [])

    def _open_document(self, request_id: str) -> int:
        doc_id = self._next_doc_id
        self._next_doc_id += 1
        self._documents[doc_id] = []
        self._doc_ids_oldest_first.append(doc_id)
        self._doc_ids_by_request_id[request_id] = doc_id
        self._request_ids_by_doc_id[doc_id] = request_id
        return doc_id

    def _evict_oldest(self) -> None:
        """O(max_ngram) per evicted token, paid once per token indexed."""
        doc_id = self._doc_ids_oldest_first.popleft()
        document = self._documents[doc_id]
        for offset in range(1, len(document)):
            self._trie.remove(doc_id, offset)
        del self._documents[doc_id]
        self.num_tokens -= len(document)
        request_id = self._request_ids_by_doc_id.pop(doc_id, None)
        if request_id is not None:
            del self._doc_ids_by_request_id[request_id]


class Drafter:
    """The draft source for every request of one executor.

    Proposals come from the request's own index and, with `use_swarm_index`, from
    the swarm index over everyone's output; the longer match wins, a tie goes to
    the request's own index. No request ever gets more than `max_draft_tokens`.
    """

    def __init__(
        self,
        *,
        max_ngram: int = DEFAULT_MAX_NGRAM,
        min_ngram: int = 1,
        max_draft_tokens: int = 16,
        use_swarm_index: bool = False,
        max_swarm_tokens: int = 1_000_000,
    ) -> None:
        _check_ngram_range(max_ngram, min_ngram)
        if max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {max_draft_tokens}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_draft_tokens = max_draft_tokens
        self.swarm_index = (
            SwarmIndex(max_ngram=max_ngram, min_ngram=min_ngram, max_num_tokens=max_swarm_tokens)
            if use_swarm_index
            else None
        )
        self._request_indexes: dict[str, RequestIndex] = {}
        self.calibration = NodeCalibration()  # one for every request: trees of one model and swarm
        # request id -> (the indexes' sizes it was grown at, next_tree's tree): propose_tree
        # takes its first nodes while neither index has grown since, instead of growing it again.
        self._next_trees: dict[str, tuple[tuple[int, int], DraftTree]] = {}

    def has_request(self, request_id: str) -> bool:
        return request_id in self._request_indexes

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        if request_id in self._request_indexes:
            raise ValueError(f"request {request_id!r} is already in the drafter")
        self._request_indexes[request_id] = RequestIndex(
            prompt_token_ids, max_ngram=self.max_ngram, min_ngram=self.min_ngram
        )

    def append(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Accepted output tokens only (rejected drafts never enter)."""
        self._index(request_id).extend(token_ids)
        if self.swarm_index is not None:
            self.swarm_index.append(request_id, token_ids)

    def release(self, request_id: str) -> None:
        """Forget the request; its output stays in the swarm index until evicted."""
        del self._request_indexes[request_id]
        self._next_trees.pop(request_id, None)
        if self.swarm_index is not None:
            self.swarm_index.finish(request_id)

    def propose(self, request_id: str, max_tokens: int) -> list[int]:
        """At most min(max_tokens, max_draft_tokens) draft tokens; [] when nothing matches."""
        match = self._match(request_id)
        return match.draft(min(max_tokens, self.max_draft_tokens)) if match is not None else []

    def propose_tree(self, request_id: str, max_nodes: int) -> DraftTree:
        """A draft tree of at most min(max_nodes, max_draft_tokens) nodes.

        Each node's followers come from the longer match of the request's own
        index and the swarm index (a tie goes to the own index). A tree next_tree grew is
        reused even if verified trees recalibrated the drafter since: the scheduler priced
        this step's budget by that tree's curve.
        """
        num_nodes = min(max_nodes, self.max_draft_tokens)
        grown = self._next_trees.pop(request_id, None)
        if grown is not None and grown[0] == self._index_sizes(request_id):
            return grown[1].first(num_nodes)
        return self._grow_tree(request_id, num_nodes)

    def next_tree(self, request_id: str) -> DraftTree:
        """The tree propose_tree would give next step at the full budget (max_draft_tokens),
        unless other requests' output changes the swarm index first: its first n nodes are
        what a budget of n would buy (DraftTree.expected_num_accepted_tokens_by_nodes). Kept
        for that propose_tree while neither index grows (~130 µs of Python a tree)."""
        tree = self._grow_tree(request_id, self.max_draft_tokens)
        self._next_trees[request_id] = (self._index_sizes(request_id), tree)
        return tree

    def _index_sizes(self, request_id: str) -> tuple[int, int]:
        """Tokens ever added to the request's index and to the swarm index: a tree grown from
        them is grown again the same while both are unchanged (indexes only grow, or evict
        while they grow)."""
        swarm = self.swarm_index.num_appended_tokens if self.swarm_index is not None else 0
        return self._index(request_id).num_tokens, swarm

    def _grow_tree(self, request_id: str, max_nodes: int) -> DraftTree:
        index = self._index(request_id)

        def followers_of(path_token_ids: list[int]) -> tuple[int, list[tuple[int, int]]]:
            own = index.followers(path_token_ids)
            if self.swarm_index is None:
                return own
            swarm = self.swarm_index.followers(_WithPath(index.token_ids, path_token_ids))
            return swarm if swarm[0] > own[0] else own

        sources = index.tree_sources()
        if (
            sources is not None
            and self.swarm_index is not None
            and self.swarm_index.followers(index.token_ids)[0] > sources.num_matched_tokens
        ):
            sources = None  # the swarm's output matches longer: its counts lead, as at every node
        return grow_tree(followers_of, max_nodes, sources, self.calibration)

    def observe_tree(self, tree: DraftTree, kept_nodes: Sequence[int]) -> None:
        """A tree this drafter proposed was verified and kept `kept_nodes` (its accepted path):
        calibrate the trees grown from now on by it (NodeCalibration)."""
        self.calibration.observe(tree, kept_nodes)

    def num_draftable(self, request_id: str) -> int:
        """len(propose(request_id, max_draft_tokens)), without building the draft."""
        match = self._match(request_id)
        return match.num_draft_tokens(self.max_draft_tokens) if match is not None else 0

    def _index(self, request_id: str) -> RequestIndex:
        try:
            return self._request_indexes[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not in the drafter") from None

    def _match(self, request_id: str) -> SuffixMatch | None:
        index = self._index(request_id)
        own_match = index.match()
        if self.swarm_index is None:
            return own_match
        swarm_match = self.swarm_index.match(index.token_ids, exclude_request_id=request_id)
        if swarm_match is None:
            return own_match
        if own_match is None or swarm_match.num_matched_tokens > own_match.num_matched_tokens:
            return swarm_match
        return own_match
