"""The pure forwards the engine compiles, one per kind of output: the encoder's hidden states, then the head.

Each takes the Flax encoder module, the params tree and a batch of packed rows ({name: [B, S] int32}) and
returns float32 outputs per slot or per token. SPLADE's returns a second output, its spill (the full weights
that the engine keeps on the device unless a caller asks for them).

This module and `pooling` are the heads' device side, and the only ones here that import JAX: each head's
config and its host-side decoding (`sparse`, `multivector`, `bge_m3`) are read by front-end processes, which
never import it (`jaxserve serve --workers`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.checkpoint.config import EmbeddingConfig
from jaxserve.heads.bge_m3 import M3Config
from jaxserve.heads.multivector import MultiVectorConfig
from jaxserve.heads.pooling import HIGHEST, dense_layers, pool, segment_onehot
from jaxserve.heads.sparse import SparseConfig
from jaxserve.models import layers


def embed_forward(module, emb: EmbeddingConfig, num_segments: int, params, batch: dict) -> jax.Array:
    """Pure forward: a batch of packed rows -> [B, K, D'] float32 vectors: pooled, through the checkpoint's
    Dense layers (params["dense"]), cut to its `truncate_dim`, not normalised."""
    encoder_params = {k: v for k, v in params.items() if k != "dense"}
    hidden = module.apply(
        {"params": encoder_params}, batch["token_ids"], batch["segment_ids"], batch["positions"], batch["type_ids"],
        packed=num_segments > 1,
    )  # [B, S, D]
    pooled = pool(emb.pooling, hidden, batch["segment_ids"], batch["positions"], num_segments)  # [B, K, D x modes]
    return dense_layers(emb.dense, params.get("dense", ()), pooled)[..., : emb.truncate_dim]


def tokens_forward(module, num_segments: int, params, batch: dict) -> jax.Array:
    """Pure forward: packed rows -> [B, S, D] float32 last hidden states, every token (TEI's /embed_all)."""
    encoder_params = {k: v for k, v in params.items() if k not in ("dense", "head", "mlm")}
    hidden = module.apply(
        {"params": encoder_params}, batch["token_ids"], batch["segment_ids"], batch["positions"], batch["type_ids"],
        packed=num_segments > 1,
    )
    return hidden.astype(jnp.float32)


def classify_forward(module, head, head_pooling: str, num_segments: int, params, batch: dict,
                     pad_id: int | None = None):
    """Pure forward: packed rows -> [B, K, L] float32 logits of each sequence (from the head's pooled token(s)).
    With `pad_id`, the head's pooling skips that token except at a sequence's first place (`Family.head_pad_id`)."""
    encoder_params = {k: v for k, v in params.items() if k != "head"}
    seg, pos = batch["segment_ids"], batch["positions"]
    hidden = module.apply(
        {"params": encoder_params}, batch["token_ids"], seg, pos, batch["type_ids"], packed=num_segments > 1,
    )  # [B, S, D]
    if pad_id is not None:
        seg = jnp.where((batch["token_ids"] == pad_id) & (pos > 0), 0, seg)  # [B, S]
    pooled = pool(head_pooling, hidden, seg, pos, num_segments)  # [B, K, D]
    return head.apply({"params": params["head"]}, pooled.astype(hidden.dtype)).astype(jnp.float32)


def multivector_forward(module, mv: MultiVectorConfig, vocab: int, num_segments: int, params, batch: dict) -> jax.Array:
    """Pure forward: packed rows -> [B, S, dim] float32 token vectors (projected, cut to the checkpoint's
    `truncate_dim`, normalised if the model does or is cut)."""
    ids, seg = batch["token_ids"], batch["segment_ids"]
    hidden_keys = ids >= vocab  # expansion tokens the encoder must not attend to
    ids = jnp.where(hidden_keys, ids - vocab, ids)
    seg = jnp.where(hidden_keys, -seg, seg)
    encoder_params = {k: v for k, v in params.items() if k not in ("dense", "head", "mlm")}
    hidden = module.apply({"params": encoder_params}, ids, seg, batch["positions"], batch["type_ids"],
                          packed=num_segments > 1)  # [B, S, D]
    x = dense_layers(mv.dense, params.get("dense", ()), hidden.astype(jnp.float32))[..., : mv.dim]  # [B, S, dim]
    if mv.normalize:  # torch's F.normalize: x / max(|x|, 1e-12)
        x = x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
    return x


def m3_forward(module, m3: M3Config, num_segments: int, params, batch: dict) -> jax.Array:
    """Pure forward: packed rows -> [B, S, width] float32: per token its CLS state (a sequence's first token) or
    normalised ColBERT vector (the others), zero-padded to the wider of the two, then its sparse weight."""
    hidden = tokens_forward(module, num_segments, {k: v for k, v in params.items() if k != "m3"}, batch)
    colbert = dense_layers((m3.colbert,), (params["m3"]["colbert"],), hidden)  # [B, S, dim]
    colbert = colbert / jnp.maximum(jnp.linalg.norm(colbert, axis=-1, keepdims=True), 1e-12)  # torch's F.normalize
    weight = dense_layers((m3.sparse,), (params["m3"]["sparse"],), hidden)  # [B, S, 1]
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, m3.width - 1 - x.shape[-1])))
    first = (batch["positions"] == 0)[..., None]  # [B, S, 1] each sequence's CLS
    return jnp.concatenate([jnp.where(first, pad(hidden), pad(colbert)), weight], -1)


