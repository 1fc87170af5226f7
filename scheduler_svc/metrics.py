"""The scheduler's Prometheus metrics (`swarmserve_scheduler_*`).

Per-step numbers come from the step's `StepRecord` and request updates, once per
step; the queue, the batch and the KV mirror are read from the step loop at scrape
time (gauges with a function), so nothing is updated on the hot path for them.

Latencies as a streaming client sees them: TTFT is arrival to the first token; the
inter-token latency is the gap between a request's consecutive token deliveries,
shared out over the tokens delivered (a step that emits 4 tokens through accepted
drafts counts 4 tokens at a quarter of the gap each).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from scheduler_svc.load_report import RouterGauges
from service_common.observability import metric_buckets as buckets
from service_common.observability.rpc_errors import RPC_ERROR_LABELS

PREFIX = "swarmserve_scheduler_"


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.queue_depth = Gauge(PREFIX + "queue_depth", "Requests waiting (queued or preempted)", registry=r)
        self.running_requests = Gauge(PREFIX + "running_requests", "Requests in the batch", registry=r)
        self.kv_blocks_free = Gauge(
            PREFIX + "kv_blocks_free", "Free KV blocks, as the executor last reported", registry=r
        )
        self.kv_blocks_used = Gauge(
            PREFIX + "kv_blocks_used", "KV blocks in use, as the executor last reported", registry=r
        )
        self.executor_connected = Gauge(PREFIX + "executor_connected", "1 while the executor is attached", registry=r)
        self.free_token_budget = Gauge(
            PREFIX + "free_token_budget", "The free-token budget S the draft policy saw at the last step", registry=r
        )
        self.steps = Counter(PREFIX + "steps", "Steps run", registry=r)
        self.step_duration = Histogram(
            PREFIX + "step_duration_seconds",
            "One step: plan sent to result back",
            buckets=buckets.STEP_SECONDS,
            registry=r,
        )
        self.step_predicted_duration = Histogram(
            PREFIX + "step_predicted_duration_seconds",
            "The cost model's prediction for each step as planned",
            buckets=buckets.STEP_SECONDS,
            registry=r,
        )
        self.batch_size = Histogram(PREFIX + "batch_size", "Requests per step", buckets=buckets.BATCH_SIZE, registry=r)
        self.step_tokens = Histogram(
            PREFIX + "step_tokens",
            "Tokens computed per step (prefill, decode and draft)",
            buckets=buckets.STEP_TOKENS,
            registry=r,
        )
        self.prefill_tokens = Counter(PREFIX + "prefill_tokens", "Prompt tokens computed (prefill chunks)", registry=r)
        self.decode_tokens = Counter(
            PREFIX + "decode_tokens", "Decode tokens computed (one per decoding request and step)", registry=r
        )
        self.generated_tokens = Counter(PREFIX + "generated_tokens", "Tokens streamed to requests", registry=r)
        self.draft_tokens_allocated = Counter(PREFIX + "draft_tokens_allocated", "Draft budget allocated", registry=r)
        self.draft_tokens = Counter(PREFIX + "draft_tokens", "Draft tokens proposed and verified", registry=r)
        self.draft_tokens_accepted = Counter(PREFIX + "draft_tokens_accepted", "Draft tokens accepted", registry=r)
        self.preemptions = Counter(
            PREFIX + "preemptions", "Requests preempted (KV freed, recomputed later)", registry=r
        )
        self.requests_finished = Counter(
            PREFIX + "requests_finished",
            "Requests ended, by finish reason ('error' for a failed one)",
            ["finish_reason"],
            registry=r,
        )
        self.queue_time = Histogram(
            PREFIX + "queue_time_seconds", "Arrival to first scheduled step", buckets=buckets.TTFT_SECONDS, registry=r
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Arrival to first token", buckets=buckets.TTFT_SECONDS, registry=r
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time per token after the first",
            buckets=buckets.ITL_SECONDS,
            registry=r,
        )
        self.rpc_errors = Counter(
            PREFIX + "rpc_errors", "RPCs ended with a status other than OK", RPC_ERROR_LABELS, registry=r
        )
        self._last_token_s: dict[str, float] = {}  # request id -> when its last tokens were delivered

    def watch(self, loop) -> None:
        """Read the queue, the batch and the KV mirror from the step loop at scrape time,
        for our gauges and for the ones routers read under vLLM's names (load_report)."""

        view = loop.view
        self.queue_depth.set_function(lambda: view.num_waiting)
        self.running_requests.set_function(lambda: view.num_running)
        self.kv_blocks_free.set_function(lambda: view.num_free_blocks)
        self.kv_blocks_used.set_function(lambda: view.num_kv_blocks - view.num_free_blocks)
        self.executor_connected.set_function(lambda: 1 if loop.is_connected else 0)
        self.registry.register(RouterGauges(view))

    def observe_step(self, record, updates, step_exemplar: dict | None = None, request_exemplar=None) -> None:
        """One step: its StepRecord and the planner's RequestUpdates for it.

        With tracing, `step_exemplar` ({"trace_id": ...}) and `request_exemplar(request_id)`
        attach trace ids to the step-duration and TTFT observations (OpenMetrics exemplars),
        which Grafana turns into links to the traces.
        """
        self.steps.inc()
        self.step_duration.observe(record.wall_s, step_exemplar)
        if record.predicted_step_s > 0:
            self.step_predicted_duration.observe(record.predicted_step_s)
        self.batch_size.observe(record.num_requests)
        self.step_tokens.observe(record.num_prefill_tokens + record.num_decode_tokens + record.num_drafted_tokens)
        self.prefill_tokens.inc(record.num_prefill_tokens)
        self.decode_tokens.inc(record.num_decode_tokens)
        self.draft_tokens_allocated.inc(record.num_draft_tokens)
        self.draft_tokens.inc(record.num_drafted_tokens)
        self.draft_tokens_accepted.inc(record.num_accepted_tokens)
        self.preemptions.inc(record.num_preempted)
        self.free_token_budget.set(record.num_free_tokens)
        now = record.start_s + record.wall_s
        generated = 0
        for update in updates:
            n = len(update.new_token_ids)
            if not n:
                continue
            generated += n
            request_id = update.request.executor_request_id  # unique per submission, like the span keys
            last = self._last_token_s.get(request_id)
            if last is None:
                exemplar = request_exemplar(request_id) if request_exemplar is not None else None
                self.time_to_first_token.observe(now - update.request.arrival_time, exemplar)
            else:
                gap = (now - last) / n
                for _ in range(n):
                    self.inter_token_latency.observe(gap)
            self._last_token_s[request_id] = now
        self.generated_tokens.inc(generated)

    def observe_request_end(self, request, finish_reason: str) -> None:
        self.requests_finished.labels(finish_reason).inc()
        if request.first_scheduled_time is not None:
            self.queue_time.observe(request.first_scheduled_time - request.arrival_time)
        self._last_token_s.pop(request.executor_request_id, None)
