"""Reading a checkpoint: resolving a model name, its weights, its configs and its tokenizer (below the heads)."""
