"""Stop strings: end a request when its text contains one, and never stream past it.

A stop string may arrive split across deltas, so text that could be the start
of one (the longest suffix that is a prefix of some stop string) is held back
until the next delta settles it. The stop string itself is not part of the
output (OpenAI/vLLM semantics).
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop_strings: list[str]) -> None:
        self._stops = [s for s in stop_strings if s]
        self._pending = ""  # received but not yet released text
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add new text; returns the part that is safe to emit now."""
        if self.matched is not None:
            return ""
        self._pending += text
        if not self._stops:
            out, self._pending = self._pending, ""
            return out
        hits = [(i, s) for s in self._stops if (i := self._pending.find(s)) != -1]
        if hits:
            index, stop = min(hits)
            self.matched = stop
            out, self._pending = self._pending[:index], ""
            return out
        cut = len(self._pending) - self._partial_match_length()
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def _partial_match_length(self) -> int:
        """Length of the longest suffix of the pending text that begins some stop string."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """At the end of a request without a match: release what was held back."""
        out, self._pending = ("" if self.matched is not None else self._pending), ""
        return out
