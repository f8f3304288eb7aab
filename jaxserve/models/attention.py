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

Implementations (`IMPLEMENTATIONS`), chosen per bucket by `plan` (static, compiled in):
- `dense`: scores [B, N, S, S] with an additive float32 bias made once per
  forward per spec. Written for XLA CPU, which hands the whole attention of a
  layer to one YNNPACK fusion (see `_dense`).
- `blockwise`: queries and keys in blocks with a running (online) softmax:
  memory grows with block², not S². A query block visits only the key blocks
  its rule can reach (up to its own block when causal, its window's span when
  sliding), so windowed layers cost S * window, not S².
- `pallas`: the Pallas GPU flash-attention kernel (Triton; fused, no score
  matrix in memory): segment ids and causal in the kernel, tiles sized per
  head_dim and seqlen (`pallas_block`).
- `cudnn`: cuDNN's fused flash attention (XLA's `__cudnn$fmha` custom call):
  packed rows as cuDNN's ragged layout (`segment_layout`: each document's first
  slot and length), causal and causal sliding windows by mask type.
`dense` and `blockwise` are "xla" (what XLA compiles from jnp ops), chosen by
seqlen. A layer a fused kernel cannot express (a score bias; a window, or for
cuDNN a non-causal one) runs the xla implementation inside the same bucket;
grouped-query heads are repeated for Pallas. A bucket whose fused kernel fails
to compile is compiled again with the next candidate (`jaxserve.runtime.engine`).

Skipping key blocks (blockwise) and the kernel's causal rule (pallas) count in
row slots, where the masks count in document positions: both agree because a
document occupies consecutive slots with consecutive positions from 0, as
packing lays it out. Padding queries (segment 0) see other keys per kernel;
their outputs are never pooled, and no real query sees a padding key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Callable

import jax
import jax.numpy as jnp

from jaxserve.dims import blockwise_block

IMPLEMENTATIONS = ("dense", "blockwise", "pallas", "cudnn")
CHOICES = ("auto", "pallas", "cudnn", "xla", "blockwise")  # what `--attention` takes
# Finite, and far below any real score: adding it absorbs the score (s + MASKED == MASKED
# in float32), and a query with every key masked gets a uniform softmax, not NaN.
MASKED = -1e30
DENSE_MAX_SEQLEN = 256  # past this blockwise is faster on CPU (and dense scores [B, N, S, S] grow as S²)
KEY_BLOCK = 256  # queries and keys per block of the blockwise kernel
# Pallas tiles (queries and keys alike): the sizes upstream tests the kernel at, largest first. Below
# the smallest (the minimum tile), XLA: Hopper's wgmma works on 64-row tiles, and a seqlen under 64
# has few scores anyway.
PALLAS_BLOCKS = (128, 64)
PALLAS_HEAD_DIMS = (16, 256)  # powers of two in this range (Triton's dot takes K >= 16; cuDNN's limit above)
PALLAS_STAGES = 2  # mha's default num_stages: the k and v tiles are double-buffered
SHARED_MEMORY_BYTES = 227 * 1024  # Hopper (H100/H200): 228 KB per SM, 227 KB usable by one block
CUDNN_MAX_HEAD_DIM = 256  # Hopper; and a multiple of 8 (jax's check_is_flash_attention)
CUDNN_DTYPES = ("bfloat16", "float16")


_traced = threading.local()  # the implementations `attend` ran in this thread's current trace (`recording`)


@contextlib.contextmanager
def recording():
    """Collect the implementation each attention layer traced in this thread runs (a list, in layer order):
    a bucket compiled for cuDNN may run some layers in XLA (score bias, bidirectional windows)."""
    outer = getattr(_traced, "used", None)
    _traced.used = used = []
    try:
        yield used
    finally:
        _traced.used = outer


def ran(chosen: str, used: list[str]) -> str:
    """What a bucket's layers ran, as one name: `chosen`, or e.g. `cudnn+blockwise` when some layers
    could not take it, or only the xla one when none could."""
    names = sorted(set(used) or {chosen}, key=lambda n: (n != chosen, IMPLEMENTATIONS.index(n)))
    return "+".join(names)


