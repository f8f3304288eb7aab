"""Attention over packed rows: masks from segment ids and positions, and the kernels that apply them.

Every family calls `attend(q, k, v, masks, spec, scale)`. Nobody passes a mask
in: it follows from the row's segment ids (0 = padding, 1..K = documents) and
positions (restarting at 0 for each document). A query sees the keys of its
own document only, and per layer kind (`Spec`) only earlier keys (causal)
and/or keys within a window, counted in the document's own positions, so
packed rows stay exact for every family.

Implementations, chosen per bucket by `choose` (static, compiled in):
- `dense`: scores [B, N, S, S] with an additive float32 bias made once per
  forward per spec. Written for XLA CPU, which hands the whole attention of a
  layer to one YNNPACK fusion (see `_dense`).
- `blockwise`: keys in blocks with a running (online) softmax: memory grows
  with S * block, not S², for long seqlens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("dense", "blockwise")
# Finite, and far below any real score: adding it absorbs the score (s + MASKED == MASKED
# in float32), and a query with every key masked gets a uniform softmax, not NaN.
MASKED = -1e30
DENSE_MAX_SEQLEN = 1024  # past this the [B, N, S, S] scores dominate memory: go blockwise
KEY_BLOCK = 512  # keys per block of the blockwise kernel


@dataclasses.dataclass(frozen=True)
class Spec:
    """Which keys a query may see within its document (positions count within the document)."""

    causal: bool = False  # only keys at or before the query
    window: int | None = None  # only keys with |query position - key position| < window (sliding window)


FULL = Spec()


def choose(platform: str, seqlen: int) -> str:
    """The implementation for one bucket: dense while its scores are small, blockwise past that."""
    return "dense" if seqlen <= DENSE_MAX_SEQLEN else "blockwise"


class Masks:
    """The mask inputs of one forward; each spec's dense bias is made once and shared by the layers."""

    def __init__(self, segment_ids: jax.Array, positions: jax.Array, packed: bool = True, impl: str = "dense"):
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"unknown attention implementation {impl!r}; choose from {', '.join(IMPLEMENTATIONS)}")
        self.segment_ids = segment_ids  # [B, S]
        self.positions = positions  # [B, S]
        self.packed = packed
        self.impl = impl
        self._bias: dict[Spec, jax.Array] = {}

    def bias(self, spec: Spec) -> jax.Array:
        """[B, 1, S or 1, S] float32: 0 where a query sees a key, MASKED where not."""
        if spec not in self._bias:
            self._bias[spec] = attention_bias(visible(self.segment_ids, self.positions, self.segment_ids,
                                                      self.positions, spec, self.packed)[:, None])
        return self._bias[spec]


def visible(seg_q, pos_q, seg_k, pos_k, spec: Spec, packed: bool = True) -> jax.Array:
    """Boolean [B, Sq or 1, Sk]: query i sees key j (its own document, the spec's rule; padding sees itself).

    With one document per row and no causal or window rule only padding keys
    need hiding, so a [B, 1, Sk] key mask is enough (padding queries see the
    document; their outputs are never pooled).
    """
    real_k = (seg_k != 0)[:, None, :]  # [B, 1, Sk]
    if not packed and spec == FULL:
        return real_k
    ok = (seg_q[:, :, None] == seg_k[:, None, :]) & real_k  # [B, Sq, Sk]
    delta = pos_q[:, :, None] - pos_k[:, None, :]  # query position - key position, within a document
    if spec.causal:
        ok &= delta >= 0
    if spec.window is not None:
        ok &= jnp.abs(delta) < spec.window
    if seg_q.shape[1] == seg_k.shape[1]:  # padding queries see themselves: no row is all-masked
        ok |= jnp.eye(seg_q.shape[1], dtype=bool)[None] & (seg_q == 0)[:, :, None]
    return ok


def attention_bias(mask: jax.Array) -> jax.Array:
    """Boolean mask -> additive float32 bias (0 where seen, MASKED where hidden)."""
    return jnp.where(mask, 0.0, MASKED).astype(jnp.float32)


