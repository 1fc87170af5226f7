"""The Prometheus endpoint: prometheus_client's HTTP server on a thread, for one registry.

Each service keeps its metrics in its own `CollectorRegistry` (not the library's
global one), so two services can share a test process and the names a service
exports can be listed from its registry alone.
"""

from __future__ import annotations

from dataclasses import dataclass


def metrics_host(listen: str) -> str:
    """Serve metrics on the gRPC service's interface: `0.0.0.0:50051` -> `0.0.0.0`."""
    host = listen.rpartition(":")[0].strip("[]")
    return host or "0.0.0.0"


@dataclass
class MetricsServer:
    host: str
    port: int  # the bound port (useful when 0 was not asked for but a test picks one)
    _server: object
    _thread: object

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(host: str, port: int, registry) -> MetricsServer:
    from prometheus_client import start_http_server

    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(host, server.server_port, server, thread)
