"""jaxserve: transformer encoders served at static-shape buckets with JAX/XLA."""

from jaxserve.encoder import Encoder

__all__ = ["Encoder"]
__version__ = "0.1.0"
