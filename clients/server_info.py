"""GetServerInfo as a frozen dataclass: what the scheduler serves and how loaded it is."""

from __future__ import annotations

from dataclasses import dataclass

from swarmserve.scheduler.v1 import scheduler_pb2 as pb


@dataclass(frozen=True)
class ServerInfo:
    model_name: str
    context_length: int
    vocab_size: int
    executor_address: str
    is_executor_connected: bool
    batching: str
    max_running_requests: int
    max_queued_requests: int
    num_running_requests: int
    num_queued_requests: int
    num_free_kv_blocks: int
    num_kv_blocks: int
    kv_block_size: int
    chat_template: str
    num_steps: int = 0
    num_generated_tokens: int = 0
    dtype: str = ""
    device: str = ""
    weight_bytes: int = 0  # the executor's resident weights
    matmul: str = ""  # exact | int16 | int8

    @classmethod
    def from_pb(cls, info: pb.GetServerInfoResponse) -> ServerInfo:
        return cls(
            model_name=info.model_name,
            context_length=info.context_length,
            vocab_size=info.vocab_size,
            executor_address=info.executor_address,
            is_executor_connected=info.is_executor_connected,
            batching=info.batching,
            max_running_requests=info.max_running_requests,
            max_queued_requests=info.max_queued_requests,
            num_running_requests=info.num_running_requests,
            num_queued_requests=info.num_queued_requests,
            num_free_kv_blocks=info.num_free_kv_blocks,
            num_kv_blocks=info.num_kv_blocks,
            kv_block_size=info.kv_block_size,
            chat_template=info.chat_template,
            num_steps=info.num_steps,
            num_generated_tokens=info.num_generated_tokens,
            dtype=info.dtype,
            device=info.device,
            weight_bytes=info.weight_bytes,
            matmul=info.matmul,
        )
