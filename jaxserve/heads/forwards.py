"""The pure forwards the engine compiles, one per kind of output: the encoder's hidden states, then the head.

Each takes the Flax encoder module, the params tree and a batch of packed rows ({name: [B, S] int32}) and
returns float32 outputs per slot or per token. SPLADE's and the multi-vector forwards live beside their
heads (`sparse.sparse_forward`, `multivector.forward`); SPLADE's returns a second output, its spill (the full
weights that the engine keeps on the device unless a caller asks for them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.checkpoint.config import EmbeddingConfig
from jaxserve.heads.pooling import dense_layers, pool


def embed_forward(module, emb: EmbeddingConfig, num_segments: int, params, batch: dict) -> jax.Array:
    """Pure forward: a batch of packed rows -> [B, K, D'] float32 vectors: pooled, through the checkpoint's
    Dense layers (params["dense"]), not normalised."""
    encoder_params = {k: v for k, v in params.items() if k != "dense"}
    hidden = module.apply(
        {"params": encoder_params}, batch["token_ids"], batch["segment_ids"], batch["positions"], batch["type_ids"],
        packed=num_segments > 1,
    )  # [B, S, D]
    pooled = pool(emb.pooling, hidden, batch["segment_ids"], batch["positions"], num_segments)  # [B, K, D x modes]
    return dense_layers(emb.dense, params.get("dense", ()), pooled)


def tokens_forward(module, num_segments: int, params, batch: dict) -> jax.Array:
    """Pure forward: packed rows -> [B, S, D] float32 last hidden states, every token (TEI's /embed_all)."""
    encoder_params = {k: v for k, v in params.items() if k not in ("dense", "head", "mlm")}
    hidden = module.apply(
        {"params": encoder_params}, batch["token_ids"], batch["segment_ids"], batch["positions"], batch["type_ids"],
        packed=num_segments > 1,
    )
    return hidden.astype(jnp.float32)


def classify_forward(module, head, head_pooling: str, num_segments: int, params, batch: dict):
    """Pure forward: packed rows -> [B, K, L] float32 logits of each sequence (from the head's pooled token(s))."""
    encoder_params = {k: v for k, v in params.items() if k != "head"}
    hidden = module.apply(
        {"params": encoder_params}, batch["token_ids"], batch["segment_ids"], batch["positions"], batch["type_ids"],
        packed=num_segments > 1,
    )  # [B, S, D]
    pooled = pool(head_pooling, hidden, batch["segment_ids"], batch["positions"], num_segments)  # [B, K, D]
    return head.apply({"params": params["head"]}, pooled.astype(hidden.dtype)).astype(jnp.float32)
