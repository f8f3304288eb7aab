"""BERT, RoBERTa, XLM-R and CamemBERT: post-LayerNorm encoders with learned absolute positions.

The four differ only in how position ids are counted (RoBERTa-style models
start after the padding index) and in their classification heads.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import linen as nn

from jaxserve.dims import ModelDims
from jaxserve.errors import CheckpointError
from jaxserve.models import attention, layers
from jaxserve.models.attention import Masks
from jaxserve.models.family import Family
from jaxserve.models.layers import dense, embedding, layer_norm, linear

MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "camembert")
POSITION_OFFSET_FROM_PAD = ("roberta", "xlm-roberta", "camembert")


@dataclasses.dataclass(frozen=True)
class Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    # Added to every position id: 0 for BERT, pad_token_id + 1 for RoBERTa-style models.
    position_offset: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_positions(self) -> int:
        """Longest sequence the position table can index."""
        return self.max_position_embeddings - self.position_offset

    def dims(self, dtype_bytes: int) -> ModelDims:
        return ModelDims(self.hidden_size, self.intermediate_size, self.num_heads, dtype_bytes, layers=self.num_layers)

    @classmethod
    def from_dict(cls, raw: dict) -> "Config":
        model_type = raw["model_type"]
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise CheckpointError(
                f"unsupported position_embedding_type {raw['position_embedding_type']!r}; only 'absolute'"
            )
        if raw.get("is_decoder"):
            raise CheckpointError("unsupported is_decoder=True: transformers runs such a BERT causal (a decoder); "
                                  "jaxserve's BERT is bidirectional")
        layers.check_activation(raw.get("hidden_act", "gelu"))
        layers.require_ints(raw, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                            "intermediate_size", "max_position_embeddings")
        if raw["hidden_size"] % raw["num_attention_heads"]:
            raise CheckpointError(
                f"hidden_size {raw['hidden_size']} is not divisible by num_attention_heads {raw['num_attention_heads']}"
            )
        pad = int(raw.get("pad_token_id") or 0)
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=raw["num_attention_heads"],
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=raw["max_position_embeddings"],
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            hidden_act=raw.get("hidden_act", "gelu"),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            pad_token_id=pad,
            position_offset=pad + 1 if model_type in POSITION_OFFSET_FROM_PAD else 0,
        )


class Embeddings(nn.Module):
    cfg: Config
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, token_ids, positions, type_ids):  # each [B, S] int32
        c = self.cfg
        x = embedding(c.vocab_size, c.hidden_size, self.dtype, "word")(token_ids)
        x = x + embedding(c.max_position_embeddings, c.hidden_size, self.dtype, "position")(positions + c.position_offset)
        x = x + embedding(c.type_vocab_size, c.hidden_size, self.dtype, "token_type")(type_ids)
        return layer_norm(c.layer_norm_eps, self.dtype, "ln")(x)  # [B, S, D]


class Block(nn.Module):
    """Self-attention then MLP, each followed by residual + LayerNorm (post-LN).

    Shared by MPNet (with its relative position bias as `score_bias`) and
    DistilBERT, whose configs carry the same fields.
    """

    cfg: Config
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_bsd, masks: Masks, score_bias: attention.ScoreBias | None = None):
        c = self.cfg
        b, s, _ = x_bsd.shape
        q, k, v = layers.qkv_heads(x_bsd, c.num_heads, c.num_heads, c.head_dim, self.dtype)  # [B, S, N, H]
        att = attention.attend(q, k, v, masks, score_bias=score_bias)  # [B, S, N, H]
        att = dense(c.hidden_size, self.dtype, "attn_out")(att.reshape(b, s, c.hidden_size))
        x_bsd = layer_norm(c.layer_norm_eps, self.dtype, "attn_ln")(x_bsd + att)
        h = layers.ACTIVATIONS[c.hidden_act](dense(c.intermediate_size, self.dtype, "mlp_in")(x_bsd))  # [B, S, F]
        return layer_norm(c.layer_norm_eps, self.dtype, "mlp_ln")(x_bsd + dense(c.hidden_size, self.dtype, "mlp_out")(h))


class Encoder(nn.Module):
    """Token ids -> last hidden states [B, S, D]; `packed=False` when each row holds one document."""

    cfg: Config
    dtype: jnp.dtype = jnp.float32
    attention: str = "dense"

    @nn.compact
    def __call__(self, token_ids, segment_ids, positions, type_ids, packed: bool = True):  # each [B, S] int32
        x = Embeddings(self.cfg, self.dtype, name="embeddings")(token_ids, positions, type_ids)
        masks = Masks(segment_ids, positions, packed, self.attention)
        for i in range(self.cfg.num_layers):
            x = Block(self.cfg, self.dtype, name=f"layer_{i}")(x, masks)
        return x


class ClassificationHead(nn.Module):
    """First token's state -> dense + tanh -> logits (BERT's pooler + classifier; RoBERTa's classifier)."""

    cfg: Config
    num_labels: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, first_bkd):  # [B, K, D]
        x = jnp.tanh(dense(self.cfg.hidden_size, self.dtype, "dense")(first_bkd))
        return dense(self.num_labels, self.dtype, "out")(x)  # [B, K, L]


