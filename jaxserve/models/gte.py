"""Alibaba GTE (gte-base/large-en-v1.5, gte-multilingual-base and its reranker): NomicBERT's encoder with biases.

As transformers' `GteModel` and the hub's own (remote) `NewModel` that TEI reads:
the layers of `nomic_bert.Encoder` (post-LayerNorm, RoPE, gated MLP), with biases
on q, k, v, the attention output and the MLP's down projection (none on its fused
up/gate projection), and a token-type table only where `type_vocab_size` > 0
(gte-base-en-v1.5 has none).

config.json's `model_type` is `new` on the hub (its remote code) and `gte` in
transformers 5; the tensors carry the hub's names in both (transformers converts
them when it loads and back when it saves). The hub's `rope_scaling` `ntk` is
static: the base times the factor f and every frequency divided by f ** (2 / H),
at every length, as the hub's `NTKScalingRotaryEmbedding` (and TEI) compute it.
"""

from __future__ import annotations

import numpy as np

from jaxserve.errors import CheckpointError
from jaxserve.models import bert, layers
from jaxserve.models.family import Family
from jaxserve.models.layers import linear
from jaxserve.models.nomic_bert import Config, Encoder, positive_float, positive_int

DEFAULT_THETA = 160_000.0  # transformers' GteConfig.default_theta
# The hub's config flags that change the architecture, with the value jaxserve runs; others are refused.
HUB_FIXED = {"position_embedding_type": "rope", "layer_norm_type": "layer_norm", "logn_attention_scale": False,
             "logn_attention_clip1": False, "pack_qkv": True}


def configure(raw: dict) -> Config:
    """config.json as transformers' GteConfig (`gte`) or the hub's NewConfig (`new`) reads it."""
    layers.require_ints(raw, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "intermediate_size")
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    head_dim = layers.rotary_head_dim(hidden, heads)
    model_type = raw["model_type"]
    theta, position_scale = (hub_rope if model_type == "new" else transformers_rope)(raw, head_dim)
    type_vocab = raw.get("type_vocab_size", 1) if model_type == "gte" else raw.get("type_vocab_size")
    if not isinstance(type_vocab, int) or isinstance(type_vocab, bool) or type_vocab < 0:
        raise CheckpointError(f"type_vocab_size must be a non-negative integer, not {type_vocab!r}")
    return Config(
        model_type=model_type, vocab_size=raw["vocab_size"], hidden_size=hidden, num_layers=raw["num_hidden_layers"],
        num_heads=heads, head_dim=head_dim, intermediate_size=raw["intermediate_size"],
        max_position_embeddings=positive_int(raw.get("max_position_embeddings", 8192), "max_position_embeddings"),
        type_vocab_size=type_vocab, hidden_act=layers.check_activation(raw.get("hidden_act", "gelu")),
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)), rope_theta=theta,
        rope_position_scale=position_scale, biases=True,
    )


def transformers_rope(raw: dict, head_dim: int) -> tuple[float, float]:
    """(base, position scale) from `rope_parameters`; transformers' dynamic RoPE changes nothing up to
    max_position_embeddings, the longest sequence served."""
    rope = {**(raw.get("rope_parameters") or {}), **(raw.get("rope_scaling") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "dynamic"):
        raise CheckpointError(f"unsupported RoPE type {kind!r} (rope parameters {rope}); only 'default' and 'dynamic'")
    return positive_float(rope.get("rope_theta", raw.get("rope_theta", DEFAULT_THETA)), "rope_theta"), 1.0


def hub_rope(raw: dict, head_dim: int) -> tuple[float, float]:
    """(base, position scale) of the hub's NewConfig: `rope_theta` (required, as TEI requires it), and
    `rope_scaling` null or static `ntk`."""
    for key, want in HUB_FIXED.items():
        if raw.get(key, want) != want:
            raise CheckpointError(f"unsupported GTE config {key}={raw[key]!r}; jaxserve runs {key}={want!r} only")
    theta = positive_float(raw.get("rope_theta"), "rope_theta")
    scaling = raw.get("rope_scaling")
    if not scaling:
        return theta, 1.0
    kind = scaling.get("type", scaling.get("rope_type")) if isinstance(scaling, dict) else None
    if kind != "ntk" or scaling.get("mixed_b") is not None:
        raise CheckpointError(f"unsupported GTE rope_scaling {scaling}; only {{'type': 'ntk', 'factor': f}} "
                              "(without mixed_b)")
    factor = positive_float(scaling.get("factor"), "rope_scaling factor")
    return theta * factor, factor ** (-2 / head_dim)


# ---- checkpoint names ----

def up_gate(name: str) -> tuple:
    """The hub's fused `up_gate_proj` [up; gate] -> our Dense kernel [D, gate | up] (the gate's half first)."""
    return ([f"{name}.weight"], lambda w: np.concatenate(np.split(w, 2)[::-1]).T)


def weights(cfg: Config) -> dict:
    """Our params tree from the hub's tensor names (which `GteModel.save_pretrained` writes too)."""
    tree = {
        "word": {"embedding": layers.tensor("embeddings.word_embeddings.weight")},
        "emb_ln": layers.layer_norm_weights("embeddings.LayerNorm"),
    }
    if cfg.type_vocab_size:
        tree["token_type"] = {"embedding": layers.tensor("embeddings.token_type_embeddings.weight")}
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}"
        tree[f"layer_{i}"] = {
            "qkv": linear(f"{p}.attention.qkv_proj"),  # q, k, v stacked
            "out": linear(f"{p}.attention.o_proj"),
            "norm1": layers.layer_norm_weights(f"{p}.attn_ln"),
            "gate_up": {"kernel": up_gate(f"{p}.mlp.up_gate_proj")},
            "down": linear(f"{p}.mlp.down_proj"),
            "norm2": layers.layer_norm_weights(f"{p}.mlp_ln"),
        }
    return tree


def head_weights(cfg: Config) -> dict:
    """GteForSequenceClassification (and the hub's NewForSequenceClassification): BERT's pooler and classifier."""
    return {"dense": linear("pooler.dense"), "out": linear("classifier")}


FAMILY = Family(
    name="gte", model_types=("gte", "new"), configure=configure, encoder=Encoder, weights=weights,
    encoder_prefixes=lambda cfg: ("gte.", "new."), ignored=("pooler.", "classifier.", "lm_head."),
    head=bert.ClassificationHead, head_weights=head_weights, head_pooling="cls",
)
