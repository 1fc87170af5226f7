"""What both services share, and nothing that needs torch: sampling parameters and their
validation, the invalid-request error, bearer keys and TLS ports, and the logging, tracing
and metrics plumbing (`observability/`). scheduler_svc imports this, never executor_svc.
"""
