"""What the front doors read of the step loop's state: a small read-only view.

Admission, the gRPC servicer, the HTTP front, the metrics and the load report
decide from the executor's limits and the planner's queue and KV mirror. They read
them here, never by reaching into the loop: the planner is the step loop's alone to
change, and is replaced on every attach, so the view looks it up at each read.
While no executor is attached there is nothing to read: None, or 0.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler_svc.executor_link import ExecutorLink
from scheduler_svc.intake import ModelLimits
from scheduler_svc.planner import Planner
from swarmserve.executor.v1 import executor_pb2 as epb


class LoopView:
    def __init__(self, link: ExecutorLink, planner: Callable[[], Planner | None]) -> None:
        self._link = link
        self._planner = planner  # the loop's current planner

    @property
    def limits(self) -> ModelLimits | None:
        """The model's limits and tokenizer (a new object when another executor attaches)."""
        return self._link.limits

    @property
    def info(self) -> epb.GetInfoResponse | None:
        """The attached executor's GetInfo answer."""
        return self._link.info

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request of this many tokens fits in the executor's whole KV cache at all."""
        planner = self._planner()
        return planner is not None and planner.can_ever_fit(num_tokens)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt and output) one request can hold: the context length or, when
        the KV cache is smaller, what it can ever give one request. 0 while detached."""
        limits = self._link.limits
        kv_tokens = self._read(lambda p: p.max_request_tokens)
        return min(limits.context_length, kv_tokens) if limits is not None else 0

    @property
    def num_waiting(self) -> int:
        """Requests queued (or preempted) for a place in the batch."""
        return self._read(lambda p: p.num_waiting)

    @property
    def num_queued(self) -> int:
        """Requests waiting beyond the batch's free places (Planner.num_queued): what the queue cap counts."""
        return self._read(lambda p: p.num_queued)

    @property
    def num_running(self) -> int:
        return self._read(lambda p: len(p.running))

    @property
    def num_free_blocks(self) -> int:
        """Free KV blocks, as the executor last reported."""
        return self._read(lambda p: p.num_free_blocks)

    @property
    def num_kv_blocks(self) -> int:
        return self._read(lambda p: p.num_kv_blocks)

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self._read(lambda p: p.block_size)

    def _read(self, read: Callable[[Planner], int]) -> int:
        planner = self._planner()
        return read(planner) if planner is not None else 0
