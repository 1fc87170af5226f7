"""Histogram buckets both services share, so their histograms line up on one dashboard."""

# A step is ~5-50 ms on a GPU, up to seconds for a long prefill on a CPU.
STEP_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
# Tokens computed per step: 1 (one decode) up to a full prefill budget.
STEP_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# Requests per step: agent swarms swing between 1 and a dozen.
BATCH_SIZE = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Latencies a streaming client sees.
TTFT_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
