"""What runs after the encoder: pooling and Dense, SPLADE sparse weights, multi-vector (ColBERT) outputs."""
