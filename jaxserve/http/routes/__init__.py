"""Routes per API family: OpenAI's and vLLM's, TEI's, multi-vector, operations (health, info, metrics)."""