def transform(cfg, head: dict, hidden_bsd: jax.Array) -> jax.Array:
    """The MLM head before its vocabulary projection: dense, activation, LayerNorm -> [B, S, D] float32 (its dot at
    HIGHEST precision, as pooling's)."""
    kernel = head["transform"]["kernel"].astype(jnp.float32)
    x = jnp.einsum("bsd,de->bse", hidden_bsd.astype(jnp.float32), kernel, precision=HIGHEST) + head["transform"]["bias"]
    act = "gelu" if cfg.model_type in ("roberta", "xlm-roberta", "camembert") else cfg.hidden_act
    x = layers.ACTIVATIONS[act](x)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    x = (x - mu) / jnp.sqrt(var + cfg.layer_norm_eps)
    return x * head["ln"]["scale"].astype(jnp.float32) + head["ln"]["bias"].astype(jnp.float32)


def _activate(sparse: SparseConfig, x):
    y = jnp.log1p(jax.nn.relu(x))
    return jnp.log1p(y) if sparse.activation == "log1p_relu" else y


def pooled_weights(sparse: SparseConfig, t_bsd, decoder_vd, bias_v, member_bsk) -> jax.Array:
    """[B, S, D] head states -> [B, K, V] float32 SPLADE weights per sequence, `sparse.block` vocabulary entries at
    a time.

    max: the activation is monotone, so the max of the activated logits is the activated max of the logits
    (exact); padding and other sequences' tokens count as logit 0, as sentence-transformers masks them."""
    v = decoder_vd.shape[0]
    # a float32 model's projection at HIGHEST, as pooling's; a bfloat16 model's (a fifth of a SPLADE's FLOPs) at the
    # device's default, TF32 on a GPU: still finer than its bfloat16 weights, and several times faster than HIGHEST
    precision = HIGHEST if decoder_vd.dtype == jnp.float32 else None
    block = min(sparse.block, v)
    nb = -(-v // block)
    pad = nb * block - v
    dec = jnp.pad(decoder_vd.astype(jnp.float32), ((0, pad), (0, 0))).reshape(nb, block, -1)  # [NB, VB, D]
    bias = jnp.pad(bias_v.astype(jnp.float32), (0, pad)).reshape(nb, block)  # [NB, VB]
    k = member_bsk.shape[-1]

    def one(args):
        dec_b, bias_b = args
        logits = jnp.einsum("bsd,vd->bsv", t_bsd, dec_b, precision=precision) + bias_b  # [B, S, VB]
        if sparse.strategy == "sum":
            return jnp.einsum("bsk,bsv->bkv", member_bsk, _activate(sparse, logits),
                              precision=HIGHEST)  # [B, K, VB]
        slot_max = [jnp.where(member_bsk[:, :, j : j + 1] > 0, logits, 0.0).max(axis=1) for j in range(k)]
        return _activate(sparse, jnp.stack(slot_max, axis=1))  # [B, K, VB]

    blocks = jax.lax.map(one, (dec, bias))  # [NB, B, K, VB]
    b = t_bsd.shape[0]
    return jnp.moveaxis(blocks, 0, 2).reshape(b, k, nb * block)[..., :v]  # [B, K, V]


def compact(weights_bkv: jax.Array, cap: int) -> jax.Array:
    """[B, K, V] -> [B, K, 1 + 2 cap]: the non-zero count, then up to `cap` values and their indices, in index order."""
    b, k, v = weights_bkv.shape
    nonzero = weights_bkv > 0
    count = nonzero.sum(-1)  # [B, K]
    place = jnp.where(nonzero, jnp.cumsum(nonzero, -1) - 1, cap)  # [B, K, V] each non-zero's slot, cap: dropped
    place = jnp.minimum(place, cap)
    rows = jnp.arange(b)[:, None, None]
    slots = jnp.arange(k)[None, :, None]
    values = jnp.zeros((b, k, cap + 1), jnp.float32).at[rows, slots, place].set(weights_bkv)
    index = jnp.broadcast_to(jnp.arange(v, dtype=jnp.float32), (b, k, v))  # exact below 2**24
    indices = jnp.zeros((b, k, cap + 1), jnp.float32).at[rows, slots, place].set(index)
    return jnp.concatenate([count[..., None].astype(jnp.float32), values[..., :cap], indices[..., :cap]], -1)


def sparse_forward(module, cfg, sparse: SparseConfig, num_segments: int, params,
                   batch: dict) -> tuple[jax.Array, jax.Array]:
    """Pure forward: packed rows -> ([B, K, 1 + 2 cap] compacted SPLADE weights of each sequence, the [B, K, V]
    weights themselves): the engine ships the first and keeps the second on the device as the spill
    (`Engine.launch`), read only for a batch with a sequence over the cap."""
    head = params["mlm"]
    hidden = module.apply(
        {"params": {k: v for k, v in params.items() if k != "mlm"}}, batch["token_ids"], batch["segment_ids"],
        batch["positions"], batch["type_ids"], packed=num_segments > 1,
    )  # [B, S, D]
    decoder = head["decoder"] if "decoder" in head else params["embeddings"]["word"]["embedding"]  # [V, D]
    member = segment_onehot(batch["segment_ids"], num_segments)  # [B, S, K]
    weights = pooled_weights(sparse, transform(cfg, head, hidden), decoder, head["bias"], member)
    return compact(weights, sparse.cap), weights
