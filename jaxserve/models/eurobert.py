"""EuroBERT (EuroBERT-210m/610m/2.1B): a Llama-style encoder, i.e. the decoder family's layers attending both ways.

As transformers' `EuroBertModel` (and the hub's remote code it replaced): token
embeddings only (no position table, no token types), then per layer
x + attention(RMSNorm(x)) with RoPE and grouped-query heads, x + SwiGLU(RMSNorm(x)),
and a final RMSNorm. The one difference from `decoder.py` is that every query sees
its whole document, so the family reuses the decoder's blocks, modules and tensor
names with a bidirectional `Spec` per layer (`Config.specs`).

config.json: transformers 5's `rope_parameters` or the hub's `rope_theta` with
`rope_scaling: null`; scaled RoPE is refused. `attention_bias` puts biases on q, k,
v and the output projection; `mlp_bias` (off by default) is refused.

Sequence classification (`EuroBertForSequenceClassification`): dense, GELU and
classifier on the BOS token (`classifier_pooling` "bos", the hub's `clf_pooling`)
or on the mean of the document's tokens ("mean"). "late" applies the head to every
token and averages the logits: the head runs after pooling here, so it is refused
when a classifier is loaded (an embedding model with that default config loads).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxserve.errors import CheckpointError
from jaxserve.models import decoder, layers
from jaxserve.models.attention import FULL, Spec
from jaxserve.models.family import Family
from jaxserve.models.layers import dense, linear

DEFAULT_MAX_POSITIONS = 8192  # transformers' EuroBertConfig defaults
DEFAULT_RMS_EPS = 1e-5
CLASSIFIER_POOLING = {"bos": "cls", "mean": "mean", "late": None}  # EuroBERT's name -> the head's pooling here


@dataclasses.dataclass(frozen=True)
class Config(decoder.Config):
    classifier_pooling: str = "late"

    @property
    def specs(self) -> tuple[Spec, ...]:
        """Every layer bidirectional: a query sees its whole document."""
        return (FULL,) * self.num_layers


def configure(raw: dict) -> Config:
    """config.json as transformers' EuroBertConfig reads it (its defaults where a field is missing)."""
    layers.require_ints(raw, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "intermediate_size")
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    kv_heads = raw.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise CheckpointError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if not raw.get("head_dim") and hidden % heads:
        raise CheckpointError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    head_dim = raw.get("head_dim") or hidden // heads
    if head_dim % 2:
        raise CheckpointError(f"head_dim {head_dim} is odd; rotary embedding needs an even head_dim")
    if raw.get("mlp_bias"):
        raise CheckpointError("unsupported EuroBERT config mlp_bias=True; jaxserve runs mlp_bias=False only "
                              "(transformers' default)")
    pooling = raw.get("classifier_pooling", raw.get("clf_pooling", "late"))
    if pooling not in CLASSIFIER_POOLING:
        raise CheckpointError(f"unsupported EuroBERT classifier_pooling {pooling!r}; "
                              f"supported: {', '.join(CLASSIFIER_POOLING)}")
    max_pos = raw.get("max_position_embeddings", DEFAULT_MAX_POSITIONS)
    if not isinstance(max_pos, int) or isinstance(max_pos, bool) or max_pos < 1:
        raise CheckpointError(f"max_position_embeddings must be a positive integer, not {max_pos!r}")
    bias = bool(raw.get("attention_bias", False))
    return Config(
        model_type=raw["model_type"], vocab_size=raw["vocab_size"], hidden_size=hidden,
        num_layers=raw["num_hidden_layers"], num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=raw["intermediate_size"], max_position_embeddings=max_pos,
        rope_theta=decoder.rope_theta(raw), rms_norm_eps=float(raw.get("rms_norm_eps", DEFAULT_RMS_EPS)),
        hidden_act=layers.check_activation(raw.get("hidden_act", "silu")), qkv_bias=bias, out_bias=bias,
        windows=(None,) * raw["num_hidden_layers"], classifier_pooling=pooling,
    )


class ClassificationHead(nn.Module):
    """EuroBertForSequenceClassification after pooling: classifier(GELU(dense(x)))."""

    cfg: Config
    num_labels: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, pooled_bkd):  # [B, K, D]
        x = jax.nn.gelu(dense(self.cfg.hidden_size, self.dtype, "dense")(pooled_bkd), approximate=False)
        return dense(self.num_labels, self.dtype, "out")(x)  # [B, K, L]


def head(cfg: Config, num_labels: int, dtype=jnp.float32) -> ClassificationHead:
    """The classifier module, or a CheckpointError for "late" pooling (see the module docstring)."""
    if CLASSIFIER_POOLING[cfg.classifier_pooling] is None:
        raise CheckpointError("EuroBERT classifier_pooling 'late' (the head on every token, logits averaged) is not "
                              "supported; jaxserve runs 'bos' and 'mean' classifiers")
    return ClassificationHead(cfg, num_labels, dtype)


def head_weights(cfg: Config) -> dict:
    return {"dense": linear("dense"), "out": linear("classifier")}


FAMILY = Family(
    name="eurobert", model_types=("eurobert",), configure=configure, encoder=decoder.Decoder,
    weights=decoder.weights, encoder_prefixes=lambda cfg: ("model.",),
    ignored=("lm_head.", "dense.", "classifier."), head=head, head_weights=head_weights,
    head_pooling=lambda cfg: CLASSIFIER_POOLING[cfg.classifier_pooling] or "mean",  # "late": `head` refuses it
)