@dataclasses.dataclass(frozen=True)
class Spec:
    """Which keys a query may see within its document (positions count within the document)."""

    causal: bool = False  # only keys at or before the query
    window: int | None = None  # only keys with |query position - key position| < window (sliding window)


FULL = Spec()

# (query positions [B, Sq], key positions [B, Sk]) -> float32 [B, N, Sq, Sk], added to the scaled
# scores. A function, not an array, so that the blockwise kernel can make it one key block at a time.
ScoreBias = Callable[[jax.Array, jax.Array], jax.Array]


def xla_impl(seqlen: int) -> str:
    """What XLA compiles well at this seqlen: dense while its scores are small, blockwise past that."""
    return "dense" if seqlen <= DENSE_MAX_SEQLEN else "blockwise"


@dataclasses.dataclass(frozen=True)
class Plan:
    """One bucket's implementations to try, in order (the last, dense or blockwise, always
    compiles), and why the ones before them in the choice's order were not tried."""

    candidates: tuple[str, ...]
    skipped: tuple[str, ...] = ()


def plan(choice: str, platform: str, seqlen: int, head_dim: int, dtype: str, devices: int = 1) -> Plan:
    """The candidates for one bucket under `--attention choice`.

    auto: on a GPU cuDNN, then Pallas, then xla; elsewhere xla (dense or blockwise by seqlen).
    cuDNN first because on H100/H200 its flash attention is usually the fastest at head_dim
    64-128 in bf16, Pallas' Triton kernel second (scripts/bench_attention.py measures it; the
    choice is overridable). A forced `pallas` or `cudnn` falls back to xla where it cannot take
    the bucket, and where it fails to compile; `xla` and `blockwise` are taken as said. Over several `devices`
    no Pallas: its call has no sharding rule (cuDNN's has), so a batch-sharded bucket would run it replicated.
    """
    if choice not in CHOICES:
        raise ValueError(f"unknown attention {choice!r}; choose from {', '.join(CHOICES)}")
    xla = xla_impl(seqlen)
    if choice == "blockwise":
        return Plan(("blockwise",))
    if choice == "xla" or (choice == "auto" and platform != "gpu"):
        return Plan((xla,))
    wanted = ("cudnn", "pallas") if choice == "auto" else (choice,)
    tried, skipped = [], []
    for impl in wanted:
        if impl == "cudnn":
            why = cudnn_unfit(platform, head_dim, dtype)
        elif devices > 1:
            why = f"no sharding rule for its kernel: over {devices} devices it would run replicated on each"
        else:
            why = pallas_unfit(seqlen, head_dim, jnp.dtype(dtype).itemsize)
        if why:
            skipped.append(f"{impl}: {why}")
        else:
            tried.append(impl)
    return Plan((*tried, xla), tuple(skipped))


def cudnn_unfit(platform: str, head_dim: int, dtype: str) -> str:
    """Why cuDNN's fused attention cannot take this model ('' when it can: the rest is checked when tracing)."""
    if platform != "gpu":
        return f"needs a CUDA GPU (this is {platform})"
    if dtype not in CUDNN_DTYPES:
        return f"needs bfloat16 or float16 activations, not {dtype}"
    if head_dim > CUDNN_MAX_HEAD_DIM or head_dim % 8:
        return f"head_dim {head_dim} is not a multiple of 8 up to {CUDNN_MAX_HEAD_DIM}"
    return ""


def pallas_unfit(seqlen: int, head_dim: int, itemsize: int) -> str:
    """Why the Pallas kernel cannot take this bucket ('' when it can)."""
    lo, hi = PALLAS_HEAD_DIMS
    if head_dim & (head_dim - 1) or not lo <= head_dim <= hi:
        return f"head_dim {head_dim} is not a power of two in {lo}..{hi}"
    if not pallas_block(seqlen, head_dim, itemsize):
        return (f"no tile of {'/'.join(map(str, PALLAS_BLOCKS))} rows divides seqlen {seqlen} and fits "
                f"{SHARED_MEMORY_BYTES // 1024} KB of shared memory at head_dim {head_dim}")
    return ""


