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
or on the mean of the document's tokens ("mean"). "late" (transformers' default)
applies the head to every token and averages the logits over the document's
tokens. The classifier is affine and the average's weights sum to one, so that
average is the classifier of the averaged GELU(dense(token)): a late classifier's
encoder (`LateEncoder`) ends in the head's per-token dense and GELU ([B, S, D], no
wider), mean pooling per sequence follows (packed as padded), then the classifier.
An embedding model with that default config is a plain encoder (`Config.late_head`).
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
CLASSIFIER_POOLING = {"bos": "cls", "mean": "mean", "late": "mean"}  # EuroBERT's name -> the head's pooling here
CLASSIFIER = "ForSequenceClassification"  # config.json `architectures`: a classifier checkpoint (as HeadConfig reads it)


@dataclasses.dataclass(frozen=True)
class Config(decoder.Config):
    classifier_pooling: str = "late"
    late_head: bool = False  # a "late" classifier: the head's dense and GELU run per token in the encoder


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
        late_head=pooling == "late" and any(a.endswith(CLASSIFIER) for a in raw.get("architectures") or ()),
    )


def _head_tokens(cfg: Config, dtype, x_bsd):
    """The head's part before the classifier: GELU(dense(x)), on pooled states or (late) on every token."""
    return jax.nn.gelu(dense(cfg.hidden_size, dtype, "dense")(x_bsd), approximate=False)


class ClassificationHead(nn.Module):
    """EuroBertForSequenceClassification after pooling: classifier(GELU(dense(x))); a late one's classifier alone
    (its encoder ran the rest on every token: `LateEncoder`)."""

    cfg: Config
    num_labels: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, pooled_bkd):  # [B, K, D]
        x = pooled_bkd if self.cfg.late_head else _head_tokens(self.cfg, self.dtype, pooled_bkd)
        return dense(self.num_labels, self.dtype, "out")(x)  # [B, K, L]


class LateEncoder(nn.Module):
    """A late classifier's encoder: EuroBERT's last hidden states, then the head's dense and GELU on every token
    -> [B, S, D]; mean pooling and the classifier follow (module docstring)."""

    cfg: Config
    dtype: jnp.dtype = jnp.float32
    attention: str = "dense"

    @nn.compact
    def __call__(self, token_ids, segment_ids, positions, type_ids, packed: bool = True):  # each [B, S] int32
        hidden = decoder.Decoder(self.cfg, self.dtype, self.attention, name="encoder")(
            token_ids, segment_ids, positions, type_ids, packed)  # [B, S, D]
        return _head_tokens(self.cfg, self.dtype, hidden)


def encoder(cfg: Config, dtype=jnp.float32, attention: str = "dense") -> nn.Module:
    return (LateEncoder if cfg.late_head else decoder.Decoder)(cfg, dtype, attention)


def weights(cfg: Config) -> dict:
    """Decoder's names; a late classifier's with the head's per-token dense beside them."""
    tree = decoder.weights(cfg)
    return {"encoder": tree, "dense": linear("dense")} if cfg.late_head else tree


def head(cfg: Config, num_labels: int, dtype=jnp.float32) -> ClassificationHead:
    return ClassificationHead(cfg, num_labels, dtype)


def head_weights(cfg: Config) -> dict:
    out = {"out": linear("classifier")}
    return out if cfg.late_head else {"dense": linear("dense"), **out}


FAMILY = Family(
    name="eurobert", model_types=("eurobert",), configure=configure, encoder=encoder,
    weights=weights, encoder_prefixes=lambda cfg: ("model.",),
    ignored=("lm_head.", "dense.", "classifier."), head=head, head_weights=head_weights,
    head_pooling=lambda cfg: CLASSIFIER_POOLING[cfg.classifier_pooling],
)
