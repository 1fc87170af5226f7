"""Sampling and speculation: the sampler, the grammar masks, the n-gram drafter and the lossless verifier."""
