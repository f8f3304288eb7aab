"""Per-document pooling of token states for rows that hold one or several documents, and the Dense layers after it.

All modes are masks over the segment ids, so shapes stay static: a row with
fewer than K documents yields zero vectors in its unused slots. Modes follow
sentence-transformers' Pooling; several modes ("cls+mean") are concatenated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DENSE_ACTIVATIONS = {
    "identity": lambda x: x,
    "tanh": jnp.tanh,
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "sigmoid": jax.nn.sigmoid,
    "silu": jax.nn.silu,
}


# Every float32 dot after the encoder (pooling, Dense, SPLADE head): a GPU's default, TF32, keeps 10 mantissa bits.
HIGHEST = jax.lax.Precision.HIGHEST


def segment_onehot(segment_ids: jax.Array, num_segments: int) -> jax.Array:
    """[B, S] ids (0 = pad, 1..K) -> [B, S, K] float32 membership."""
    return _inside(segment_ids, num_segments).astype(jnp.float32)


def _inside(segment_ids: jax.Array, num_segments: int) -> jax.Array:
    """[B, S] ids -> [B, S, K] bool: token s belongs to slot k."""
    slots = jnp.arange(1, num_segments + 1, dtype=segment_ids.dtype)
    return segment_ids[:, :, None] == slots


def pool(modes: str, hidden_bsd, segment_ids, positions, num_segments: int) -> jax.Array:
    """[B, S, D] states -> [B, K, D x modes] float32 document vectors (modes "+"-joined, concatenated).

    Exact on every device: token counts and the cls/last token's place come from integer ops (a
    float dot of counts holds integers only to 2048 in TF32), and the weighted sums are HIGHEST."""
    h = hidden_bsd.astype(jnp.float32)
    inside = _inside(segment_ids, num_segments)  # [B, S, K]
    count = inside.sum(axis=1, dtype=jnp.int32)  # [B, K]
    return jnp.concatenate([_pool_one(m, h, inside, count, positions, num_segments) for m in modes.split("+")], -1)


def _pool_one(mode: str, h, inside, count, positions, num_segments: int) -> jax.Array:
    member = inside.astype(jnp.float32)  # [B, S, K]
    if mode in ("mean", "mean_sqrt_len_tokens"):
        total = jnp.einsum("bsk,bsd->bkd", member, h, precision=HIGHEST)
        n = jnp.maximum(count.astype(jnp.float32), 1e-9)
        return total / (n if mode == "mean" else jnp.sqrt(n))[..., None]
    if mode == "weightedmean":  # token i of a document weighs i + 1
        weights = member * (positions + 1).astype(jnp.float32)[..., None]  # [B, S, K]
        total = jnp.einsum("bsk,bsd->bkd", weights, h, precision=HIGHEST)
        return total / jnp.maximum(weights.sum(1), 1e-9)[..., None]
    if mode == "max":
        # One masked reduction per slot: never materialises a [B, S, K, D] tensor.
        slot_max = [jnp.where(inside[:, :, k : k + 1], h, -jnp.inf).max(axis=1) for k in range(num_segments)]
        return jnp.where(count[..., None] > 0, jnp.stack(slot_max, axis=1), 0.0)  # [B, K, D]
    pos = positions[:, :, None]  # [B, S, 1]
    if mode == "cls":
        at = inside & (pos == 0)
    elif mode == "lasttoken":
        last = jnp.max(jnp.where(inside, pos, -1), axis=1)  # [B, K] each document's last position
        at = inside & (pos == last[:, None, :])
    else:
        raise ValueError(f"unknown pooling mode {mode!r}")
    index = jnp.argmax(at.astype(jnp.int32), axis=1)  # [B, K] the picked token's place in the row
    picked = jnp.take_along_axis(h, index[..., None], axis=1)  # [B, K, D]: a gather, exact
    return jnp.where(at.any(axis=1)[..., None], picked, 0.0)


def dense_layers(layers, params, x):
    """sentence-transformers' Dense modules in turn on pooled vectors [B, K, D] (float32), or on token vectors
    [B, S, D] (multi-vector), their dots at HIGHEST precision as the pooling's."""
    for layer, p in zip(layers, params):
        y = jnp.matmul(x, p["kernel"], precision=HIGHEST)
        if "bias" in p:
            y = y + p["bias"]
        y = DENSE_ACTIVATIONS[layer.activation](y)
        if layer.residual:
            y = y + (jnp.matmul(x, p["residual"], precision=HIGHEST) if "residual" in p else x)
        x = y
    return x
