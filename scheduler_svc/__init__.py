"""swarmserve scheduler: the front half (requests, prompts, step plans); it holds no weights."""
