"""`swarmserve-executor`: load the model and serve ExecutorService over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import signal

import structlog

from executor_svc.engine import DTYPES, Engine, EngineConfig
from executor_svc.observability.logs import LOG_FORMATS, configure_logging
from executor_svc.server import serve

log = structlog.get_logger()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swarmserve-executor", description=__doc__)
    p.add_argument("--listen", default="127.0.0.1:50052", help="address to serve on (default %(default)s)")
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M-Instruct) or a path to a .gguf")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="compute dtype (default %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device (default %(default)s)")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="memory for the paged KV cache in GiB (default %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="most tokens one step may compute")
    p.add_argument(
        "--no-batch-invariant",
        action="store_true",
        help="let batch composition change results in the last bits (slightly faster at batch size 1)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--log-format", default="json", choices=LOG_FORMATS)
    p.add_argument("--log-level", default="info")
    return p


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)),
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        batch_invariant=not args.no_batch_invariant,
        num_threads=args.threads,
    )


async def run(args: argparse.Namespace) -> None:
    engine = Engine(config_from_args(args))
    server = await serve(engine, args.listen)
    log.info(
        "executor_listening",
        address=args.listen,
        model=engine.model_config.name,
        kv_blocks=engine.kv_cache.num_usable_blocks,
        block_size=engine.kv_cache.block_size,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("executor_stopping")
    await server.stop(grace=2.0)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
