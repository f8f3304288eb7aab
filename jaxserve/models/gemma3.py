"""Gemma 3 text models (EmbeddingGemma): pre- and post-normed blocks, sliding and global layers, GeGLU.

As transformers' Gemma3TextModel:
- word embeddings scaled by sqrt(hidden_size), in the embedding's dtype;
- four RMSNorms per layer, around attention and around the MLP, each (1 + weight) in float32;
- RMSNorm over each head of q and k before RoPE; scores scaled by query_pre_attn_scalar ** -0.5;
- `layer_types` names each layer sliding or full, and the two kinds rotate with their own RoPE
  (local and global base; linear scaling on either where the config asks for it);
- causal attention, or bidirectional with `use_bidirectional_attention` (EmbeddingGemma). Then
  a sliding layer sees keys with |query - key| <= sliding_window // 2: transformers halves the
  window of bidirectional configs when it reads them (Gemma3TextConfig.__post_init__).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from flax import linen as nn

from jaxserve.dims import ModelDims
from jaxserve.errors import CheckpointError
from jaxserve.models import layers
from jaxserve.models.attention import Masks, Spec, attend
from jaxserve.models.decoder import ScoreHead, head_weights, window_size
from jaxserve.models.family import Family
from jaxserve.models.layers import RMSNorm, dense, embedding, linear, rotary

MODEL_TYPES = ("gemma3_text", "gemma3")
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear")
# Gemma3TextConfig's defaults where a config.json omits the field.
DEFAULT_HEAD_DIM = 256
DEFAULT_KV_HEADS = 4
DEFAULT_QUERY_PRE_ATTN_SCALAR = 256
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_SLIDING_WINDOW_PATTERN = 6  # every sixth layer is full
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
# Legacy top-level fields that set each layer kind's RoPE base.
LEGACY_THETA_FIELD = {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}


@dataclasses.dataclass(frozen=True)
class Rope:
    theta: float
    factor: float = 1.0  # linear scaling: positions divided by it


@dataclasses.dataclass(frozen=True)
class Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # Gemma's is not hidden_size // num_heads
    intermediate_size: int
    max_position_embeddings: int
    layer_types: tuple[str, ...]  # per layer: full_attention or sliding_attention
    sliding_window: int | None = DEFAULT_SLIDING_WINDOW  # as config.json gives it
    bidirectional: bool = False
    query_pre_attn_scalar: float = DEFAULT_QUERY_PRE_ATTN_SCALAR
    rms_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    global_rope: Rope = Rope(DEFAULT_THETA["full_attention"])
    local_rope: Rope = Rope(DEFAULT_THETA["sliding_attention"])
    pad_token_id: int | None = 0  # the token a classifier's last-token head looks past (Gemma3TextConfig's default)

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings

    @property
    def window(self) -> int | None:
        """Sliding layers see keys with |query position - key position| < window (Spec's rule).

        Causal: transformers' `sliding_window` itself. Bidirectional: transformers keeps
        sliding_window // 2 + 1 and lets a query see keys nearer than that, both ways.
        """
        if self.sliding_window is None:
            return None
        return self.sliding_window // 2 + 1 if self.bidirectional else self.sliding_window

    @property
    def specs(self) -> tuple[Spec, ...]:
        causal = not self.bidirectional
        return tuple(Spec(causal, self.window if t == "sliding_attention" else None) for t in self.layer_types)

    @property
    def ropes(self) -> tuple[Rope, ...]:
        return tuple(self.local_rope if t == "sliding_attention" else self.global_rope for t in self.layer_types)

    def dims(self, dtype_bytes: int) -> ModelDims:
        return ModelDims(
            self.hidden_size, self.intermediate_size, self.num_heads, dtype_bytes, layers=self.num_layers,
            kv_heads=self.num_kv_heads, head_dim=self.head_dim, gated=True, mask_kinds=len(set(self.specs)),
        )

    @classmethod
    def from_dict(cls, raw: dict) -> "Config":
        """config.json as transformers 5 reads it (Gemma3TextConfig's defaults where a field is missing)."""
        if raw["model_type"] == "gemma3":
            raise CheckpointError(
                "model_type 'gemma3' is Gemma 3's multimodal checkpoint (Gemma3ForConditionalGeneration: a "
                "text_config, a vision tower, weights under model.language_model.); jaxserve runs only the text "
                "model, model_type 'gemma3_text' (EmbeddingGemma, Gemma3ForCausalLM, "
                "Gemma3TextForSequenceClassification)"
            )
        layers.require_ints(raw, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                            "intermediate_size", "max_position_embeddings")
        act = layers.check_activation(raw.get("hidden_activation") or "gelu_pytorch_tanh", "hidden_activation")
        if raw.get("is_causal", True) is False and not raw.get("use_bidirectional_attention"):
            raise CheckpointError("unsupported is_causal=false without use_bidirectional_attention: transformers then "
                                  "runs its own bidirectional masks, which jaxserve does not implement")
        if raw.get("attn_logit_softcapping") is not None:
            raise CheckpointError(f"unsupported attn_logit_softcapping {raw['attn_logit_softcapping']!r}; "
                                  "only null (Gemma 3 has none)")
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads") or DEFAULT_KV_HEADS
        if heads % kv_heads:
            raise CheckpointError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = raw.get("head_dim") or DEFAULT_HEAD_DIM
        if head_dim % 2:
            raise CheckpointError(f"head_dim {head_dim} is odd; rotary embedding needs an even head_dim")
        kinds = layer_types(raw)
        window = window_size(raw.get("sliding_window", DEFAULT_SLIDING_WINDOW))
        if "sliding_attention" in kinds and window is None:
            raise CheckpointError("layer_types has sliding_attention layers but sliding_window is null")
        ropes = rope_parameters(raw)
        return cls(
            model_type=raw["model_type"],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=raw["max_position_embeddings"],
            layer_types=kinds,
            sliding_window=window,
            bidirectional=bool(raw.get("use_bidirectional_attention")),
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or DEFAULT_QUERY_PRE_ATTN_SCALAR),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            hidden_act=act,
            attention_bias=bool(raw.get("attention_bias", False)),
            global_rope=ropes["full_attention"],
            local_rope=ropes["sliding_attention"],
            pad_token_id=layers.optional_int(raw, "pad_token_id", default=0),
        )


def layer_types(raw: dict) -> tuple[str, ...]:
    """Each layer's kind: `layer_types`, or else every `sliding_window_pattern`-th layer full (default 6)."""
    n = raw["num_hidden_layers"]
    kinds = raw.get("layer_types")
    if kinds is None:
        pattern = raw.get("sliding_window_pattern", DEFAULT_SLIDING_WINDOW_PATTERN)
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if len(kinds) != n or not set(kinds) <= set(LAYER_TYPES):
        raise CheckpointError(f"layer_types {kinds} must name one of {', '.join(LAYER_TYPES)} for each of {n} layers")
    return tuple(kinds)


def rope_parameters(raw: dict) -> dict[str, Rope]:
    """Each layer kind's RoPE, read as Gemma3TextConfig reads it.

    transformers 5 writes `rope_parameters` per layer kind. Older configs give
    `rope_theta` (full layers), `rope_local_base_freq` (sliding layers) and a
    `rope_scaling` that applies to the full layers only. Default and linear
    RoPE are implemented; any other type is refused.
    """
    params = raw.get("rope_parameters") or {}
    flat = sorted(set(params) - set(LAYER_TYPES))
    if flat:
        raise CheckpointError(f"rope_parameters {params} must be given per layer type ({', '.join(LAYER_TYPES)}), "
                              f"not as {flat}")
    params = {kind: dict(params.get(kind) or {"rope_type": "default"}) for kind in LAYER_TYPES}
    scaling = raw.get("rope_scaling")
    if scaling:
        if "rope_type" not in scaling:  # transformers 5 merges it over {"rope_type": "default"} and ignores `type`
            raise CheckpointError(f"rope_scaling {scaling} has no rope_type: transformers 4 read its `type`, "
                                  "transformers 5 ignores it; name the rope_type")
        params["full_attention"].update(scaling)
    out = {}
    for kind, p in params.items():
        rope_type = p.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise CheckpointError(f"unsupported RoPE type {rope_type!r} for {kind} layers (rope parameters {p}); "
                                  f"supported: {', '.join(ROPE_TYPES)}")
        if p.get("partial_rotary_factor", 1.0) != 1.0:
            raise CheckpointError(f"unsupported partial_rotary_factor {p['partial_rotary_factor']} for {kind} layers")
        theta = p.get("rope_theta", raw.get(LEGACY_THETA_FIELD[kind], DEFAULT_THETA[kind]))
        factor = float(p["factor"]) if rope_type == "linear" else 1.0
        if factor <= 0:
            raise CheckpointError(f"linear RoPE factor {factor} for {kind} layers must be positive")
        out[kind] = Rope(float(theta), factor)
    return out


def rope(x, positions, r: Rope):
    """RoPE of x [B, S, N, H] at each document's own positions [B, S], linearly scaled by `r.factor`."""
    if r.factor != 1.0:
        positions = positions.astype(jnp.float32) / r.factor
    return rotary(x, positions, r.theta)


class Attention(nn.Module):
    """Grouped-query self-attention with q/k norms and RoPE at each document's own positions."""

    cfg: Config
    spec: Spec
    rope: Rope
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_bsd, positions, masks: Masks):
        c = self.cfg
        b, s, _ = x_bsd.shape
        n, kv, h = c.num_heads, c.num_kv_heads, c.head_dim
        q, k, v = layers.qkv_heads(x_bsd, n, kv, h, self.dtype, use_bias=c.attention_bias)  # [B, S, N or KV, H]
        q = RMSNorm(c.rms_norm_eps, self.dtype, offset=1.0, name="q_norm")(q)
        k = RMSNorm(c.rms_norm_eps, self.dtype, offset=1.0, name="k_norm")(k)
        q, k = rope(q, positions, self.rope), rope(k, positions, self.rope)
        att = attend(q, k, v, masks, self.spec, scale=c.query_pre_attn_scalar ** -0.5)  # [B, S, N, H]
        return dense(c.hidden_size, self.dtype, "out", use_bias=c.attention_bias)(att.reshape(b, s, n * h))


