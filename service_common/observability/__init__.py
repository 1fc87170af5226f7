"""Logs, traces and metrics plumbing for both services.

What each service reports is its own: the scheduler's request and step spans and metrics
are in scheduler_svc/telemetry.py and scheduler_svc/metrics.py, the executor's in
executor_svc/observability/.
"""
