"""NomicBERT (nomic-embed-text-v1 / v1.5): a post-LayerNorm BERT with RoPE and a SwiGLU MLP, without biases.

As transformers' `NomicBertModel` and the hub's own (remote) code that TEI reads:
- no position table: the word and token-type embeddings are summed and LayerNormed,
  and each layer rotates q and k at the document's own positions;
- each layer is x = norm1(x + attention(x)), then x = norm2(x + fc2(act(fc12(x)) * fc11(x)));
- the projections have no biases.

config.json comes in two layouts, both read into one `Config`: transformers 5's
(`hidden_size`, `rope_parameters`, ...) and the hub's original (`n_embd`,
`rotary_emb_base`, `activation_function: swiglu`, ...). The tensors carry the
hub's names in both: transformers 5 converts them when it loads and converts
them back when it saves.

Long context: the hub's `rotary_scaling_factor` (and transformers' `dynamic` RoPE)
is dynamic NTK scaling: past the trained length L0 a document of length L rotates
with base * (f * L / L0 - (f - 1)) ** (H / (H - 2)). Both references take L from
the padded batch; here each document's own length sets its base, which is what
each gives for the document alone, so a document's vector never depends on its
neighbours.

The encoder is also GTE's (`gte.py`): the same layers with biases, an optional
token-type table and a static NTK rotation (the config's last fields).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxserve.dims import ModelDims
from jaxserve.errors import CheckpointError
from jaxserve.models import attention, bert, layers
from jaxserve.models.attention import Masks
from jaxserve.models.family import Family
from jaxserve.models.layers import dense, embedding, layer_norm, linear, rotary

DEFAULT_THETA = 1000.0  # transformers' NomicBertConfig.default_theta
# The hub's gated activations (its `activation_function`) as the activation of the gate.
HUB_GATED = {"swiglu": "silu", "geglu": "gelu"}
# The hub's config flags that change the architecture, with the value transformers' NomicBertModel (and
# every released nomic-embed-text checkpoint) has; any other value is refused.
HUB_FIXED = {"prenorm": False, "rotary_emb_interleaved": False, "rotary_emb_fraction": 1.0, "qkv_proj_bias": False,
             "mlp_fc1_bias": False, "mlp_fc2_bias": False, "causal": False, "use_rms_norm": False,
             "parallel_block": False, "rotary_emb_scale_base": None}


@dataclasses.dataclass(frozen=True)
class Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int  # the longest sequence served
    type_vocab_size: int = 2
    hidden_act: str = "silu"  # the gate's activation
    layer_norm_eps: float = 1e-12
    rope_theta: float = DEFAULT_THETA
    rope_scaling: float | None = None  # dynamic NTK factor, applied past `trained_positions`
    trained_positions: int | None = None
    rope_position_scale: float = 1.0  # positions times this before rotating (GTE's static NTK)
    biases: bool = False  # GTE: on q, k, v, the attention output and the MLP's down projection

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings

    def dims(self, dtype_bytes: int) -> ModelDims:
        return ModelDims(self.hidden_size, self.intermediate_size, self.num_heads, dtype_bytes,
                         layers=self.num_layers, head_dim=self.head_dim, gated=True)

    @classmethod
    def from_dict(cls, raw: dict) -> "Config":
        """config.json in the hub's original layout (it has `n_embd`) or in transformers 5's."""
        return cls(**(hub_fields(raw) if "n_embd" in raw else transformers_fields(raw)))


def transformers_fields(raw: dict) -> dict:
    """`NomicBertConfig`'s fields, its defaults where missing."""
    layers.require_ints(raw, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "intermediate_size")
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    max_pos = positive_int(raw.get("max_position_embeddings", 2048), "max_position_embeddings")
    rope = {**(raw.get("rope_parameters") or {}), **(raw.get("rope_scaling") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "dynamic"):
        raise CheckpointError(f"unsupported RoPE type {kind!r} (rope parameters {rope}); only 'default' and 'dynamic'")
    # transformers' dynamic RoPE changes nothing up to max_position_embeddings, the longest sequence served.
    return dict(
        model_type=raw["model_type"], vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"], num_heads=heads, head_dim=checked_head_dim(head_dim),
        intermediate_size=raw["intermediate_size"], max_position_embeddings=max_pos,
        type_vocab_size=positive_int(raw.get("type_vocab_size", 2), "type_vocab_size"),
        hidden_act=layers.check_activation(raw.get("hidden_act", "silu")),
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        rope_theta=positive_float(rope.get("rope_theta", raw.get("rope_theta", DEFAULT_THETA)), "rope_theta"),
    )


def hub_fields(raw: dict) -> dict:
    """The hub's `NomicBertConfig` (GPT-2-style names) as TEI reads it; its unsupported variants refused."""
    layers.require_ints(raw, "vocab_size", "n_embd", "n_head", "n_layer", "n_inner", "n_positions")
    for key, want in HUB_FIXED.items():
        if raw.get(key, want) != want:
            raise CheckpointError(f"unsupported NomicBERT config {key}={raw[key]!r}; jaxserve runs {key}={want!r} "
                                  "only, as transformers' NomicBertModel and the released nomic-embed-text models")
    if raw.get("moe_every_n_layers") or raw.get("num_experts"):
        raise CheckpointError("mixture-of-experts NomicBERT (moe_every_n_layers, num_experts: nomic-embed-text-v2-moe) "
                              "is not supported")
    act = raw.get("activation_function", "swiglu")
    if act not in HUB_GATED:
        raise CheckpointError(f"unsupported NomicBERT activation_function {act!r}; supported: {', '.join(HUB_GATED)} "
                              "(the gated MLP of transformers' NomicBertModel)")
    factor = raw.get("rotary_scaling_factor")
    if factor is not None:
        factor = positive_float(factor, "rotary_scaling_factor")
    trained = raw.get("max_trained_positions") or raw.get("max_position_embeddings") or 2048
    return dict(
        model_type=raw["model_type"], vocab_size=raw["vocab_size"], hidden_size=raw["n_embd"],
        num_layers=raw["n_layer"], num_heads=raw["n_head"], head_dim=checked_head_dim(raw["n_embd"] / raw["n_head"]),
        intermediate_size=raw["n_inner"], max_position_embeddings=positive_int(raw["n_positions"], "n_positions"),
        type_vocab_size=positive_int(raw.get("type_vocab_size", 2), "type_vocab_size"),
        hidden_act=HUB_GATED[act], layer_norm_eps=float(raw.get("layer_norm_epsilon", 1e-12)),
        rope_theta=positive_float(raw.get("rotary_emb_base"), "rotary_emb_base"),
        rope_scaling=factor, trained_positions=positive_int(trained, "max_trained_positions") if factor else None,
    )


def checked_head_dim(head_dim) -> int:
    if head_dim != int(head_dim) or int(head_dim) % 2:
        raise CheckpointError(f"head dim {head_dim} is not an even integer; rotary embedding needs one")
    return int(head_dim)


def positive_int(value, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"{field} must be a positive integer, not {value!r}")
    return value


def positive_float(value, field: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"{field} must be a positive number, not {value!r}")
    return float(value)


def document_lengths(segment_ids, positions):
    """Each token's document length [B, S]: its segment's last position + 1 (pad tokens: any, they are masked)."""
    b, s = segment_ids.shape
    flat = (jnp.arange(b)[:, None] * (s + 1) + segment_ids).ravel()  # a distinct id per (row, slot)
    last = jax.ops.segment_max(positions.ravel(), flat, num_segments=b * (s + 1))
    return (last[flat] + 1).reshape(b, s)


def rope_bases(cfg: Config, segment_ids, positions):
    """RoPE's base: one for every token, or per token under dynamic NTK scaling (the module docstring)."""
    if cfg.rope_scaling is None:
        return cfg.rope_theta
    f, trained = cfg.rope_scaling, cfg.trained_positions
    length = jnp.maximum(document_lengths(segment_ids, positions), trained).astype(jnp.float32)
    return cfg.rope_theta * (f * length / trained - (f - 1)) ** (cfg.head_dim / (cfg.head_dim - 2))


class Block(nn.Module):
    """x = norm1(x + attention(x)), then x = norm2(x + gated MLP(x)) (post-LN)."""

    cfg: Config
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_bsd, positions, theta, masks: Masks):  # positions [B, S]: int32, float32 if scaled
        c = self.cfg
        b, s, _ = x_bsd.shape
        q, k, v = layers.qkv_heads(x_bsd, c.num_heads, c.num_heads, c.head_dim, self.dtype, use_bias=c.biases)
        q, k = rotary(q, positions, theta), rotary(k, positions, theta)  # [B, S, N, H]
        att = attention.attend(q, k, v, masks).reshape(b, s, c.num_heads * c.head_dim)
        x_bsd = layer_norm(c.layer_norm_eps, self.dtype, "norm1")(
            x_bsd + dense(c.hidden_size, self.dtype, "out", use_bias=c.biases)(att))
        mlp = layers.gated_mlp(x_bsd, c.intermediate_size, c.hidden_size, c.hidden_act, self.dtype,
                               ("gate_up", "down"), use_bias=False, out_bias=c.biases)
        return layer_norm(c.layer_norm_eps, self.dtype, "norm2")(x_bsd + mlp)  # [B, S, D]