class Block(nn.Module):
    """x + norm(attention(norm(x))), then x + norm(GeGLU(norm(x)))."""

    cfg: Config
    spec: Spec
    rope: Rope
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_bsd, positions, masks: Masks):
        c = self.cfg
        norm = lambda name: RMSNorm(c.rms_norm_eps, self.dtype, offset=1.0, name=name)
        att = Attention(c, self.spec, self.rope, self.dtype, name="attn")(norm("attn_norm")(x_bsd), positions, masks)
        x_bsd = x_bsd + norm("post_attn_norm")(att)
        mlp = layers.gated_mlp(norm("mlp_norm")(x_bsd), c.intermediate_size, c.hidden_size, c.hidden_act,
                               self.dtype, ("gate_up", "down"), use_bias=False)  # [B, S, D]
        return x_bsd + norm("post_mlp_norm")(mlp)


class Encoder(nn.Module):
    """Token ids -> last hidden states after the final norm [B, S, D]; token types are unused."""

    cfg: Config
    dtype: jnp.dtype = jnp.float32
    attention: str = "dense"

    @nn.compact
    def __call__(self, token_ids, segment_ids, positions, type_ids, packed: bool = True):  # each [B, S] int32
        c = self.cfg
        x = embedding(c.vocab_size, c.hidden_size, self.dtype, "embed")(token_ids)  # [B, S, D]
        x = x * jnp.asarray(math.sqrt(c.hidden_size), self.dtype)  # the scale rounded to the dtype, as transformers
        masks = Masks(segment_ids, positions, packed, self.attention)
        for i, (spec, r) in enumerate(zip(c.specs, c.ropes)):
            x = Block(c, spec, r, self.dtype, name=f"layer_{i}")(x, positions, masks)
        return RMSNorm(c.rms_norm_eps, self.dtype, offset=1.0, name="norm")(x)


