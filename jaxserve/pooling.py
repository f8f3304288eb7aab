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


def segment_onehot(segment_ids: jax.Array, num_segments: int) -> jax.Array:
    """[B, S] ids (0 = pad, 1..K) -> [B, S, K] float32 membership."""
    slots = jnp.arange(1, num_segments + 1, dtype=segment_ids.dtype)
    return (segment_ids[:, :, None] == slots).astype(jnp.float32)


def pool(modes: str, hidden_bsd, segment_ids, positions, num_segments: int) -> jax.Array:
    """[B, S, D] states -> [B, K, D x modes] float32 document vectors (modes "+"-joined, concatenated)."""
    h = hidden_bsd.astype(jnp.float32)
    member = segment_onehot(segment_ids, num_segments)  # [B, S, K]
    count = member.sum(axis=1)  # [B, K]
    return jnp.concatenate([_pool_one(m, h, member, count, positions, num_segments) for m in modes.split("+")], -1)


def _pool_one(mode: str, h, member, count, positions, num_segments: int) -> jax.Array:
    if mode in ("mean", "mean_sqrt_len_tokens"):
        total = jnp.einsum("bsk,bsd->bkd", member, h)
        denominator = jnp.maximum(count, 1e-9) if mode == "mean" else jnp.sqrt(jnp.maximum(count, 1e-9))
        return total / denominator[..., None]
    if mode == "weightedmean":  # token i of a document weighs i + 1
        weights = member * (positions + 1).astype(jnp.float32)[..., None]  # [B, S, K]
        return jnp.einsum("bsk,bsd->bkd", weights, h) / jnp.maximum(weights.sum(1), 1e-9)[..., None]
    if mode == "max":
        # One masked reduction per slot: never materialises a [B, S, K, D] tensor.
        slot_max = [jnp.where(member[:, :, k : k + 1] > 0, h, -jnp.inf).max(axis=1) for k in range(num_segments)]
        return jnp.where(count[..., None] > 0, jnp.stack(slot_max, axis=1), 0.0)  # [B, K, D]
    if mode == "cls":
        pick = member * (positions == 0)[..., None]
    elif mode == "lasttoken":
        length = jnp.einsum("bsk,bk->bs", member, count)  # [B, S] its document's length
        pick = member * (positions == length - 1)[..., None]
    else:
        raise ValueError(f"unknown pooling mode {mode!r}")
    return jnp.einsum("bsk,bsd->bkd", pick, h)


def dense_layers(layers, params, x):
    """sentence-transformers' Dense modules in turn on pooled vectors [B, K, D] (float32)."""
    for layer, p in zip(layers, params):
        y = x @ p["kernel"]
        if "bias" in p:
            y = y + p["bias"]
        y = DENSE_ACTIVATIONS[layer.activation](y)
        if layer.residual:
            y = y + (x @ p["residual"] if "residual" in p else x)
        x = y
    return x
