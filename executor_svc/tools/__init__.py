"""Scripts a person runs (benchmarks, the GPU check) and the random-model helper they and the tests share."""