def attend(q, k, v, masks: Masks, spec: Spec = FULL, scale: float | None = None) -> jax.Array:
    """q [B, S, N, H], k and v [B, S, KV, H] (N a multiple of KV: grouped-query) -> [B, S, N, H].

    `scale` multiplies q (default 1/sqrt(H)). Scores and softmax are float32
    whatever the activations' dtype.
    """
    scale = (1.0 / float(q.shape[-1]) ** 0.5) if scale is None else scale
    q = q * jnp.asarray(scale, q.dtype)
    if masks.impl == "dense":
        return _dense(q, k, v, masks.bias(spec))
    return _blockwise(q, k, v, masks, spec)


def _dense(q, k, v, bias):
    """All scores at once. Written so that XLA CPU hands the whole of it (both matmuls and
    the softmax) to one YNNPACK fusion per layer: that fusion takes full-shape operands
    only, so the mask is an additive bias (a boolean select does not fuse) and the scale
    was folded into q (on the scores XLA broadcast the scalar to a [B, N, S, S] buffer).
    The softmax is normalised after the PV product."""
    b, s, n, h = q.shape
    kv = k.shape[2]
    if kv != n:  # grouped-query: [B, S, KV, G, H] against each KV head's keys
        q = q.reshape(b, s, kv, n // kv, h)
        qt = q.transpose(0, 2, 3, 1, 4)  # [B, KV, G, S, H]
        kt, vt = (x.transpose(0, 2, 1, 3)[:, :, None] for x in (k, v))  # [B, KV, 1, S, H]
        bias = bias[:, :, None]  # [B, 1, 1, S or 1, S]
    else:
        qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # [B, N, S, H]
    scores = jnp.matmul(qt, kt.swapaxes(-1, -2), preferred_element_type=jnp.float32) + bias
    p = jnp.exp(scores - scores.max(-1, keepdims=True))
    out = jnp.matmul(p.astype(v.dtype), vt, preferred_element_type=jnp.float32) / p.sum(-1, keepdims=True)
    out = out.astype(v.dtype)
    if kv != n:
        return out.transpose(0, 3, 1, 2, 4).reshape(b, s, n, h)
    return out.transpose(0, 2, 1, 3)


def _blockwise(q, k, v, masks: Masks, spec: Spec, block: int = KEY_BLOCK):
    """Keys in blocks with a running max and sum (online softmax): never holds [S, S] scores."""
    b, s, n, h = q.shape
    kv = k.shape[2]
    block = min(block, s)
    pad = -s % block
    seg, pos = masks.segment_ids, masks.positions
    if pad:
        k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (k, v))
        seg_k, pos_k = jnp.pad(seg, ((0, 0), (0, pad))), jnp.pad(pos, ((0, 0), (0, pad)))
    else:
        seg_k, pos_k = seg, pos
    nblocks = (s + pad) // block
    qg = q.reshape(b, s, kv, n // kv, h).astype(jnp.float32)  # [B, S, KV, G, H]
    kb = k.reshape(b, nblocks, block, kv, h).swapaxes(0, 1)  # [nb, B, blk, KV, H]
    vb = v.reshape(b, nblocks, block, kv, h).swapaxes(0, 1)
    segb = seg_k.reshape(b, nblocks, block).swapaxes(0, 1)  # [nb, B, blk]
    posb = pos_k.reshape(b, nblocks, block).swapaxes(0, 1)

    def step(carry, xs):
        m, l, acc = carry  # [B, S, KV, G], [B, S, KV, G], [B, S, KV, G, H]
        kj, vj, sj, pj = xs
        scores = jnp.einsum("bskgh,btkh->bskgt", qg, kj.astype(jnp.float32))  # [B, S, KV, G, blk]
        ok = visible(seg, pos, sj, pj, spec, packed=True)  # [B, S, blk]
        scores = jnp.where(ok[:, :, None, None, :], scores, MASKED)
        m_new = jnp.maximum(m, scores.max(-1))
        p = jnp.exp(scores - m_new[..., None])
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(-1)
        acc = acc * correction[..., None] + jnp.einsum("bskgt,btkh->bskgh", p, vj.astype(jnp.float32))
        return (m_new, l, acc), None

    g = n // kv
    init = (jnp.full((b, s, kv, g), MASKED, jnp.float32), jnp.zeros((b, s, kv, g), jnp.float32),
            jnp.zeros((b, s, kv, g, h), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(step, init, (kb, vb, segb, posb))
    # A padding query sees no key here (it is not its own key in another block): l = 0; its output is unused.
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.reshape(b, s, n, h).astype(v.dtype)
