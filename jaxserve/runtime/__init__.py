"""The device side: the bucket table and its derivation, compiling, timing and running each bucket, the warm artifact
and start-up. Knows nothing of requests."""
