"""`swarmserve-executor`'s flags, each defined once with its default from EngineConfig.

Torch-free (EngineConfig lives in executor_svc/config.py), so `swarmserve serve` can
read which flags are the executor's without loading torch.
"""

from __future__ import annotations

import argparse

from executor_svc.config import DTYPE_CHOICES, KERNELS, MATMULS, EngineConfig
from service_common.observability.flags import add_observability_flags
from service_common.observability.logs import LOG_FORMATS


def build_parser() -> argparse.ArgumentParser:
    defaults = EngineConfig()
    p = argparse.ArgumentParser(
        prog="swarmserve-executor",
        description="`swarmserve-executor`: load the model and serve ExecutorService over gRPC.",
    )
    p.add_argument("--listen", default="127.0.0.1:50052", help="address to serve on (default %(default)s)")
    p.add_argument(
        "--model", default=defaults.model, help="'default' (embedded SmolLM2-135M-Instruct) or a path to a .gguf"
    )
    p.add_argument(
        "--dtype",
        default=defaults.dtype,
        choices=DTYPE_CHOICES,
        help="activation and KV dtype; auto: bfloat16 on a GPU, float32 on the CPU (default %(default)s)",
    )
    p.add_argument(
        "--device",
        default=defaults.device,
        help="auto | cpu | cuda (ROCm's torch answers to cuda) (default %(default)s)",
    )
    p.add_argument(
        "--kernels",
        default=defaults.kernels,
        choices=KERNELS,
        help="auto: triton on a GPU, the C++ kernels (cpu) on the CPU; torch: the plain-torch reference (default %(default)s)",
    )
    p.add_argument(
        "--matmul",
        default=defaults.matmul,
        choices=MATMULS,
        help="how quantized weights multiply on the CPU: exact (float32 math on the dequantized weights) or "
        "int16 (activations quantized to int16 per 32-value block, integer dot products with Q4_0/Q4_1/Q8_0 "
        "codes: faster, top-1 agreement with exact >= 99%%); auto: int16 on the CPU unless --dtype float32 "
        "(default %(default)s)",
    )
    p.add_argument(
        "--kv-cache-gb",
        type=float,
        default=defaults.kv_cache_bytes / (1 << 30),
        help="memory for the paged KV cache in GiB (default %(default)s)",
    )
    p.add_argument(
        "--block-size", type=int, default=defaults.block_size, help="tokens per KV block (default %(default)s)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults.max_num_batched_tokens,
        help="most tokens one step may compute (default %(default)s)",
    )
    p.add_argument(
        "--no-batch-invariant",
        action="store_true",
        default=not defaults.batch_invariant,
        help="let batch composition change results in the last bits (slightly faster at batch size 1)",
    )
    p.add_argument(
        "--threads", type=int, default=defaults.num_threads, help="torch intra-op threads (default: torch's choice)"
    )
    p.add_argument(
        "--max-draft-tokens",
        type=int,
        default=defaults.max_draft_tokens,
        help="most draft tokens one request verifies per step (default %(default)s)",
    )
    p.add_argument(
        "--num-state-slots",
        type=int,
        default=defaults.num_state_slots,
        help="hybrid models (Qwen3.5): recurrent-state slots, the most requests computed at once; "
        "their memory comes out of the KV budget (default %(default)s)",
    )
    p.add_argument(
        "--num-state-snapshots",
        type=int,
        default=defaults.num_state_snapshots,
        help="hybrid models: recurrent-state snapshots at block boundaries, what their prefix cache resumes from "
        "(each the size of a slot, out of the KV budget; default: one per slot, within a quarter of what the slots leave)",
    )
    p.add_argument(
        "--swarm-index",
        action="store_true",
        default=defaults.use_swarm_index,
        help="also draft from other requests' outputs",
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        default=not defaults.enable_prefix_caching,
        help="recompute every prompt instead of reusing cached KV blocks of equal prefixes",
    )
    p.add_argument(
        "--no-decode-graphs",
        action="store_true",
        default=not defaults.decode_graphs,
        help="on a GPU, launch every decode step's kernels from Python instead of replaying captured graphs",
    )
    p.add_argument(
        "--no-calibration",
        action="store_true",
        help="skip timing forward passes at start-up (the scheduler's cost model then starts from a prior)",
    )
    p.add_argument(
        "--log-format",
        default="auto",
        choices=LOG_FORMATS,
        help="auto: console on a terminal, else JSON lines (default %(default)s)",
    )
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--scheduler-token-file",
        default=None,
        help="serve only callers sending 'authorization: Bearer <token>' with a token from this file "
        "(the scheduler's --executor-token-file); health checks stay open (default: no token needed)",
    )
    p.add_argument("--tls-cert", default=None, help="serve over TLS with this certificate (PEM; with --tls-key)")
    p.add_argument("--tls-key", default=None, help="the private key of --tls-cert (PEM)")
    add_observability_flags(p)
    return p


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kernels=args.kernels,
        matmul=args.matmul,
        kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)),
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        batch_invariant=not args.no_batch_invariant,
        num_threads=args.threads,
        max_draft_tokens=args.max_draft_tokens,
        num_state_slots=args.num_state_slots,
        num_state_snapshots=args.num_state_snapshots,
        use_swarm_index=args.swarm_index,
        enable_prefix_caching=not args.no_prefix_caching,
        decode_graphs=not args.no_decode_graphs,
    )
