"""Attention over packed rows: masks from segment ids and positions, and the kernels that apply them.

Every family calls `attend(q, k, v, masks, spec, scale)`. Nobody passes a mask
in: it follows from the row's segment ids (0 = padding, 1..K = documents) and
positions (restarting at 0 for each document). A query sees the keys of its
own document only (a negative id -k: a query of document k that is no key, see `same_document`), and per layer kind (`Spec`) only earlier keys (causal)
and/or keys within a window, counted in the document's own positions, so
packed rows stay exact for every family.

A family with a per-head score bias (MPNet's relative position buckets) passes
`score_bias`, a function of the query's and key's positions (`ScoreBias`): it
sees the document's own positions too, so packed rows stay exact with it.

Implementations, chosen per bucket by `choose` (static, compiled in):
- `dense`: scores [B, N, S, S] with an additive float32 bias made once per
  forward per spec. Written for XLA CPU, which hands the whole attention of a
  layer to one YNNPACK fusion (see `_dense`).
- `blockwise`: queries and keys in blocks with a running (online) softmax:
  memory grows with block², not S². A query block visits only the key blocks
  its rule can reach (up to its own block when causal, its window's span when
  sliding), so windowed layers cost S * window, not S².
- `pallas`: the Pallas GPU flash-attention kernel (fused, no score matrix in
  memory) for the layers it can express: segment ids and causal. A layer with a
  sliding window or a score bias falls back to `dense` or `blockwise` (by
  seqlen); grouped-query heads are repeated to the query heads' count.

Skipping key blocks (blockwise) and the kernel's causal rule (pallas) count in
row slots, where the masks count in document positions: both agree because a
document occupies consecutive slots with consecutive positions from 0, as
packing lays it out. Padding queries (segment 0) see other keys per kernel;
their outputs are never pooled, and no real query sees a padding key.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxserve.buckets import blockwise_block

IMPLEMENTATIONS = ("dense", "blockwise", "pallas")
# Finite, and far below any real score: adding it absorbs the score (s + MASKED == MASKED
# in float32), and a query with every key masked gets a uniform softmax, not NaN.
MASKED = -1e30
DENSE_MAX_SEQLEN = 256  # past this blockwise is faster on CPU (and dense scores [B, N, S, S] grow as S²)
KEY_BLOCK = 256  # queries and keys per block of the blockwise kernel
# The Pallas kernel tiles queries and keys alike: a power of two (Triton) dividing the seqlen,
# at most its default tile, at least the smallest tile Triton's dot takes.
PALLAS_MAX_BLOCK = 128
PALLAS_MIN_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class Spec:
    """Which keys a query may see within its document (positions count within the document)."""

    causal: bool = False  # only keys at or before the query
    window: int | None = None  # only keys with |query position - key position| < window (sliding window)


FULL = Spec()

# (query positions [B, Sq], key positions [B, Sk]) -> float32 [B, N, Sq, Sk], added to the scaled
# scores. A function, not an array, so that the blockwise kernel can make it one key block at a time.
ScoreBias = Callable[[jax.Array, jax.Array], jax.Array]


def choose(platform: str, seqlen: int) -> str:
    """The implementation for one bucket: on a GPU the fused Pallas kernel where it tiles the
    seqlen; elsewhere dense while its scores are small, blockwise past that."""
    if platform == "gpu" and pallas_block(seqlen):
        return "pallas"
    return "dense" if seqlen <= DENSE_MAX_SEQLEN else "blockwise"


def pallas_block(seqlen: int) -> int:
    """The Pallas kernel's tile for this seqlen (0 where none fits)."""
    block = PALLAS_MAX_BLOCK
    while block >= PALLAS_MIN_BLOCK and seqlen % block:
        block //= 2
    return block if block >= PALLAS_MIN_BLOCK else 0


class Masks:
    """The mask inputs of one forward; each spec's dense bias is made once and shared by the layers."""

    def __init__(self, segment_ids: jax.Array, positions: jax.Array, packed: bool = True, impl: str = "dense"):
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"unknown attention implementation {impl!r}; choose from {', '.join(IMPLEMENTATIONS)}")
        self.segment_ids = segment_ids  # [B, S]
        self.positions = positions  # [B, S]
        self.packed = packed
        self.impl = impl
        self._bias: dict[tuple[Spec, ScoreBias | None], jax.Array] = {}

    def bias(self, spec: Spec, score_bias: ScoreBias | None = None) -> jax.Array:
        """[B, 1, S or 1, S] float32: 0 where a query sees a key, MASKED where not.

        With `score_bias`, [B, N, S, S]: the mask bias plus the score bias, made once per
        forward when every layer passes the same function object.
        """
        key = (spec, score_bias)
        if key not in self._bias:
            if score_bias is None:
                self._bias[key] = attention_bias(visible(self.segment_ids, self.positions, self.segment_ids,
                                                         self.positions, spec, self.packed)[:, None])
            else:
                self._bias[key] = self.bias(spec) + score_bias(self.positions, self.positions)
        return self._bias[key]


