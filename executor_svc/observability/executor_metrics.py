"""The executor's Prometheus metrics (`swarmserve_executor_*`), fed from each Step's response.

Everything a step reports (timings, tokens, drafts, KV) is already in the
StepResponse, so the metrics are updated by the Step interceptor from the
response alone; only the resident request count is read from the engine, at
scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from service_common.observability import metric_buckets as buckets
from service_common.observability.rpc_errors import RPC_ERROR_LABELS

PREFIX = "swarmserve_executor_"
PHASES = ("prepare", "forward", "sample")


class ExecutorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.steps = Counter(PREFIX + "steps", "Steps executed", registry=r)
        self.step_duration = Histogram(
            PREFIX + "step_duration_seconds",
            "Engine time of one step (prepare + forward + sample/verify)",
            buckets=buckets.STEP_SECONDS,
            registry=r,
        )
        phase_duration = Histogram(
            PREFIX + "step_phase_duration_seconds",
            "Engine time of one step's phase",
            ["phase"],
            buckets=buckets.STEP_SECONDS,
            registry=r,
        )
        self._phase_duration = {phase: phase_duration.labels(phase) for phase in PHASES}
        self.step_tokens = Histogram(
            PREFIX + "step_tokens",
            "Tokens computed in one step (prefill, decode and draft)",
            buckets=buckets.STEP_TOKENS,
            registry=r,
        )
        self.computed_tokens = Counter(
            PREFIX + "computed_tokens", "Tokens computed (prefill, decode and draft)", registry=r
        )
        self.generated_tokens = Counter(PREFIX + "generated_tokens", "Tokens emitted to requests", registry=r)
        self.draft_tokens = Counter(PREFIX + "draft_tokens", "Draft tokens proposed and verified", registry=r)
        self.draft_tokens_accepted = Counter(PREFIX + "draft_tokens_accepted", "Draft tokens accepted", registry=r)
        self.requests_added = Counter(PREFIX + "requests_added", "Requests a plan added", registry=r)
        self.preemptions = Counter(
            PREFIX + "preemptions", "Requests a plan preempted (KV freed, tokens kept)", registry=r
        )
        self.kv_blocks_free = Gauge(PREFIX + "kv_blocks_free", "Free KV blocks (after the last step)", registry=r)
        self.kv_blocks_used = Gauge(PREFIX + "kv_blocks_used", "KV blocks in use (after the last step)", registry=r)
        self.running_requests = Gauge(PREFIX + "running_requests", "Requests the executor holds", registry=r)
        self.rpc_errors = Counter(
            PREFIX + "rpc_errors", "RPCs ended with a status other than OK", RPC_ERROR_LABELS, registry=r
        )

    def watch(self, engine) -> None:
        """Read what is not in a step's response from the engine."""
        self.running_requests.set_function(lambda: len(engine.request_ids))
        free, total = engine.kv.num_free_blocks, engine.kv.num_usable_blocks
        self.kv_blocks_free.set(free)
        self.kv_blocks_used.set(total - free)

    def observe_step(self, request, response) -> None:
        """One Step call: `request` is the StepRequest, `response` the StepResponse."""
        t = response.timings
        self.steps.inc()
        self.step_duration.observe(t.prepare_s + t.forward_s + t.sample_s)
        self._phase_duration["prepare"].observe(t.prepare_s)
        self._phase_duration["forward"].observe(t.forward_s)
        self._phase_duration["sample"].observe(t.sample_s)
        self.step_tokens.observe(response.num_computed_tokens)
        self.computed_tokens.inc(response.num_computed_tokens)
        generated = drafted = accepted = 0
        for result in response.results:
            generated += len(result.new_token_ids)
            drafted += result.num_drafted_tokens
            accepted += result.num_accepted_tokens
        self.generated_tokens.inc(generated)
        self.draft_tokens.inc(drafted)
        self.draft_tokens_accepted.inc(accepted)
        self.requests_added.inc(len(request.new_requests))
        self.preemptions.inc(len(request.preempted))
        self.kv_blocks_free.set(response.num_free_kv_blocks)
        self.kv_blocks_used.set(response.num_total_kv_blocks - response.num_free_kv_blocks)
