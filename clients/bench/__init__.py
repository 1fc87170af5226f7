"""Benchmarks that drive a running (or self-started) swarmserve over gRPC."""
