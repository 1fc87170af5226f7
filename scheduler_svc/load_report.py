"""The load that gateways in front of several schedulers route on, in the shapes they read.

One snapshot of the planner (requests waiting, requests running, KV blocks in use),
read at the moment a router asks, rendered two ways:

- Prometheus gauges under vLLM's names (`vllm:num_requests_waiting`,
  `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, labelled `model_name`),
  which the Kubernetes Gateway API inference extension's endpoint picker (and llm-d)
  scrape from `/metrics` on the serving port. `kv_cache_usage_perc` is a fraction in
  [0, 1], as in vLLM, despite its name.
- SMG's native load report, `GET /v1/loads` (`WorkerLoadResponse`: one entry per
  data-parallel rank, here always one), which SMG polls from every HTTP worker whose
  engine it does not recognise, for its load-aware policies and overload protection.

KV "in use" is what the executor last reported as not free: blocks that only hold a
finished request's cached prefix count as free, since the allocator hands them out.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"


@dataclass(frozen=True)
class Load:
    num_waiting_requests: int = 0
    num_running_requests: int = 0
    num_used_blocks: int = 0
    num_kv_blocks: int = 0
    block_size: int = 0

    @property
    def kv_usage(self) -> float:
        """Share of the KV cache in use, 0..1 (0 while no executor is attached)."""
        return self.num_used_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0

    @classmethod
    def of(cls, view) -> "Load":
        """The step loop's state now (its `LoopView`); all zeros while no executor is attached."""
        return cls(
            num_waiting_requests=view.num_waiting,
            num_running_requests=view.num_running,
            num_used_blocks=view.num_kv_blocks - view.num_free_blocks,
            num_kv_blocks=view.num_kv_blocks,
            block_size=view.block_size,
        )


class RouterGauges(Collector):
    """The inference extension's gauges, computed from the step loop's view at scrape time."""

    def __init__(self, view) -> None:
        self._view = view

    def collect(self) -> Iterator[GaugeMetricFamily]:
        load = Load.of(self._view)
        info = self._view.info  # the model's name is known once an executor has attached
        model = [info.model_name if info is not None else ""]
        for name, documentation, value in (
            (WAITING, "Requests waiting to be scheduled (queued or preempted)", load.num_waiting_requests),
            (RUNNING, "Requests in the running batch", load.num_running_requests),
            (KV_USAGE, "KV-cache usage, 0..1 (1 means every block is in use)", load.kv_usage),
        ):
            family = GaugeMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric(model, value)
            yield family


def smg_loads(load: Load) -> dict:
    """SMG's `WorkerLoadResponse` for one rank (its `SchedulerLoadSnapshot` field names)."""
    num_used_tokens = load.num_used_blocks * load.block_size
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "dp_rank_count": 1,
        "loads": [
            {
                "dp_rank": 0,
                "num_running_reqs": load.num_running_requests,
                "num_waiting_reqs": load.num_waiting_requests,
                "num_total_reqs": load.num_running_requests + load.num_waiting_requests,
                "num_used_tokens": num_used_tokens,
                "max_total_num_tokens": load.num_kv_blocks * load.block_size,
                "token_usage": load.kv_usage,
            }
        ],
    }
