"""Qwen3, Qwen2 and Mistral: pre-RMSNorm causal decoders with RoPE, grouped-query attention and SwiGLU.

Used as embedders (Qwen3-Embedding, gte-Qwen2, e5-mistral): the output is the
last hidden state after the final norm, which sentence-transformers pools
with `lasttoken`. The three differ only in flags the config sets:
- Qwen3: RMSNorm over each head's q and k before RoPE; biases iff `attention_bias`.
- Qwen2: biases on q, k and v (never on the output projection).
- Mistral: no biases; a causal sliding window on every layer unless `sliding_window` is null.
Qwen2 and Qwen3 may slide on some layers (`use_sliding_window`, `max_window_layers`, `layer_types`).
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
from jaxserve.models.layers import RMSNorm, dense, embedding, linear, rotary

MODEL_TYPES = ("qwen3", "qwen2", "mistral")
LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' config defaults where a config.json omits the field.
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_MAX_WINDOW_LAYERS = 28
QWEN3_DEFAULT_HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # may differ from hidden_size // num_heads (Qwen3)
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    qkv_bias: bool = False
    out_bias: bool = False
    windows: tuple[int | None, ...] = ()  # per layer: sliding-window size, None for full causal attention
    pad_token_id: int | None = None  # the token a classifier's last-token head looks past

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings

    @property
    def specs(self) -> tuple[Spec, ...]:
        """Each layer's attention rule: causal, and within its window if it slides."""
        return tuple(Spec(causal=True, window=w) for w in self.windows)

    def dims(self, dtype_bytes: int) -> ModelDims:
        return ModelDims(
            self.hidden_size, self.intermediate_size, self.num_heads, dtype_bytes, layers=self.num_layers,
            kv_heads=self.num_kv_heads, head_dim=self.head_dim, gated=True, mask_kinds=len(set(self.windows)),
        )

    @classmethod
    def from_dict(cls, raw: dict) -> "Config":
        """config.json as transformers reads it (its defaults where a field is missing)."""
        model_type = raw["model_type"]
        if model_type not in MODEL_TYPES:
            raise CheckpointError(f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
        layers.require_ints(raw, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                            "intermediate_size", "max_position_embeddings")
        layers.check_activation(raw.get("hidden_act", "silu"))
        if raw.get("is_causal", True) is False:
            raise CheckpointError("unsupported is_causal=false: transformers then runs the decoder bidirectional; "
                                  "jaxserve runs these families causal only")
        heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise CheckpointError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = raw.get("head_dim") or (QWEN3_DEFAULT_HEAD_DIM if model_type == "qwen3" else hidden // heads)
        if model_type != "qwen3" and not raw.get("head_dim") and hidden % heads:
            raise CheckpointError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        if head_dim % 2:
            raise CheckpointError(f"head_dim {head_dim} is odd; rotary embedding needs an even head_dim")
        bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=raw["max_position_embeddings"],
            rope_theta=rope_theta(raw),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            hidden_act=raw.get("hidden_act", "silu"),
            qk_norm=model_type == "qwen3",
            qkv_bias={"qwen3": bias, "qwen2": True, "mistral": False}[model_type],
            out_bias=model_type == "qwen3" and bias,
            windows=layer_windows(raw),
            pad_token_id=layers.optional_int(raw, "pad_token_id"),
        )


def rope_theta(raw: dict) -> float:
    """RoPE's base from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (older configs).

    Only the default (unscaled) rotary embedding is implemented; any scaling is refused.
    """
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in rope.values()):
        raise CheckpointError(f"unsupported rope parameters per layer type {sorted(rope)}; only one global RoPE")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise CheckpointError(f"unsupported RoPE type {kind!r} (rope parameters {rope}); only 'default'")
    return float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0)))


def layer_windows(raw: dict) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full causal), by transformers' rules for the model type.

    Mistral slides on every layer while `sliding_window` is set (4096 when the
    field is absent). Qwen2/3 slide only with `use_sliding_window`, on the
    layers `layer_types` names, or by default those from `max_window_layers` on.
    """
    n = raw["num_hidden_layers"]
    if raw["model_type"] == "mistral":
        return (window_size(raw.get("sliding_window", DEFAULT_SLIDING_WINDOW)),) * n
    window = window_size(raw.get("sliding_window", DEFAULT_SLIDING_WINDOW)) if raw.get("use_sliding_window") else None
    kinds = raw.get("layer_types")
    if kinds is None:
        first = raw.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
        kinds = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n)]
    if len(kinds) != n or not set(kinds) <= set(LAYER_TYPES):
        raise CheckpointError(f"layer_types {kinds} must name one of {', '.join(LAYER_TYPES)} for each of {n} layers")
    if "sliding_attention" in kinds and window is None:
        raise CheckpointError("layer_types has sliding_attention layers but no sliding window is set "
                              "(use_sliding_window is false or sliding_window is null)")
    return tuple(window if k == "sliding_attention" else None for k in kinds)


def window_size(value) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"sliding_window must be a positive integer or null, not {value!r}")
    return value


class Attention(nn.Module):
    """Grouped-query causal self-attention with RoPE at each document's own positions."""

    cfg: Config
    spec: Spec
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_bsd, positions, masks: Masks):
        c = self.cfg
        b, s, _ = x_bsd.shape
        n, kv, h = c.num_heads, c.num_kv_heads, c.head_dim
        q, k, v = layers.qkv_heads(x_bsd, n, kv, h, self.dtype, use_bias=c.qkv_bias)  # [B, S, N or KV, H]
        if c.qk_norm:
            q = RMSNorm(c.rms_norm_eps, self.dtype, name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, self.dtype, name="k_norm")(k)
        q, k = rotary(q, positions, c.rope_theta), rotary(k, positions, c.rope_theta)
        att = attention.attend(q, k, v, masks, self.spec)  # [B, S, N, H]
        return dense(c.hidden_size, self.dtype, "out", use_bias=c.out_bias)(att.reshape(b, s, n * h))  # [B, S, D]


