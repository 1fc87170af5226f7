"""Grammar-mask cost per step: what structured output adds to a decode step.

    python -m executor_svc.tools.bench_grammar [--model default] [--batch-sizes 1,16] [--steps 32]

B requests decode under a typical JSON schema (sampled at temperature 1, seeded, so
the masks vary as real output does) in the real engine; per decode step the engine
reports the time it spent computing and applying grammar masks (StepTimings.grammar_s,
part of its sample time). Printed: the median mask time per step, its share of the
median step, and the median step of the same B requests without a grammar.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from executor_svc.engine.engine import Engine, EngineConfig, ScheduledRequest, StepRequest
from executor_svc.engine.request_state import NewRequest
from service_common.sampling_params import SamplingParams
from service_common.structured_output import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
        },
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
PROMPT = "Describe a user as JSON: "


def decode_steps(
    engine: Engine, batch_size: int, num_steps: int, spec: StructuredOutput | None
) -> list[tuple[float, float]]:
    """(step wall time, grammar mask time) of each decode step while all B requests run."""
    prompt = engine.tokenizer.tokenizer.encode(PROMPT).ids
    requests = [
        NewRequest(
            f"b{i}",
            prompt,
            SamplingParams(temperature=1.0, seed=i),
            max_new_tokens=num_steps + 1,
            structured_output=spec,
        )
        for i in range(batch_size)
    ]
    engine.step(
        StepRequest(scheduled=[ScheduledRequest(r.request_id, len(prompt)) for r in requests], new_requests=requests)
    )
    running = {r.request_id for r in requests}
    timings = []
    while running:
        t0 = time.perf_counter()
        out = engine.step(StepRequest(scheduled=[ScheduledRequest(r, 1) for r in sorted(running)]))
        if len(out.outputs) == batch_size:
            timings.append((time.perf_counter() - t0, out.timings.grammar_s))
        running -= {o.request_id for o in out.outputs if o.finish_reason is not None}
    for request_id in running:
        engine.release(request_id)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per batch size")
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, kv_cache_bytes=256 << 20))
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    engine.grammars.matcher(spec)  # the token table and the compiled grammar are built once, not timed per step
    print(
        f"model {engine.model_config.name}, vocab {engine.model_config.vocab_size}, device {engine.model_runner.device}"
    )
    print("     B | mask ms/step (median, p90) | step ms with grammar | share | step ms without grammar")
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        decode_steps(engine, batch_size, 4, spec)  # warm up
        constrained = decode_steps(engine, batch_size, args.steps, spec)
        free = decode_steps(engine, batch_size, args.steps, None)
        masks = sorted(g for _, g in constrained)
        step = statistics.median(s for s, _ in constrained)
        mask = statistics.median(masks)
        p90 = masks[int(0.9 * (len(masks) - 1))]
        free_step = statistics.median(s for s, _ in free)
        print(
            f"{batch_size:6d} | {mask * 1e3:10.3f} {p90 * 1e3:10.3f}      | {step * 1e3:20.1f} | {mask / step:5.1%} | {free_step * 1e3:10.1f}"
        )


if __name__ == "__main__":
    main()
