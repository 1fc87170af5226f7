"""The KV side: the block allocator and prefix cache, the paged KV cache, the recurrent-state pool
and its snapshots, and the KV manager over them."""
