"""What the executor reports: its Prometheus metrics and the Step RPC's span and log line.

The plumbing under them (log configuration, tracer provider, trace context over gRPC,
the metrics server) is shared with the scheduler, in service_common/observability/.
"""
