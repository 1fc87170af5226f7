"""The step timeline as a PNG: step time, batch size, tokens per step and drafts over time.

matplotlib is imported here only (the `plot` extra), through `Figure` rather than
pyplot so no display or global figure state is involved.
"""

from __future__ import annotations

from pathlib import Path


def plot_timeline(timeline, path: Path) -> None:
    """`timeline`: a GetTimelineResponse."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("the PNG needs matplotlib: pip install 'swarmserve[plot]'") from None

    steps = list(timeline.steps)
    origin = steps[0].start_time_s if steps else 0.0
    t = [s.start_time_s - origin for s in steps]
    fig = Figure(figsize=(11, 10), constrained_layout=True)
    ax_time, ax_batch, ax_tokens, ax_drafts = fig.subplots(4, 1, sharex=True)

    def line(ax, values, label, **style):
        ax.plot(t, values, label=label, drawstyle="steps-post", linewidth=1, **style)

    line(ax_time, [s.duration_s * 1e3 for s in steps], "actual (plan sent → result back)")
    line(
        ax_time,
        [(s.executor_prepare_s + s.executor_forward_s + s.executor_sample_s) * 1e3 for s in steps],
        "executor compute",
    )
    line(ax_time, [s.predicted_duration_s * 1e3 for s in steps], "predicted (cost model)", linestyle="--")
    ax_time.set_ylabel("step time (ms)")

    line(ax_batch, [s.num_requests for s in steps], "requests in the step")
    ax_batch.set_ylabel("batch size")

    line(ax_tokens, [s.num_prefill_tokens for s in steps], "prefill")
    line(ax_tokens, [s.num_decode_tokens for s in steps], "decode")
    line(ax_tokens, [s.num_drafted_tokens for s in steps], "draft (verified)")
    ax_tokens.set_ylabel("tokens per step")

    line(ax_drafts, [s.num_draft_tokens for s in steps], "allocated")
    line(ax_drafts, [s.num_drafted_tokens for s in steps], "drafted")
    line(ax_drafts, [s.num_accepted_tokens for s in steps], "accepted")
    line(ax_drafts, [s.num_free_tokens for s in steps], "free-token budget S", linestyle=":")
    ax_drafts.set_ylabel("draft tokens")
    ax_drafts.set_xlabel("seconds since the first step shown")

    for ax in (ax_time, ax_batch, ax_tokens, ax_drafts):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize="small")
    first, last = (steps[0].step_id, steps[-1].step_id) if steps else (0, 0)
    fig.suptitle(f"swarmserve steps {first}–{last} ({len(steps)} steps)")
    fig.savefig(path, dpi=100)
