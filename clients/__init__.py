"""swarmserve clients: the async and sync Python clients and the `swarmserve` CLI.

from clients import SwarmClient

with SwarmClient("127.0.0.1:50051") as client:
    for event in client.generate("def fib(n):", max_new_tokens=32, temperature=0.0):
        ...
"""

from clients.client import DEFAULT_SCHEDULER_ADDRESS, AsyncSwarmClient
from clients.completion import Completion, collect_completion
from clients.errors import SwarmServeError
from clients.events import FinishEvent, GenerateEvent, TokenEvent, TokenLogprob, TopLogprob, Usage
from clients.generate_request import build_generate_request
from clients.generate_stream import GenerateStream
from clients.server_info import ServerInfo
from clients.sync_client import SwarmClient, SyncGenerateStream

__all__ = [
    "DEFAULT_SCHEDULER_ADDRESS",
    "AsyncSwarmClient",
    "Completion",
    "FinishEvent",
    "GenerateEvent",
    "GenerateStream",
    "ServerInfo",
    "SwarmClient",
    "SwarmServeError",
    "SyncGenerateStream",
    "TokenEvent",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "build_generate_request",
    "collect_completion",
]