class Encoder(nn.Module):
    """Token ids -> last hidden states [B, S, D]; token types only where the config has a table for them."""

    cfg: Config
    dtype: jnp.dtype = jnp.float32
    attention: str = "dense"

    @nn.compact
    def __call__(self, token_ids, segment_ids, positions, type_ids, packed: bool = True):  # each [B, S] int32
        c = self.cfg
        x = embedding(c.vocab_size, c.hidden_size, self.dtype, "word")(token_ids)
        if c.type_vocab_size:
            x = x + embedding(c.type_vocab_size, c.hidden_size, self.dtype, "token_type")(type_ids)
        x = layer_norm(c.layer_norm_eps, self.dtype, "emb_ln")(x)  # [B, S, D]
        masks = Masks(segment_ids, positions, packed, self.attention)
        theta = rope_bases(c, segment_ids, positions)
        rotated = positions if c.rope_position_scale == 1.0 else positions.astype(jnp.float32) * c.rope_position_scale
        for i in range(c.num_layers):
            x = Block(c, self.dtype, name=f"layer_{i}")(x, rotated, theta, masks)
        return x


# ---- checkpoint names ----

def weights(cfg: Config) -> dict:
    """Our params tree from the hub's tensor names (which `NomicBertModel.save_pretrained` writes too)."""
    tree = {
        "word": {"embedding": layers.tensor("embeddings.word_embeddings.weight")},
        "token_type": {"embedding": layers.tensor("embeddings.token_type_embeddings.weight")},
        "emb_ln": layers.layer_norm_weights("emb_ln"),
    }
    for i in range(cfg.num_layers):
        p = f"encoder.layers.{i}"
        tree[f"layer_{i}"] = {
            "qkv": linear(f"{p}.attn.Wqkv", bias=False),  # q, k, v stacked
            "out": linear(f"{p}.attn.out_proj", bias=False),
            "norm1": layers.layer_norm_weights(f"{p}.norm1"),
            "gate_up": layers.fused_linear([f"{p}.mlp.fc12", f"{p}.mlp.fc11"], bias=False),  # fc12 is the gate
            "down": linear(f"{p}.mlp.fc2", bias=False),
            "norm2": layers.layer_norm_weights(f"{p}.norm2"),
        }
    return tree


def head_weights(cfg: Config) -> dict:
    """NomicBertForSequenceClassification: BERT's pooler and classifier."""
    return {"dense": linear("pooler.dense"), "out": linear("classifier")}


FAMILY = Family(
    name="nomic_bert", model_types=("nomic_bert",), configure=Config.from_dict, encoder=Encoder, weights=weights,
    encoder_prefixes=lambda cfg: ("nomic_bert.", "bert."), ignored=("pooler.", "cls.", "classifier."),
    head=bert.ClassificationHead, head_weights=head_weights, head_pooling="cls",
)
