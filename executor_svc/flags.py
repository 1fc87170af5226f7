"""`swarmserve-executor`'s flags: EngineConfig's fields (each carries its flag), then the server's own.

Torch-free (EngineConfig lives in executor_svc/config.py), so `swarmserve serve` can
read which flags are the executor's without loading torch.
"""

from __future__ import annotations

import argparse

from executor_svc.config import EngineConfig
from service_common.config_flags import add_config_flags, add_tls_flags, config_from_flags
from service_common.observability.flags import add_log_flags, add_observability_flags


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="swarmserve-executor",
        description="`swarmserve-executor`: load the model and serve ExecutorService over gRPC.",
    )
    p.add_argument("--listen", default="127.0.0.1:50052", help="address to serve on (default %(default)s)")
    add_config_flags(p, EngineConfig)
    p.add_argument(
        "--no-calibration",
        action="store_true",
        help="skip timing forward passes at start-up (the scheduler's cost model then starts from a prior)",
    )
    add_log_flags(p)
    p.add_argument(
        "--scheduler-token-file",
        default=None,
        help="serve only callers sending 'authorization: Bearer <token>' with a token from this file "
        "(the scheduler's --executor-token-file); health checks stay open (default: no token needed)",
    )
    add_tls_flags(p)
    add_observability_flags(p)
    return p


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return config_from_flags(EngineConfig, args)
