"""ModernBERT: a pre-LayerNorm encoder with RoPE, GeGLU and alternating global and local attention.

As transformers' `ModernBertModel` (gte-modernbert-base, modernbert-embed-base,
gte-reranker-modernbert-base):
- no position table: the token embedding is LayerNormed, and each layer rotates
  q and k at the document's own positions, with one RoPE base for global layers
  and another for local ones;
- local layers see keys within `local_attention // 2` positions either side
  (inclusive), global layers the whole document;
- layer 0 has no attention norm (its input is the embedding norm's output), and
  a final norm follows the last layer;
- biases of the linears and norms are off unless the config turns them on.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import linen as nn

from jaxserve.dims import ModelDims
from jaxserve.errors import CheckpointError
from jaxserve.models import attention, layers
from jaxserve.models.attention import Masks, Spec
from jaxserve.models.family import Family
from jaxserve.models.layers import dense, embedding, layer_norm, linear, rotary

GLOBAL, LOCAL = "full_attention", "sliding_attention"  # transformers' `layer_types` names
# transformers' config defaults where a config.json omits the field.
DEFAULT_GLOBAL_EVERY = 3
DEFAULT_THETA = {GLOBAL: 160_000.0, LOCAL: 10_000.0}
LEGACY_THETA_FIELDS = {GLOBAL: "global_rope_theta", LOCAL: "local_rope_theta"}
POOLINGS = ("cls", "mean")


@dataclasses.dataclass(frozen=True)
class Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    layer_types: tuple[str, ...]  # per layer: GLOBAL or LOCAL
    local_attention: int = 128  # a local layer's whole window: half of it either side of the query
    global_rope_theta: float = DEFAULT_THETA[GLOBAL]
    local_rope_theta: float = DEFAULT_THETA[LOCAL]
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "gelu"
    classifier_pooling: str = "cls"
    classifier_bias: bool = False  # the head's dense layer; the classifier Linear always has a bias
    classifier_act: str = "gelu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings

    @property
    def specs(self) -> tuple[Spec, ...]:
        """Each layer's attention rule. transformers' local mask is |q - k| <= local_attention // 2;
        Spec's window is exclusive (|q - k| < window), hence the + 1."""
        local = Spec(window=self.local_attention // 2 + 1)
        return tuple(local if t == LOCAL else attention.FULL for t in self.layer_types)

    @property
    def thetas(self) -> tuple[float, ...]:
        """Each layer's RoPE base."""
        return tuple(self.local_rope_theta if t == LOCAL else self.global_rope_theta for t in self.layer_types)

    def dims(self, dtype_bytes: int) -> ModelDims:
        return ModelDims(self.hidden_size, self.intermediate_size, self.num_heads, dtype_bytes,
                         layers=self.num_layers, gated=True, mask_kinds=len(set(self.layer_types)))

    @classmethod
    def from_dict(cls, raw: dict) -> "Config":
        """config.json as transformers 5 reads it, older configs' fields included (its defaults where missing)."""
        layers.require_ints(raw, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                            "intermediate_size")
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        if hidden % heads:
            raise CheckpointError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        if (hidden // heads) % 2:
            raise CheckpointError(f"head dim {hidden // heads} is odd; rotary embedding needs an even head dim")
        if raw.get("head_dim") not in (None, hidden // heads):
            raise CheckpointError(f"head_dim {raw['head_dim']} differs from hidden_size / num_attention_heads "
                                  f"({hidden // heads}); only the latter is supported")
        local = raw.get("local_attention", 128)
        if not isinstance(local, int) or isinstance(local, bool) or local < 2:
            raise CheckpointError(f"local_attention must be an integer >= 2, not {local!r}")
        max_pos = raw.get("max_position_embeddings", 8192)
        if not isinstance(max_pos, int) or isinstance(max_pos, bool) or max_pos < 1:
            raise CheckpointError(f"max_position_embeddings must be a positive integer, not {max_pos!r}")
        pooling = raw.get("classifier_pooling", "cls")
        if pooling not in POOLINGS:
            raise CheckpointError(f"unsupported classifier_pooling {pooling!r}; supported: {', '.join(POOLINGS)}")
        thetas = rope_thetas(raw)
        return cls(
            model_type=raw["model_type"],
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=max_pos,
            layer_types=layer_types(raw),
            local_attention=local,
            global_rope_theta=thetas[GLOBAL],
            local_rope_theta=thetas[LOCAL],
            norm_eps=float(raw.get("norm_eps", 1e-5)),
            norm_bias=bool(raw.get("norm_bias", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            hidden_act=layers.check_activation(raw.get("hidden_activation", "gelu"), "hidden_activation"),
            classifier_pooling=pooling,
            classifier_bias=bool(raw.get("classifier_bias", False)),
            classifier_act=layers.check_activation(raw.get("classifier_activation", "gelu"), "classifier_activation"),
        )


def layer_types(raw: dict) -> tuple[str, ...]:
    """`layer_types` (transformers 5), else every `global_attn_every_n_layers`-th layer global from layer 0."""
    n = raw["num_hidden_layers"]
    kinds = raw.get("layer_types")
    if kinds is None:
        every = raw.get("global_attn_every_n_layers", DEFAULT_GLOBAL_EVERY)
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise CheckpointError(f"global_attn_every_n_layers must be a positive integer, not {every!r}")
        kinds = [LOCAL if i % every else GLOBAL for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n or not set(kinds) <= {GLOBAL, LOCAL}:
        raise CheckpointError(f"layer_types {kinds} must name {GLOBAL} or {LOCAL} for each of {n} layers")
    return tuple(kinds)


def rope_thetas(raw: dict) -> dict[str, float]:
    """The RoPE base of each layer type: `rope_parameters` per layer type (transformers 5), else
    `global_rope_theta` / `local_rope_theta` (older configs), else transformers' defaults.

    `rope_scaling` overrides both types' parameters, as transformers applies it; only the
    default (unscaled) rotary embedding is implemented.
    """
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, dict) or not all(isinstance(v, dict) for v in params.values()) \
            or not set(params) <= {GLOBAL, LOCAL}:
        raise CheckpointError(f"rope_parameters {params} must map {GLOBAL} and {LOCAL} to their parameters")
    out = {}
    for kind in (GLOBAL, LOCAL):
        rope = {**params.get(kind, {}), **(raw.get("rope_scaling") or {})}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise CheckpointError(f"unsupported RoPE type {rope_type!r} for {kind} layers; only 'default'")
        theta = rope.get("rope_theta", raw.get(LEGACY_THETA_FIELDS[kind], DEFAULT_THETA[kind]))
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
            raise CheckpointError(f"the RoPE base of {kind} layers must be a positive number, not {theta!r}")
        out[kind] = float(theta)
    return out


class Attention(nn.Module):
    """Self-attention with RoPE at each document's own positions, within the layer's window if local."""

    cfg: Config
    spec: Spec
    theta: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_bsd, positions, masks: Masks):
        c = self.cfg
        b, s, _ = x_bsd.shape
        q, k, v = layers.qkv_heads(x_bsd, c.num_heads, c.num_heads, c.head_dim, self.dtype,
                                   use_bias=c.attention_bias)  # [B, S, N, H]
        q, k = rotary(q, positions, self.theta), rotary(k, positions, self.theta)
        att = attention.attend(q, k, v, masks, self.spec)  # [B, S, N, H]
        return dense(c.hidden_size, self.dtype, "out", use_bias=c.attention_bias)(att.reshape(b, s, c.hidden_size))


class Block(nn.Module):
    """x + attention(norm(x)), then x + GeGLU(norm(x)); layer 0 attends to its input un-normed."""

    cfg: Config
    spec: Spec
    theta: float
    attn_norm: bool
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_bsd, positions, masks: Masks):
        c = self.cfg
        norm = lambda name: layer_norm(c.norm_eps, self.dtype, name, use_bias=c.norm_bias)
        h = norm("attn_norm")(x_bsd) if self.attn_norm else x_bsd
        x_bsd = x_bsd + Attention(c, self.spec, self.theta, self.dtype, name="attn")(h, positions, masks)
        return x_bsd + layers.gated_mlp(norm("mlp_norm")(x_bsd), c.intermediate_size, c.hidden_size, c.hidden_act,
                                        self.dtype, ("mlp_in", "mlp_out"), use_bias=c.mlp_bias)  # [B, S, D]


class Encoder(nn.Module):
    """Token ids -> last hidden states after the final norm [B, S, D]; token types are unused."""

    cfg: Config
    dtype: jnp.dtype = jnp.float32
    attention: str = "dense"

    @nn.compact
    def __call__(self, token_ids, segment_ids, positions, type_ids, packed: bool = True):  # each [B, S] int32
        c = self.cfg
        norm = lambda name: layer_norm(c.norm_eps, self.dtype, name, use_bias=c.norm_bias)
        x = norm("embed_norm")(embedding(c.vocab_size, c.hidden_size, self.dtype, "embed")(token_ids))  # [B, S, D]
        masks = Masks(segment_ids, positions, packed, self.attention)
        for i, (spec, theta) in enumerate(zip(c.specs, c.thetas)):
            x = Block(c, spec, theta, i > 0, self.dtype, name=f"layer_{i}")(x, positions, masks)
        return norm("final_norm")(x)


class ClassificationHead(nn.Module):
    """ModernBertForSequenceClassification's head: dense + activation + norm, then the classifier Linear."""

    cfg: Config
    num_labels: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, pooled_bkd):  # [B, K, D]: the CLS token's or the mean state (`classifier_pooling`)
        c = self.cfg
        x = dense(c.hidden_size, self.dtype, "dense", use_bias=c.classifier_bias)(pooled_bkd)
        x = layer_norm(c.norm_eps, self.dtype, "norm", use_bias=c.norm_bias)(layers.ACTIVATIONS[c.classifier_act](x))
        return dense(self.num_labels, self.dtype, "classifier")(x)  # [B, K, L]


# ---- checkpoint names ----

def weights(cfg: Config) -> dict:
    """Our params tree from the names `ModernBertModel.save_pretrained` writes (Wqkv is q, k, v stacked)."""
    norm = lambda prefix: layers.layer_norm_weights(prefix, bias=cfg.norm_bias)
    tree = {
        "embed": {"embedding": layers.tensor("embeddings.tok_embeddings.weight")},
        "embed_norm": norm("embeddings.norm"),
        "final_norm": norm("final_norm"),
    }
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        tree[f"layer_{i}"] = {
            "attn": {"qkv": linear(f"{p}.attn.Wqkv", bias=cfg.attention_bias),
                     "out": linear(f"{p}.attn.Wo", bias=cfg.attention_bias)},
            "mlp_norm": norm(f"{p}.mlp_norm"),
            "mlp_in": linear(f"{p}.mlp.Wi", bias=cfg.mlp_bias),  # [input; gate] stacked
            "mlp_out": linear(f"{p}.mlp.Wo", bias=cfg.mlp_bias),
        }
        if i > 0:
            tree[f"layer_{i}"]["attn_norm"] = norm(f"{p}.attn_norm")
    return tree


def head_weights(cfg: Config) -> dict:
    return {"dense": linear("head.dense", bias=cfg.classifier_bias),
            "norm": layers.layer_norm_weights("head.norm", bias=cfg.norm_bias),
            "classifier": linear("classifier")}


# Task heads' tensors: the masked-LM head and decoder, the classifier's (read by `head_weights` when used).
IGNORED = ("head.", "decoder.", "classifier.")


FAMILY = Family(
    name="modernbert", model_types=("modernbert",), configure=Config.from_dict, encoder=Encoder, weights=weights,
    encoder_prefixes=lambda cfg: ("model.",), ignored=IGNORED, head=ClassificationHead, head_weights=head_weights,
    head_pooling=lambda cfg: cfg.classifier_pooling,
)
