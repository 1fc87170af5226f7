"""The weights side: the GGUF file, its model config and tokenizer, and the matmul weights kept in
their GGUF storage types."""
