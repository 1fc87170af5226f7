"""The scheduler's connection to the executor: attach, fetch the model's limits, send plans.

The scheduler attaches under its id, which stays the same across its restarts
(host and listen address by default: two live schedulers cannot share both).
Every attach makes the executor release whatever it holds, since an attaching
scheduler has lost its state: after a crash, or after giving up on a broken
step. The executor serves one scheduler: another one is refused
(FAILED_PRECONDITION), unless it was started with --take-over, which applies to
its first attach only, so two such schedulers cannot take the executor back and
forth.
"""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenizers import Tokenizer

from scheduler_svc.intake import ModelLimits
from swarmserve.executor.v1 import executor_pb2 as pb
from swarmserve.executor.v1 import executor_pb2_grpc as pb_grpc

EXECUTOR_SERVICE = "swarmserve.executor.v1.ExecutorService"  # its name in the executor's health service


class ExecutorLink:
    def __init__(
        self,
        address: str,
        connect_timeout_s: float,
        step_timeout_s: float,
        interceptors=(),
        *,
        scheduler_id: str,
        take_over: bool = False,
        ca_file: str | None = None,
    ) -> None:
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.step_timeout_s = step_timeout_s
        options = [
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            # Reconnect within a second of a restarted executor listening: gRPC's default backoff
            # grows to two minutes over a long outage, which a slow restart is.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        interceptors = list(interceptors) or None  # e.g. trace context propagation, the executor's token
        if ca_file:  # TLS, the executor's certificate verified against this CA
            credentials = grpc.ssl_channel_credentials(root_certificates=Path(ca_file).read_bytes())
            self.channel = grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
        else:
            self.channel = grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        self.stub = pb_grpc.ExecutorServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.scheduler_id = scheduler_id
        self.take_over = take_over
        self.info: pb.GetInfoResponse | None = None
        self.limits: ModelLimits | None = None

    @property
    def is_connected(self) -> bool:
        return self.info is not None

    async def attach(self) -> pb.GetInfoResponse:
        """GetInfo under this scheduler's id; raises grpc.aio.AioRpcError when unreachable or refused."""
        info = await self.stub.GetInfo(
            pb.GetInfoRequest(scheduler_id=self.scheduler_id, take_over=self.take_over),
            timeout=self.connect_timeout_s,
            wait_for_ready=False,
        )
        self.take_over = False  # once: never take the executor back from a scheduler that took it over
        if self.info is None or info.executor_id != self.info.executor_id:
            self.limits = ModelLimits(
                tokenizer=Tokenizer.from_str(info.tokenizer_json),
                chat_template=info.chat_template or None,
                bos_token=info.bos_token,
                eos_token=info.eos_token,
                context_length=info.context_length,
                vocab_size=info.vocab_size,
            )
        self.info = info
        return info

    async def is_starting(self) -> bool:
        """Whether the executor is listening but not serving yet: its process is starting (loading
        the model, calibrating), so it will be back. Asked of the standard health service."""
        try:
            response = await self.health.Check(
                health_pb2.HealthCheckRequest(service=EXECUTOR_SERVICE), timeout=self.connect_timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.NOT_SERVING

    async def wait_until_disconnected(self) -> None:
        """Return once the channel leaves READY: the executor's process went away (or the channel
        went idle), seen without an RPC, so that an idle scheduler notices a dead executor."""
        state = self.channel.get_state(try_to_connect=False)
        while state == grpc.ChannelConnectivity.READY:
            await self.channel.wait_for_state_change(state)
            state = self.channel.get_state(try_to_connect=False)

    def detach(self) -> None:
        """Forget the connection (after a failed step); the next attach starts clean."""
        self.info = None

    async def step(self, request: pb.StepRequest) -> pb.StepResponse:
        request.scheduler_id = self.scheduler_id
        return await self.stub.Step(request, timeout=self.step_timeout_s)

    async def close(self) -> None:
        await self.channel.close()
