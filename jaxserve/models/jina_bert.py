"""JinaBERT v2 (jina-embeddings-v2-small/base-en, -de, -es, -zh; jina-reranker-v1): BERT with ALiBi and a GLU MLP.

transformers has no class for it: its config.json says `model_type: bert` with
`position_embedding_type: alibi` and the hub's remote code (jinaai/jina-bert-implementation,
which TEI's candle `jina.rs` follows) runs it:
- no position table: word and token-type embeddings summed and LayerNormed;
- post-LN BERT attention (query, key, value and output with biases) whose scores
  get ALiBi's bias -slope_h * |i - j| per head h (symmetric: the encoder attends
  both ways), slopes from the head count as in the ALiBi paper;
- x = LayerNorm(x + wo(act(a) * b)), with [a; b] = gated_layers(x) (no bias),
  act GELU for `feed_forward_type: geglu`, ReLU for `reglu`.
ALiBi is a score bias over each document's own positions (`attention.ScoreBias`),
so packed rows stay exact and any length up to `max_position_embeddings` runs.

jina-embeddings-v2-base-code (remote code jina-bert-v2-qk-post-norm: LayerNorms
on q and k, other MLP names) is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxserve.dims import ModelDims
from jaxserve.errors import CheckpointError
from jaxserve.models import attention, bert, layers
from jaxserve.models.attention import Masks
from jaxserve.models.family import Family
from jaxserve.models.layers import dense, embedding, layer_norm, linear

FEED_FORWARD = {"geglu": "gelu", "reglu": "relu"}  # the hub's feed_forward_type -> the gate's activation
QK_POST_NORM = "jina-bert-v2-qk-post-norm"  # the code model's remote code, named in _name_or_path / auto_map


def is_jina_bert(raw: dict) -> bool:
    """A `bert` config.json that is JinaBERT's: ALiBi positions (plain BERT has absolute ones)."""
    return raw.get("model_type") == "bert" and raw.get("position_embedding_type") == "alibi"


@dataclasses.dataclass(frozen=True)
class Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    hidden_act: str = "gelu"  # the gate's activation
    layer_norm_eps: float = 1e-12

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings

    def dims(self, dtype_bytes: int) -> ModelDims:
        return ModelDims(self.hidden_size, self.intermediate_size, self.num_heads, dtype_bytes,
                         layers=self.num_layers, gated=True)


