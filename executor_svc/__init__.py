"""swarmserve executor: the stateful half (device, GGUF weights, paged KV cache, sampler)."""