# ---- checkpoint names ----

def weights(cfg: Config) -> dict:
    """Our params tree from the names `Gemma3TextModel.save_pretrained` writes."""
    tree = {"embed": {"embedding": layers.tensor("embed_tokens.weight")}, "norm": layers.rms_norm_weights("norm")}
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        tree[f"layer_{i}"] = {
            "attn_norm": layers.rms_norm_weights(f"{p}.input_layernorm"),
            "attn": {
                "qkv": layers.fused_linear([f"{p}.self_attn.{n}_proj" for n in "qkv"], bias=cfg.attention_bias),
                "q_norm": layers.rms_norm_weights(f"{p}.self_attn.q_norm"),
                "k_norm": layers.rms_norm_weights(f"{p}.self_attn.k_norm"),
                "out": linear(f"{p}.self_attn.o_proj", bias=cfg.attention_bias),
            },
            "post_attn_norm": layers.rms_norm_weights(f"{p}.post_attention_layernorm"),
            "mlp_norm": layers.rms_norm_weights(f"{p}.pre_feedforward_layernorm"),
            "gate_up": layers.fused_linear([f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"], bias=False),
            "down": linear(f"{p}.mlp.down_proj", bias=False),
            "post_mlp_norm": layers.rms_norm_weights(f"{p}.post_feedforward_layernorm"),
        }
    return tree


# Gemma3TextForSequenceClassification is transformers' generic one: a bias-free `score` Linear on
# each sequence's last token, the encoder under `model.` (as Gemma3ForCausalLM, whose lm_head is unused).
FAMILY = Family(
    name="gemma3", model_types=MODEL_TYPES, configure=Config.from_dict, encoder=Encoder, weights=weights,
    encoder_prefixes=lambda cfg: ("model.",), ignored=("lm_head.", "score."), head=ScoreHead,
    head_weights=head_weights, head_pooling="lasttoken",
)