def visible(seg_q, pos_q, seg_k, pos_k, spec: Spec, packed: bool = True) -> jax.Array:
    """Boolean [B, Sq or 1, Sk]: query i sees key j (its own document, the spec's rule; padding sees itself).

    With one document per row and no causal or window rule only padding keys
    need hiding, so a [B, 1, Sk] key mask is enough (padding queries see the
    document; their outputs are never pooled).
    """
    if not packed and spec == FULL:
        return (seg_k > 0)[:, None, :]  # [B, 1, Sk]
    ok = same_document(seg_q, pos_q, seg_k, pos_k, spec)
    if seg_q.shape[1] == seg_k.shape[1]:  # padding queries see themselves: no row is all-masked
        ok |= jnp.eye(seg_q.shape[1], dtype=bool)[None] & (seg_q == 0)[:, :, None]
    return ok


def same_document(seg_q, pos_q, seg_k, pos_k, spec: Spec) -> jax.Array:
    """Boolean [B, Sq, Sk]: the key is a real token of the query's document that the spec lets it see.

    A token of segment -k (a multi-vector query's expansion token, `jaxserve.multivector`) is a query of
    document k but no key of any."""
    ok = (jnp.abs(seg_q)[:, :, None] == seg_k[:, None, :]) & (seg_k > 0)[:, None, :]  # [B, Sq, Sk]
    delta = pos_q[:, :, None] - pos_k[:, None, :]  # query position - key position, within a document
    if spec.causal:
        ok &= delta >= 0
    if spec.window is not None:
        ok &= jnp.abs(delta) < spec.window
    return ok


def attention_bias(mask: jax.Array) -> jax.Array:
    """Boolean mask -> additive float32 bias (0 where seen, MASKED where hidden)."""
    return jnp.where(mask, 0.0, MASKED).astype(jnp.float32)


