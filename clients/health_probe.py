"""`python -m clients.health_probe ADDRESS [SERVICE]`: exit 0 when the server is SERVING.

For container health checks (docker compose): one standard grpc.health.v1 Check with
a short deadline, so an image needs neither a shell nor grpc_health_probe. Exit 1 with
the reason on stderr otherwise (NOT_SERVING while the scheduler has no executor,
UNAVAILABLE while the executor is still loading its model), 2 for a usage error.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 3.0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m clients.health_probe ADDRESS [SERVICE]", file=sys.stderr)
        return 2
    address, service = args[0], (args[1] if len(args) == 2 else "")
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S
            )
        except grpc.RpcError as error:
            print(f"{address}: {error.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    if status != "SERVING":
        print(f"{address}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
