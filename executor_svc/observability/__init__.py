"""Logs, traces and metrics for both services.

It lives here because the executor package is the one both services already
share a dependency direction with; nothing in it imports torch. The scheduler's
own reporting (request and step spans, its metrics) is in scheduler_svc/telemetry.py
and scheduler_svc/metrics.py.
"""
