"""DistilBERT: BERT's post-LN blocks, six of them, with learned absolute positions and no token types.

`sinusoidal_pos_embds` changes only how transformers initialises the position
table; it saves that table as a weight and reads it back either way, so both
settings load `embeddings.position_embeddings.weight` here too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxserve.dims import ModelDims
from jaxserve.errors import CheckpointError
from jaxserve.models import layers
from jaxserve.models.attention import Masks
from jaxserve.models.bert import Block, block_weights, embedding_weight
from jaxserve.models.family import Family
from jaxserve.models.layers import dense, embedding, layer_norm, linear

LAYER_NORM_EPS = 1e-12  # fixed in transformers' DistilBERT, not a config field


@dataclasses.dataclass(frozen=True)
class Config:
    """DistilBERT's config.json fields (dim, n_heads, hidden_dim, activation) under BERT's names."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    hidden_act: str = "gelu"
    layer_norm_eps: float = LAYER_NORM_EPS

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_positions(self) -> int:
        """Longest sequence the position table can index."""
        return self.max_position_embeddings

    def dims(self, dtype_bytes: int) -> ModelDims:
        return ModelDims(self.hidden_size, self.intermediate_size, self.num_heads, dtype_bytes, layers=self.num_layers)

    @classmethod
    def from_dict(cls, raw: dict) -> "Config":
        layers.check_activation(raw.get("activation", "gelu"), field="activation")
        layers.require_ints(raw, "vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "max_position_embeddings")
        if raw["dim"] % raw["n_heads"]:
            raise CheckpointError(f"dim {raw['dim']} is not divisible by n_heads {raw['n_heads']}")
        return cls(
            model_type=raw["model_type"],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["dim"],
            num_layers=raw["n_layers"],
            num_heads=raw["n_heads"],
            intermediate_size=raw["hidden_dim"],
            max_position_embeddings=raw["max_position_embeddings"],
            hidden_act=raw.get("activation", "gelu"),
        )


class Embeddings(nn.Module):
    """Word + position embeddings, LayerNorm; no token types."""

    cfg: Config
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, token_ids, positions):  # each [B, S] int32
        c = self.cfg
        x = embedding(c.vocab_size, c.hidden_size, self.dtype, "word")(token_ids)
        x = x + embedding(c.max_position_embeddings, c.hidden_size, self.dtype, "position")(positions)
        return layer_norm(c.layer_norm_eps, self.dtype, "ln")(x)  # [B, S, D]


class Encoder(nn.Module):
    """Token ids -> last hidden states [B, S, D]; type ids are ignored (DistilBERT has none)."""

    cfg: Config
    dtype: jnp.dtype = jnp.float32
    attention: str = "dense"

    @nn.compact
    def __call__(self, token_ids, segment_ids, positions, type_ids, packed: bool = True):  # each [B, S] int32
        x = Embeddings(self.cfg, self.dtype, name="embeddings")(token_ids, positions)
        masks = Masks(segment_ids, positions, packed, self.attention)
        for i in range(self.cfg.num_layers):
            x = Block(self.cfg, self.dtype, name=f"layer_{i}")(x, masks)
        return x


class ClassificationHead(nn.Module):
    """[CLS] state -> pre_classifier + ReLU -> classifier (DistilBertForSequenceClassification)."""

    cfg: Config
    num_labels: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, first_bkd):  # [B, K, D]
        x = jax.nn.relu(dense(self.cfg.hidden_size, self.dtype, "pre")(first_bkd))
        return dense(self.num_labels, self.dtype, "out")(x)  # [B, K, L]


# ---- checkpoint names ----

def weights(cfg: Config) -> dict:
    """Our params tree, each leaf as (source tensor names, how to turn them into the leaf)."""
    tree = {
        "embeddings": {
            "word": embedding_weight("word_embeddings"),
            "position": embedding_weight("position_embeddings"),
            "ln": layers.layer_norm_weights("embeddings.LayerNorm"),
        }
    }
    for i in range(cfg.num_layers):
        p = f"transformer.layer.{i}"
        tree[f"layer_{i}"] = block_weights([f"{p}.attention.{n}_lin" for n in ("q", "k", "v")],
                                           f"{p}.attention.out_lin", f"{p}.sa_layer_norm",
                                           f"{p}.ffn.lin1", f"{p}.ffn.lin2", f"{p}.output_layer_norm")
    return tree


def head_weights(cfg: Config) -> dict:
    return {"pre": linear("pre_classifier"), "out": linear("classifier")}


# The masked-LM head (distilbert-base-uncased) and the task heads we do not run.
IGNORED = ("embeddings.position_ids", "vocab_transform.", "vocab_layer_norm.", "vocab_projector.",
           "pre_classifier.", "classifier.", "qa_outputs.")


FAMILY = Family(
    name="distilbert", model_types=("distilbert",), configure=Config.from_dict, encoder=Encoder, weights=weights,
    encoder_prefixes=lambda cfg: ("distilbert.",), ignored=IGNORED, head=ClassificationHead,
    head_weights=head_weights, head_pooling="cls",
)
