"""The Python heap of a long-running service."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Move everything allocated while starting (the model's Python objects, the tokenizer's
    tables, imported modules) out of the garbage collector's sight: they live as long as the
    process, and every full collection would otherwise walk them again, on the step's path."""
    gc.collect()
    gc.freeze()
