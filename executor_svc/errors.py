"""Exceptions the executor raises for bad input.

Each maps to one gRPC status code in the service layer, so a caller can tell
"fix your request" (InvalidRequestError, shared with the scheduler) from "try again
later" (OutOfKVBlocksError) from "fix the server's model" (ModelLoadError).
"""

from service_common.errors import InvalidRequestError


class ExecutorError(Exception):
    """Base class of the executor's own errors (a malformed request is an InvalidRequestError)."""


class ModelLoadError(ExecutorError):
    """The model file is missing, not a GGUF, truncated, or uses an unsupported feature."""


class UnknownRequestError(InvalidRequestError):
    """A plan names a request id the engine does not hold."""


class OutOfKVBlocksError(ExecutorError):
    """A plan needs more KV blocks than are free; nothing was executed."""


class OutOfStateSlotsError(OutOfKVBlocksError):
    """A plan runs more requests than a hybrid model has recurrent-state slots for; nothing was executed.

    A kind of running out of KV (the same back-pressure: RESOURCE_EXHAUSTED), since the
    state pool is the per-request half of a hybrid model's cache."""