def attend(q, k, v, masks: Masks, spec: Spec = FULL, scale: float | None = None,
           score_bias: ScoreBias | None = None) -> jax.Array:
    """q [B, S, N, H], k and v [B, S, KV, H] (N a multiple of KV: grouped-query) -> [B, S, N, H].

    `scale` multiplies q (default 1/sqrt(H)). Scores and softmax are float32
    whatever the activations' dtype. `score_bias` is added to the scaled scores;
    pass the same function object to every layer so the dense bias is made once.
    """
    scale = (1.0 / float(q.shape[-1]) ** 0.5) if scale is None else scale
    q = q * jnp.asarray(scale, q.dtype)
    impl = masks.impl
    if impl == "pallas" and not pallas_fits(q.shape, spec, score_bias):
        impl = "dense" if q.shape[1] <= DENSE_MAX_SEQLEN else "blockwise"
    if impl == "dense":
        return _dense(q, k, v, masks.bias(spec, score_bias))
    if impl == "pallas":
        return _pallas(q, k, v, masks, spec)
    return _blockwise(q, k, v, masks, spec, score_bias)


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
        # [B, 1, 1, S or 1, S]; a score bias's heads as [B, KV, G, S, S]
        bias = bias[:, :, None] if bias.shape[1] == 1 else bias.reshape(b, kv, n // kv, *bias.shape[2:])
    else:
        qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # [B, N, S, H]
    scores = jnp.matmul(qt, kt.swapaxes(-1, -2), preferred_element_type=jnp.float32) + bias
    p = jnp.exp(scores - scores.max(-1, keepdims=True))
    out = jnp.matmul(p.astype(v.dtype), vt, preferred_element_type=jnp.float32) / p.sum(-1, keepdims=True)
    out = out.astype(v.dtype)
    if kv != n:
        return out.transpose(0, 3, 1, 2, 4).reshape(b, s, n, h)
    return out.transpose(0, 2, 1, 3)


def _blockwise(q, k, v, masks: Masks, spec: Spec, score_bias: ScoreBias | None = None, block: int = KEY_BLOCK):
    """Query blocks in a loop, each with a running max and sum over the key blocks it can reach
    (online softmax): holds [B, N, block, block] scores at a time, never [S, S] (a score bias
    is made per block pair, in every layer). Blocks are sliced from q, k and v as they are
    (no block-major copies), and each query block's output is written in place."""
    b, s, n, h = q.shape
    kv = k.shape[2]
    g = n // kv
    block = blockwise_block(s, block)
    pad = -s % block
    sp, nb = s + pad, (s + pad) // block
    q, k, v, seg, pos = map(jnp.asarray, (q, k, v, masks.segment_ids, masks.positions))
    if pad:  # padding slots: segment 0, seen by no real query
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        seg, pos = (jnp.pad(x, ((0, 0), (0, pad))) for x in (seg, pos))
    slot = jnp.arange(sp, dtype=jnp.int32)  # [S] each slot's index in the row
    take = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=min(x.ndim - 1, 1))  # block i of S

    def query_block(i, qo):
        # qo: q, each block overwritten by its output once read (no [B, S, N, H] buffer of its own).
        # A query block's G heads of one KV head are one [G * blk, H] matrix against that head's keys.
        q_i = take(qo, i).reshape(b, block, kv, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * block, h)
        seg_q, pos_q, slot_q = take(seg, i), take(pos, i), take(slot, i)  # [B, blk], [B, blk], [blk]

        def key_block(j, carry):
            m, l, acc = carry  # [B, KV, G*blk], [B, KV, G*blk], [B, KV, G*blk, H] float32
            k_j, v_j = (take(x, j).transpose(0, 2, 1, 3) for x in (k, v))  # [B, KV, blk, H]
            seg_k, pos_k = take(seg, j), take(pos, j)
            scores = jnp.einsum("bkqh,bkth->bkqt", q_i, k_j, preferred_element_type=jnp.float32)
            scores = scores.reshape(b, kv, g, block, block)
            if score_bias is not None:
                scores = scores + score_bias(pos_q, pos_k).reshape(b, kv, g, block, block)
            itself = (slot_q[:, None] == take(slot, j)[None, :])[None] & (seg_q == 0)[:, :, None]  # padding
            ok = same_document(seg_q, pos_q, seg_k, pos_k, spec) | itself  # [B, blk, blk]
            scores = jnp.where(ok[:, None, None], scores, MASKED).reshape(b, kv, g * block, block)
            m_new = jnp.maximum(m, scores.max(-1))
            p = jnp.exp(scores - m_new[..., None])
            correction = jnp.exp(m - m_new)
            pv = jnp.einsum("bkqt,bkth->bkqh", p.astype(v.dtype), v_j, preferred_element_type=jnp.float32)
            return m_new, l * correction + p.sum(-1), acc * correction[..., None] + pv

        init = (jnp.full((b, kv, g * block), MASKED, jnp.float32), jnp.zeros((b, kv, g * block), jnp.float32),
                jnp.zeros((b, kv, g * block, h), jnp.float32))
        m, l, acc = jax.lax.fori_loop(*key_blocks(i, block, nb, spec), key_block, init)
        o_i = (acc / l[..., None]).astype(v.dtype)  # l >= 1: the running max's own term
        o_i = o_i.reshape(b, kv, g, block, h).transpose(0, 3, 1, 2, 4).reshape(b, block, n, h)
        return jax.lax.dynamic_update_slice_in_dim(qo, o_i.astype(qo.dtype), i * block, axis=1)

    out = jax.lax.fori_loop(0, nb, query_block, q)  # [B, S, N, H]
    return out[:, :s].astype(v.dtype)


def key_blocks(i, block: int, nblocks: int, spec: Spec):
    """[lo, hi): the key blocks that query block i can reach (a document's slots are consecutive).

    Causal: none past its own block. Sliding window w: slots within w - 1 of its
    first and last query. Otherwise all of them (static bounds)."""
    lo, hi = 0, nblocks
    if spec.window is not None:
        reach = spec.window - 1
        lo = jnp.maximum(i * block - reach, 0) // block
        hi = jnp.minimum((i + 1) * block - 1 + reach, nblocks * block - 1) // block + 1
    if spec.causal:
        hi = i + 1
    return lo, hi


def pallas_fits(shape: tuple[int, ...], spec: Spec, score_bias: ScoreBias | None) -> bool:
    """The Pallas kernel takes this layer: no window, no score bias, a tiled seqlen, head dim >= 16."""
    _, s, _, h = shape
    return spec.window is None and score_bias is None and bool(pallas_block(s)) and h >= PALLAS_MIN_BLOCK


def _pallas(q, k, v, masks: Masks, spec: Spec):
    """The Pallas GPU flash-attention kernel: segment ids and causal in the kernel, q already scaled.

    It wants as many KV heads as query heads: grouped heads are repeated (a [B, S, N, H]
    copy per layer, small beside the scores it saves). On a CPU backend it runs in
    Pallas' interpreter (tests at tiny shapes only; `choose` never picks it there).
    """
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    n, kv = q.shape[2], k.shape[2]
    if kv != n:
        k, v = (jnp.repeat(x, n // kv, axis=2) for x in (k, v))
    block = pallas_block(q.shape[1])
    return pallas_attention.mha(
        q, k, v, jnp.asarray(masks.segment_ids, jnp.int32), sm_scale=1.0, causal=spec.causal,
        block_sizes=pallas_attention.BlockSizes(block_q=block, block_k=block),
        interpret=jax.default_backend() == "cpu",
    )
