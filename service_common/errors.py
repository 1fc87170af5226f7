"""The error both services raise for a request that cannot be served as asked.

Each service maps it to INVALID_ARGUMENT ("fix your request"); the executor's own
errors (executor_svc/errors.py) derive from it where they mean the same.
"""


class InvalidRequestError(Exception):
    """A request or plan is malformed (bad token ids, prompt too long, bad params)."""