# ---- checkpoint names ----

def block_weights(qkv: list[str], attn_out: str, attn_ln: str, mlp_in: str, mlp_out: str, mlp_ln: str) -> dict:
    """One `Block`'s params from its tensors' prefixes (BERT's names, or MPNet's and DistilBERT's)."""
    return {
        "qkv": layers.fused_linear(qkv),
        "attn_out": linear(attn_out),
        "attn_ln": layers.layer_norm_weights(attn_ln),
        "mlp_in": linear(mlp_in),
        "mlp_out": linear(mlp_out),
        "mlp_ln": layers.layer_norm_weights(mlp_ln),
    }


def weights(cfg: Config) -> dict:
    """Our params tree, each leaf as (source tensor names, how to turn them into the leaf)."""
    tree = {
        "embeddings": {
            "word": embedding_weight("word_embeddings"),
            "position": embedding_weight("position_embeddings"),
            "token_type": embedding_weight("token_type_embeddings"),
            "ln": layers.layer_norm_weights("embeddings.LayerNorm"),
        }
    }
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}"
        tree[f"layer_{i}"] = block_weights([f"{p}.attention.self.{n}" for n in ("query", "key", "value")],
                                           f"{p}.attention.output.dense", f"{p}.attention.output.LayerNorm",
                                           f"{p}.intermediate.dense", f"{p}.output.dense", f"{p}.output.LayerNorm")
    return tree


def head_weights(cfg: Config) -> dict:
    """BERT's pooler + classifier, or RoBERTa's classifier.dense + out_proj."""
    if cfg.model_type == "bert":
        return {"dense": linear("pooler.dense"), "out": linear("classifier")}
    return {"dense": linear("classifier.dense"), "out": linear("classifier.out_proj")}


def embedding_weight(name: str) -> dict:
    return {"embedding": ([f"embeddings.{name}.weight"], lambda w: w)}


def rename(key: str) -> str:
    """Old checkpoints call LayerNorm parameters gamma and beta."""
    return key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")


def encoder_prefixes(cfg: Config) -> tuple[str, ...]:
    return (cfg.model_type.replace("-", "_") + ".", "bert.", "roberta.", "model.")


IGNORED = ("embeddings.position_ids", "pooler.", "cls.", "lm_head.", "classifier.")


FAMILY = Family(
    name="bert", model_types=MODEL_TYPES, configure=Config.from_dict, encoder=Encoder, weights=weights,
    encoder_prefixes=encoder_prefixes, ignored=IGNORED, rename=rename, head=ClassificationHead,
    head_weights=head_weights, head_pooling="cls",
)
