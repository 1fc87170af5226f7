"""What both services share, and nothing that needs torch: sampling parameters and structured
output (the proto messages of swarmserve.common.v1, as dataclasses that check themselves), the
checks of a new request's contents and the invalid-request error, bearer keys and TLS ports,
and the logging, tracing and metrics plumbing (`observability/`). scheduler_svc imports this,
never executor_svc.
"""
