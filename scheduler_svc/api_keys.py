"""Optional API keys: with --api-key-file, every SchedulerService call must carry
`authorization: Bearer <key>` metadata for one of the file's keys, or it is refused
with UNAUTHENTICATED before its handler runs; health checks stay open (see
service_common/bearer_keys.py, shared with the executor's scheduler token).
"""

from __future__ import annotations

from service_common.bearer_keys import BearerKeyInterceptor, load_keys

SERVICE = "swarmserve.scheduler.v1.SchedulerService"
UNAUTHENTICATED_MESSAGE = (
    "missing or unknown API key: this scheduler requires metadata 'authorization: Bearer <key>' "
    "with a key from its --api-key-file"
)


def load_api_keys(path: str) -> list[str]:
    return load_keys(path, "API key")


def api_key_interceptor(path: str) -> BearerKeyInterceptor:
    return BearerKeyInterceptor(load_api_keys(path), SERVICE, UNAUTHENTICATED_MESSAGE)
