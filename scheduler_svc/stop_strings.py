"""Stop strings: end a request when its text contains one, and never stream past it.

A stop string may arrive split across deltas, so text that could be the start
of one (the longest suffix that is a prefix of some stop string) is held back
until the next delta settles it. The stop string itself is not part of the
output (OpenAI/vLLM semantics). The request stops at the first stop string to
be completed, as if the text arrived one character at a time; of those ending
at the same character, the longest.

Matching is an Aho-Corasick automaton over the stop strings, fed one character
at a time: its state *is* the longest suffix that begins some stop string, so
each character costs amortised O(1) whatever the number and length of the stop
strings. (Searching every stop string in the held-back text at every delta cost
0.23 s per token for 2,000 stop strings of 1,000 characters.)
"""

from __future__ import annotations


class StopStringAutomaton:
    """Aho-Corasick over the stop strings; node 0 is the root (the empty suffix)."""

    def __init__(self, stop_strings: list[str]) -> None:
        self._children: list[dict[str, int]] = [{}]
        self._fail = [0]
        self.depth = [0]  # length of the text a node stands for
        self._match: list[str | None] = [None]  # the longest stop string ending at this node
        for stop in stop_strings:
            node = 0
            for char in stop:
                child = self._children[node].get(char)
                if child is None:
                    child = len(self._children)
                    self._children[node][char] = child
                    self._children.append({})
                    self._fail.append(0)
                    self.depth.append(self.depth[node] + 1)
                    self._match.append(None)
                node = child
            self._match[node] = stop
        # Breadth first, so a node's failure link (a shorter suffix) is complete before it.
        queue = list(self._children[0].values())
        for node in queue:
            for char, child in self._children[node].items():
                fail = self._fail[node]
                while fail and char not in self._children[fail]:
                    fail = self._fail[fail]
                target = self._children[fail].get(char, 0)
                self._fail[child] = target if target != child else 0
                if self._match[child] is None:
                    self._match[child] = self._match[self._fail[child]]
                queue.append(child)

    def step(self, node: int, char: str) -> int:
        while node and char not in self._children[node]:
            node = self._fail[node]
        return self._children[node].get(char, 0)

    def match(self, node: int) -> str | None:
        return self._match[node]


class StopStringMatcher:
    def __init__(self, stop_strings: list[str]) -> None:
        stops = [s for s in stop_strings if s]
        self._automaton = StopStringAutomaton(stops) if stops else None
        self._node = 0
        self._pending = ""  # received but not yet released: always the automaton's current suffix
        self.matched: str | None = None

    @property
    def is_empty(self) -> bool:
        """No stop strings: every text is emitted as it comes."""
        return self._automaton is None

    def feed(self, text: str) -> str:
        """Add new text; returns the part that is safe to emit now."""
        if self.matched is not None:
            return ""
        if self._automaton is None:
            return text
        automaton, node = self._automaton, self._node
        for i, char in enumerate(text):
            node = automaton.step(node, char)
            stop = automaton.match(node)
            if stop is not None:
                self.matched = stop
                text_so_far = self._pending + text[: i + 1]
                out, self._pending = text_so_far[: len(text_so_far) - len(stop)], ""
                return out
        self._node = node
        text_so_far = self._pending + text
        cut = len(text_so_far) - automaton.depth[node]
        out, self._pending = text_so_far[:cut], text_so_far[cut:]
        return out

    def flush(self) -> str:
        """At the end of a request without a match: release what was held back."""
        out, self._pending = ("" if self.matched is not None else self._pending), ""
        return out