def pallas_shared_bytes(block: int, head_dim: int, itemsize: int) -> int:
    """Shared memory one program of Pallas' mha can hold, an upper bound: the q tile [block, H], the k
    and v tiles [block, H] for each of PALLAS_STAGES pipeline stages, and the probabilities [block, block]
    cast for the second dot, all in the activations' dtype (H padded to a power of two, as mha pads).
    The float32 accumulators (output [block, H], scores [block, block]) live in registers."""
    h = 1 << max(head_dim - 1, 0).bit_length()
    return itemsize * (block * h + 2 * PALLAS_STAGES * block * h + block * block)


def pallas_block(seqlen: int, head_dim: int = 64, itemsize: int = 2) -> int:
    """The Pallas kernel's tile for this seqlen and head_dim: the largest of PALLAS_BLOCKS that divides
    the seqlen and fits Hopper's shared memory (0 where none does: the bucket runs another kernel).
    bf16: 128 up to head_dim 128 (192 KB at 128), 64 at head_dim 256 (168 KB; 128 would need 352 KB)."""
    for block in PALLAS_BLOCKS:
        if seqlen % block == 0 and pallas_shared_bytes(block, head_dim, itemsize) <= SHARED_MEMORY_BYTES:
            return block
    return 0


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A family module's `attention`: the implementation, and the documents per row (cuDNN's ragged
    layout needs their number statically). A plain string is taken as Kernel(name, slots=1)."""

    name: str = "dense"
    slots: int = 1


class Masks:
    """The mask inputs of one forward; each spec's dense bias is made once and shared by the layers."""

    def __init__(self, segment_ids: jax.Array, positions: jax.Array, packed: bool = True,
                 impl: str | Kernel = "dense"):
        kernel = impl if isinstance(impl, Kernel) else Kernel(impl)
        impl = kernel.name
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"unknown attention implementation {impl!r}; choose from {', '.join(IMPLEMENTATIONS)}")
        self.segment_ids = segment_ids  # [B, S]
        self.positions = positions  # [B, S]
        self.packed = packed
        self.impl = impl
        self.slots = kernel.slots
        self._layout: tuple[jax.Array, jax.Array] | None = None
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

    def layout(self) -> tuple[jax.Array, jax.Array]:
        """cuDNN's view of the rows, made once per forward: `segment_layout`, or with one document per row
        its real tokens [B]."""
        if self._layout is None:
            seg = jnp.asarray(self.segment_ids, jnp.int32)
            if self.packed and self.slots > 1:
                self._layout = segment_layout(seg, self.slots)
            else:
                self._layout = (None, jnp.sum(seg > 0, axis=1, dtype=jnp.int32))  # [B]
        return self._layout


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

    A token of segment -k (a multi-vector query's expansion token, `jaxserve.heads.multivector`) is a query of
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
    if (impl == "pallas" and not pallas_fits(q.shape, spec, score_bias, q.dtype.itemsize)
            or impl == "cudnn" and not cudnn_fits(spec, score_bias)):
        impl = xla_impl(q.shape[1])
    if getattr(_traced, "used", None) is not None:
        _traced.used.append(impl)
    if impl == "dense":
        return _dense(q, k, v, masks.bias(spec, score_bias))
    if impl == "pallas":
        return _pallas(q, k, v, masks, spec)
    if impl == "cudnn":
        return _cudnn(q, k, v, masks, spec)
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


def pallas_fits(shape: tuple[int, ...], spec: Spec, score_bias: ScoreBias | None, itemsize: int = 2) -> bool:
    """The Pallas kernel takes this layer: no window, no score bias, a tile for its seqlen and head_dim."""
    _, s, _, h = shape
    return spec.window is None and score_bias is None and not pallas_unfit(s, h, itemsize)


def cudnn_fits(spec: Spec, score_bias: ScoreBias | None) -> bool:
    """cuDNN takes this layer: no score bias; a window only when causal (cuDNN's sliding window is
    the keys in (i - w, i], which is Spec(causal=True, window=w))."""
    return score_bias is None and (spec.window is None or spec.causal)


def _pallas(q, k, v, masks: Masks, spec: Spec):
    """The Pallas GPU flash-attention kernel: segment ids and causal in the kernel, q already scaled.

    It wants as many KV heads as query heads: grouped heads are repeated (a [B, S, N, H]
    copy per layer, small beside the scores it saves). On a CPU backend it runs in
    Pallas' interpreter (tests at tiny shapes only; `plan` never picks it there by itself).
    """
    import warnings

    try:
        with warnings.catch_warnings():  # jax 0.11 and 0.12.0 deprecate the module (for tokamax) but keep it
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention as pallas_attention
    except ImportError:  # jax 0.12.1 removed it: the same kernel, vendored
        from jaxserve.models import pallas_flash as pallas_attention

    n, kv = q.shape[2], k.shape[2]
    if kv != n:
        k, v = (jnp.repeat(x, n // kv, axis=2) for x in (k, v))
    block = pallas_block(q.shape[1], q.shape[3], q.dtype.itemsize)
    return pallas_attention.mha(
        q, k, v, jnp.asarray(masks.segment_ids, jnp.int32), sm_scale=1.0, causal=spec.causal,
        block_sizes=pallas_attention.BlockSizes(block_q=block, block_k=block),
        interpret=jax.default_backend() == "cpu",
    )


def segment_layout(segment_ids: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    """Packed rows as cuDNN's ragged layout: (offsets [B, K + 1], lengths [B, K]) int32, K = slots.

    Document d (segment id d + 1) of a row starts at offsets[:, d] and holds lengths[:, d] tokens; a
    slot without a document has -1 in both, and so does the last offset (jax's
    fused_attention_stablehlo packs the entries left and adds each row's base itself). Documents
    occupy consecutive slots, so the first slot and the count say where each one is.
    """
    seg = jnp.asarray(segment_ids, jnp.int32)  # [B, S]
    ids = jnp.arange(1, slots + 1, dtype=jnp.int32)
    here = seg[:, :, None] == ids[None, None, :]  # [B, S, K]
    lengths = here.sum(axis=1, dtype=jnp.int32)  # [B, K]
    first = jnp.argmax(here, axis=1).astype(jnp.int32)  # [B, K] first slot of each document (0 if absent)
    present = lengths > 0
    offsets = jnp.where(present, first, -1)
    offsets = jnp.concatenate([offsets, jnp.full((seg.shape[0], 1), -1, jnp.int32)], axis=1)  # [B, K + 1]
    return offsets, jnp.where(present, lengths, -1)


def _cudnn(q, k, v, masks: Masks, spec: Spec):
    """cuDNN's fused attention over packed rows (jax's `fused_attention_stablehlo.dot_product_attention`,
    the function behind `jax.nn.dot_product_attention(implementation="cudnn")`, which itself takes no
    segment ids): q already scaled.

    Several documents per row: the ragged layout (`segment_layout`; Hopper or later). One per row:
    the padding mask from each row's real tokens. Causal layers add the causal mask, causal windows
    cuDNN's sliding window. Outputs at padding slots (no document) are zeroed: cuDNN writes nothing
    there, and no later layer may read unwritten memory.
    """
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    offsets, lengths = masks.layout()
    n, kv = q.shape[2], k.shape[2]
    if offsets is not None:
        if kv != n and jax.__version_info__ < (0, 11):  # jax 0.10 strides kv_offsets by the query heads
            k, v = (jnp.repeat(x, n // kv, axis=2) for x in (k, v))
        mask = MaskType.CAUSAL if spec.causal else MaskType.NO_MASK
        out = dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
                                    kv_offsets=offsets, scale=1.0, mask_type=mask, qkv_layout="BTNH",
                                    sliding_window_length=spec.window)
    else:
        mask = MaskType.PADDING_CAUSAL if spec.causal else MaskType.PADDING
        out = dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, scale=1.0, mask_type=mask,
                                    qkv_layout="BTNH", sliding_window_length=spec.window)
    real = jnp.asarray(masks.segment_ids) > 0  # [B, S]
    return jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype))
