"""TLS on real servers in this process: both services serve TLS with a certificate for
127.0.0.1 (made here with the openssl command), the scheduler verifies the executor against
its CA, and a client with the CA streams; a client in the clear gets no answer."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import grpc
import pytest

from clients import AsyncSwarmClient, SwarmServeError
from executor_svc.engine.engine import Engine, EngineConfig
from executor_svc.server import serve as serve_executor
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.server import serve as serve_scheduler
from tests.support.stack import free_port, stop_scheduler
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_model


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (it is its own CA): (cert, key) paths."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command here to make a test certificate")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(cert), str(key)


def test_both_services_serve_tls_and_a_client_in_the_clear_is_refused(certificate, tmp_path):
    cert, key = certificate
    model = write_tiny_model(tmp_path / "tiny.gguf", TinyModelSpec(context_length=256))
    engine = Engine(EngineConfig(model=str(model), kv_cache_bytes=8 << 20))

    async def main():
        executor_address = f"127.0.0.1:{free_port()}"
        executor = await serve_executor(engine, executor_address, tls_cert=cert, tls_key=key)
        config = SchedulerConfig(
            listen=f"127.0.0.1:{free_port()}", executor=executor_address, tls_cert=cert, tls_key=key, executor_ca=cert
        )
        server, loop, tasks = await serve_scheduler(config)
        try:
            assert await loop.wait_connected(20), loop.last_connect_error
            async with AsyncSwarmClient(config.listen, tls_ca=cert) as client:
                completion = await client.complete("hi", max_new_tokens=3, ignore_eos=True)
            async with AsyncSwarmClient(config.listen, timeout=3) as plain:
                with pytest.raises(SwarmServeError) as refused:
                    await plain.complete("hi", max_new_tokens=3)
            return completion, refused.value
        finally:
            await stop_scheduler(server, loop, tasks)
            await executor.stop(None)

    completion, refused = asyncio.run(main())
    assert len(completion.token_ids) == 3
    assert refused.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_tls_needs_both_certificate_and_key():
    with pytest.raises(ValueError, match="TLS needs both"):
        SchedulerConfig(tls_cert="cert.pem")