def configure(raw: dict) -> Config:
    """config.json as the hub ships it (model_type bert, position_embedding_type alibi)."""
    if not is_jina_bert(raw):
        raise CheckpointError("a JinaBERT config.json has model_type 'bert' and position_embedding_type 'alibi'")
    remote = f"{raw.get('_name_or_path', '')} {raw.get('auto_map') or ''}"
    if QK_POST_NORM in remote:
        raise CheckpointError(f"unsupported JinaBERT variant {QK_POST_NORM} (jina-embeddings-v2-base-code: "
                              "LayerNorms on q and k); jaxserve runs jina-bert-implementation's layers only")
    layers.require_ints(raw, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "intermediate_size", "max_position_embeddings")
    if raw["hidden_size"] % raw["num_attention_heads"]:
        raise CheckpointError(f"hidden_size {raw['hidden_size']} is not divisible by num_attention_heads "
                              f"{raw['num_attention_heads']}")
    kind = raw.get("feed_forward_type", "geglu")
    if kind not in FEED_FORWARD:
        raise CheckpointError(f"unsupported JinaBERT feed_forward_type {kind!r}; supported: {', '.join(FEED_FORWARD)}")
    return Config(
        model_type=raw["model_type"], vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"], num_heads=raw["num_attention_heads"],
        intermediate_size=raw["intermediate_size"], max_position_embeddings=raw["max_position_embeddings"],
        type_vocab_size=raw.get("type_vocab_size", 2), hidden_act=FEED_FORWARD[kind],
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
    )


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's per-head slopes [N]: 2^(-8i/n) for n a power of two; otherwise those of the power of two below,
    then every other slope of the power of two above (as the hub's `_get_alibi_head_slopes` and TEI)."""
    def power_of_2(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return np.asarray(power_of_2(num_heads), np.float32)
    closest = 2 ** math.floor(math.log2(num_heads))
    return np.asarray(power_of_2(closest) + power_of_2(2 * closest)[0::2][:num_heads - closest], np.float32)


def alibi(slopes, pos_q, pos_k):
    """The ALiBi score bias (an `attention.ScoreBias`): positions [B, Sq] and [B, Sk] -> [B, N, Sq, Sk] float32."""
    distance = jnp.abs(pos_q[:, :, None] - pos_k[:, None, :]).astype(jnp.float32)  # [B, Sq, Sk]
    return -slopes[None, :, None, None] * distance[:, None]


class Block(nn.Module):
    """x = LayerNorm(x + attention(x) with ALiBi), then x = LayerNorm(x + GLU MLP(x)) (post-LN)."""

    cfg: Config
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_bsd, masks: Masks, score_bias: attention.ScoreBias):
        c = self.cfg
        b, s, _ = x_bsd.shape
        q, k, v = layers.qkv_heads(x_bsd, c.num_heads, c.num_heads, c.head_dim, self.dtype)  # [B, S, N, H]
        att = attention.attend(q, k, v, masks, score_bias=score_bias).reshape(b, s, c.hidden_size)
        x_bsd = layer_norm(c.layer_norm_eps, self.dtype, "attn_ln")(x_bsd + dense(c.hidden_size, self.dtype,
                                                                                    "attn_out")(att))
        mlp = layers.gated_mlp(x_bsd, c.intermediate_size, c.hidden_size, c.hidden_act, self.dtype,
                               ("gated", "wo"), use_bias=False, out_bias=True)
        return layer_norm(c.layer_norm_eps, self.dtype, "mlp_ln")(x_bsd + mlp)  # [B, S, D]


class Encoder(nn.Module):
    """Token ids -> last hidden states [B, S, D]."""

    cfg: Config
    dtype: jnp.dtype = jnp.float32
    attention: str = "dense"

    @nn.compact
    def __call__(self, token_ids, segment_ids, positions, type_ids, packed: bool = True):  # each [B, S] int32
        c = self.cfg
        x = embedding(c.vocab_size, c.hidden_size, self.dtype, "word")(token_ids)
        x = x + embedding(c.type_vocab_size, c.hidden_size, self.dtype, "token_type")(type_ids)
        x = layer_norm(c.layer_norm_eps, self.dtype, "emb_ln")(x)  # [B, S, D]
        masks = Masks(segment_ids, positions, packed, self.attention)
        bias = functools.partial(alibi, jnp.asarray(alibi_slopes(c.num_heads)))  # one object: the bias is made once
        for i in range(c.num_layers):
            x = Block(c, self.dtype, name=f"layer_{i}")(x, masks, bias)
        return x


# ---- checkpoint names ----

def weights(cfg: Config) -> dict:
    """Our params tree from the hub's tensor names (BERT's, with the MLP's gated_layers / wo / layernorm)."""
    tree = {
        "word": {"embedding": layers.tensor("embeddings.word_embeddings.weight")},
        "token_type": {"embedding": layers.tensor("embeddings.token_type_embeddings.weight")},
        "emb_ln": layers.layer_norm_weights("embeddings.LayerNorm"),
    }
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}"
        tree[f"layer_{i}"] = {
            "qkv": layers.fused_linear([f"{p}.attention.self.{n}" for n in ("query", "key", "value")]),
            "attn_out": linear(f"{p}.attention.output.dense"),
            "attn_ln": layers.layer_norm_weights(f"{p}.attention.output.LayerNorm"),
            "gated": linear(f"{p}.mlp.gated_layers", bias=False),  # [act half; linear half]
            "wo": linear(f"{p}.mlp.wo"),
            "mlp_ln": layers.layer_norm_weights(f"{p}.mlp.layernorm"),
        }
    return tree


def head_weights(cfg: Config) -> dict:
    """JinaBertForSequenceClassification (jina-reranker-v1): BERT's pooler and classifier."""
    return {"dense": linear("pooler.dense"), "out": linear("classifier")}


FAMILY = Family(
    name="jina_bert", model_types=(), configure=configure, encoder=Encoder, weights=weights,
    encoder_prefixes=lambda cfg: ("bert.",), ignored=("embeddings.position_ids", "pooler.", "cls.", "classifier."),
    rename=bert.rename, head=bert.ClassificationHead, head_weights=head_weights, head_pooling="cls",
)
