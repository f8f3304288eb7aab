"""jaxserve: transformer encoders served at static-shape buckets with JAX/XLA.

The package by layer, each importing only those listed before it (tests/test_layers.py):
`errors`, `dims` (the base) -> `models/` -> `checkpoint/` -> `heads/` -> `runtime/` -> `scheduling/`
-> `encoder` (the Python API) -> `offline/` -> `http/` -> `integrations/` -> `cli`. docs/design.md has the map.
"""

__all__ = ["Encoder"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # `from jaxserve import Encoder` without importing JAX for every `import jaxserve.<module>`: the pure layers
    # (bucket math, planning, batching, validation) stay importable without it.
    if name == "Encoder":
        from jaxserve.encoder import Encoder

        return Encoder
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
