"""Per-document pooling of token states, for rows that hold one or several documents.

All modes are masks over the segment ids, so shapes stay static: a row with
fewer than K documents yields zero vectors in its unused slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_onehot(segment_ids: jax.Array, num_segments: int) -> jax.Array:
    """[B, S] ids (0 = pad, 1..K) -> [B, S, K] float32 membership."""
    slots = jnp.arange(1, num_segments + 1, dtype=segment_ids.dtype)
    return (segment_ids[:, :, None] == slots).astype(jnp.float32)


def pool(mode: str, hidden_bsd, segment_ids, positions, num_segments: int) -> jax.Array:
    """[B, S, D] states -> [B, K, D] float32 document vectors."""
    h = hidden_bsd.astype(jnp.float32)
    member = segment_onehot(segment_ids, num_segments)  # [B, S, K]
    count = member.sum(axis=1)  # [B, K]
    if mode == "mean":
        total = jnp.einsum("bsk,bsd->bkd", member, h)
        return total / jnp.maximum(count, 1.0)[..., None]
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

