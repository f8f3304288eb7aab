"""MPNet (all-mpnet-base-v2): BERT's post-LN blocks plus a relative position bias on the attention scores.

The bias is one learned value per head and relative-position bucket, made once
per forward and added in every layer. transformers buckets the distance key
position - query position; here both positions count within the document, so
a packed document gets the bias it gets alone in its row.
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
from jaxserve.models import layers
from jaxserve.models.attention import Masks
from jaxserve.models.bert import Block, ClassificationHead, block_weights, embedding_weight
from jaxserve.models.family import Family
from jaxserve.models.layers import embedding, layer_norm, linear

# transformers' MPNetEncoder.compute_position_bias buckets with its defaults, whatever the config says:
NUM_BUCKETS = 32  # half for keys before the query, half for keys after it
MAX_DISTANCE = 128  # distances from here on share the last bucket
# MPNetEmbeddings fixes padding_idx at 1 and counts positions from padding_idx + 1 (as RoBERTa).
POSITION_OFFSET = 2


@dataclasses.dataclass(frozen=True)
class Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    relative_buckets: int = NUM_BUCKETS  # rows of the bias table; the first NUM_BUCKETS are used
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_positions(self) -> int:
        """Longest sequence the position table can index."""
        return self.max_position_embeddings - POSITION_OFFSET

    def dims(self, dtype_bytes: int) -> ModelDims:
        return ModelDims(self.hidden_size, self.intermediate_size, self.num_heads, dtype_bytes, layers=self.num_layers)

    @classmethod
    def from_dict(cls, raw: dict) -> "Config":
        layers.check_activation(raw.get("hidden_act", "gelu"))
        layers.require_ints(raw, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                            "intermediate_size", "max_position_embeddings")
        if raw["hidden_size"] % raw["num_attention_heads"]:
            raise CheckpointError(
                f"hidden_size {raw['hidden_size']} is not divisible by num_attention_heads {raw['num_attention_heads']}"
            )
        buckets = int(raw.get("relative_attention_num_buckets", NUM_BUCKETS))
        if buckets < NUM_BUCKETS:
            raise CheckpointError(
                f"relative_attention_num_buckets {buckets} < {NUM_BUCKETS}: transformers' MPNet always "
                f"indexes {NUM_BUCKETS} relative-position buckets"
            )
        return cls(
            model_type=raw["model_type"],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=raw["num_attention_heads"],
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=raw["max_position_embeddings"],
            relative_buckets=buckets,
            hidden_act=raw.get("hidden_act", "gelu"),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        )


def relative_position_buckets() -> np.ndarray:
    """[2 * MAX_DISTANCE + 1] int32: the bucket of each key position - query position, -MAX_DISTANCE..MAX_DISTANCE.

    transformers' `relative_position_bucket` in float32 numpy, on the host: its
    log lands exactly on bucket edges (distances 16, 32, 64), where a device's
    own log could round the other way. Longer distances clip to the end buckets.
    """
    rel = np.arange(-MAX_DISTANCE, MAX_DISTANCE + 1)
    n = -rel  # query position - key position
    half = NUM_BUCKETS // 2
    exact = half // 2
    far = exact + (np.log(np.maximum(np.abs(n), 1).astype(np.float32) / np.float32(exact))
                   / np.float32(math.log(MAX_DISTANCE / exact)) * np.float32(half - exact)).astype(np.int64)
    near_or_far = np.where(np.abs(n) < exact, np.abs(n), np.minimum(far, half - 1))
    return ((n < 0) * half + near_or_far).astype(np.int32)


BUCKETS = relative_position_buckets()


def relative_bias(table, pos_q, pos_k):
    """The score bias (an `attention.ScoreBias`): table [R, N], positions [B, Sq] and [B, Sk] -> [B, N, Sq, Sk] float32."""
    rel = jnp.clip(pos_k[:, None, :] - pos_q[:, :, None], -MAX_DISTANCE, MAX_DISTANCE)  # [B, Sq, Sk]
    bucket = jnp.asarray(BUCKETS)[rel + MAX_DISTANCE]  # [B, Sq, Sk]
    return table.astype(jnp.float32)[bucket].transpose(0, 3, 1, 2)  # [B, N, Sq, Sk]


class Embeddings(nn.Module):
    """Word + position embeddings, LayerNorm; no token types."""

    cfg: Config
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, token_ids, positions):  # each [B, S] int32
        c = self.cfg
        x = embedding(c.vocab_size, c.hidden_size, self.dtype, "word")(token_ids)
        x = x + embedding(c.max_position_embeddings, c.hidden_size, self.dtype, "position")(positions + POSITION_OFFSET)
        return layer_norm(c.layer_norm_eps, self.dtype, "ln")(x)  # [B, S, D]


class Encoder(nn.Module):
    """Token ids -> last hidden states [B, S, D]; type ids are ignored (MPNet has none)."""

    cfg: Config
    dtype: jnp.dtype = jnp.float32
    attention: str = "dense"

    @nn.compact
    def __call__(self, token_ids, segment_ids, positions, type_ids, packed: bool = True):  # each [B, S] int32
        c = self.cfg
        x = Embeddings(c, self.dtype, name="embeddings")(token_ids, positions)
        masks = Masks(segment_ids, positions, packed, self.attention)
        table = self.param("relative_bias", nn.initializers.normal(0.02), (c.relative_buckets, c.num_heads),
                           self.dtype)  # [R, N]
        bias = functools.partial(relative_bias, table)  # one object for every layer: the dense bias is made once
        for i in range(c.num_layers):
            x = Block(c, self.dtype, name=f"layer_{i}")(x, masks, bias)
        return x


# ---- checkpoint names ----

def weights(cfg: Config) -> dict:
    """Our params tree, each leaf as (source tensor names, how to turn them into the leaf)."""
    tree = {
        "embeddings": {
            "word": embedding_weight("word_embeddings"),
            "position": embedding_weight("position_embeddings"),
            "ln": layers.layer_norm_weights("embeddings.LayerNorm"),
        },
        "relative_bias": layers.tensor("encoder.relative_attention_bias.weight"),
    }
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}"
        tree[f"layer_{i}"] = block_weights([f"{p}.attention.attn.{n}" for n in ("q", "k", "v")],
                                           f"{p}.attention.attn.o", f"{p}.attention.LayerNorm",
                                           f"{p}.intermediate.dense", f"{p}.output.dense", f"{p}.output.LayerNorm")
    return tree


def head_weights(cfg: Config) -> dict:
    """MPNetForSequenceClassification's classifier.dense + out_proj (RoBERTa's head)."""
    return {"dense": linear("classifier.dense"), "out": linear("classifier.out_proj")}


IGNORED = ("embeddings.position_ids", "pooler.", "lm_head.", "classifier.")


FAMILY = Family(
    name="mpnet", model_types=("mpnet",), configure=Config.from_dict, encoder=Encoder, weights=weights,
    encoder_prefixes=lambda cfg: ("mpnet.",), ignored=IGNORED, head=ClassificationHead,
    head_weights=head_weights, head_pooling="cls",
)