class Block(nn.Module):
    """x + attention(norm(x)), then x + SwiGLU(norm(x)) (pre-norm)."""

    cfg: Config
    spec: Spec
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_bsd, positions, masks: Masks):
        c = self.cfg
        norm = lambda name: RMSNorm(c.rms_norm_eps, self.dtype, name=name)
        x_bsd = x_bsd + Attention(c, self.spec, self.dtype, name="attn")(norm("attn_norm")(x_bsd), positions, masks)
        return x_bsd + layers.gated_mlp(norm("mlp_norm")(x_bsd), c.intermediate_size, c.hidden_size, c.hidden_act,
                                        self.dtype, ("gate_up", "down"), use_bias=False)  # [B, S, D]


class Decoder(nn.Module):
    """Token ids -> last hidden states after the final norm [B, S, D]; token types are unused."""

    cfg: Config
    dtype: jnp.dtype = jnp.float32
    attention: str = "dense"

    @nn.compact
    def __call__(self, token_ids, segment_ids, positions, type_ids, packed: bool = True):  # each [B, S] int32
        c = self.cfg
        x = embedding(c.vocab_size, c.hidden_size, self.dtype, "embed")(token_ids)  # [B, S, D]
        masks = Masks(segment_ids, positions, packed, self.attention)
        for i, spec in enumerate(c.specs):
            x = Block(c, spec, self.dtype, name=f"layer_{i}")(x, positions, masks)
        return RMSNorm(c.rms_norm_eps, self.dtype, name="norm")(x)


class ScoreHead(nn.Module):
    """transformers' *ForSequenceClassification: a bias-free `score` Linear on each document's last token.

    An LLM reranker (sentence-transformers' LogitScore) is this head with one output whose kernel is the LM head's
    "yes" row minus its "no" row (`checkpoint.llm_reranker.score_kernel`): the log-odds at the last token from
    [B, K, D] states, no vocabulary-wide logits.
    """

    cfg: Config
    num_labels: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, last_bkd):  # [B, K, D]
        return dense(self.num_labels, self.dtype, "score", use_bias=False)(last_bkd)  # [B, K, L]


# ---- checkpoint names ----

def weights(cfg: Config) -> dict:
    """Our params tree from the names `Qwen3Model.save_pretrained` (and Qwen2/Mistral) writes."""
    tree = {"embed": {"embedding": layers.tensor("embed_tokens.weight")}, "norm": layers.rms_norm_weights("norm")}
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        attn = {
            "qkv": layers.fused_linear([f"{p}.self_attn.{n}_proj" for n in "qkv"], bias=cfg.qkv_bias),
            "out": linear(f"{p}.self_attn.o_proj", bias=cfg.out_bias),
        }
        if cfg.qk_norm:
            attn["q_norm"] = layers.rms_norm_weights(f"{p}.self_attn.q_norm")
            attn["k_norm"] = layers.rms_norm_weights(f"{p}.self_attn.k_norm")
        tree[f"layer_{i}"] = {
            "attn_norm": layers.rms_norm_weights(f"{p}.input_layernorm"),
            "attn": attn,
            "mlp_norm": layers.rms_norm_weights(f"{p}.post_attention_layernorm"),
            "gate_up": layers.fused_linear([f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"], bias=False),
            "down": linear(f"{p}.mlp.down_proj", bias=False),
        }
    return tree


def head_weights(cfg: Config) -> dict:
    return {"score": linear("score", bias=False)}


FAMILY = Family(
    name="decoder", model_types=MODEL_TYPES, configure=Config.from_dict, encoder=Decoder, weights=weights,
    encoder_prefixes=lambda cfg: ("model.",), ignored=("lm_head.", "score."), head=ScoreHead,
    head_weights=head_weights, head_pooling="lasttoken",
)
