"""Jina-embeddings-v3: XLM-RoBERTa with rotary positions, and its task LoRA adapters merged at load.

As the hub's remote code (jinaai/xlm-roberta-flash-implementation: `XLMRobertaLoRA` over its
`XLMRobertaModel`) and transformers 5's `JinaEmbeddingsV3Model`:
- word and token-type embeddings summed and LayerNormed (`emb_ln`); no position table;
- each layer post-LN: x = norm1(x + out_proj(attention(rope(q), rope(k), v))), then
  x = norm2(x + fc2(gelu(fc1(x)))); q, k and v fused (`mixer.Wqkv`), biases everywhere.

config.json comes in two layouts, both read into one `Config`: the hub's (`model_type: xlm-roberta`
with `position_embedding_type: rotary`, `rotary_emb_base`, `lora_adaptations`, `task_instructions`,
`lora_rank`, `lora_alpha`) and transformers 5's (`jina_embeddings_v3`, `rope_parameters`). The tensors
carry the hub's names in both (transformers converts them when it loads and back when it saves).

Task adapters. transformers' class has none; in the hub's checkpoint every Linear and Embedding is a
torch parametrization: `X.parametrizations.weight.original` with `X.parametrizations.weight.0.lora_A`
and `lora_B`, one slice per task in `lora_adaptations` order. The hub's `LoRAParametrization` computes,
for task t and scaling alpha / rank, a Linear's weight [out, in] as W + s * B[t] @ A[t] (B [n, out, r],
A [n, r, in]) and an Embedding's table [V, D] as W + s * A[t] @ B[t] (A [n, V, r], B [n, r, D]).
Here that sum is formed once at load for the one task the encoder is loaded with (`Config.task`): the
forward is the backbone's, at no cost per token. Per-request tasks would need the task of every
sequence in the batch (the batch carries ids, segments, positions and token types only) or one merged
tree per task (five times the weights); neither is done. No task: the backbone without adapters, as
the hub's `encode` without a task.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxserve.dims import ModelDims
from jaxserve.errors import CheckpointError
from jaxserve.models import attention, layers
from jaxserve.models.attention import Masks
from jaxserve.models.family import Family
from jaxserve.models.layers import dense, embedding, layer_norm, rotary
from jaxserve.models.nomic_bert import positive_float, positive_int

DEFAULT_THETA = 20_000.0  # transformers' JinaEmbeddingsV3Config.default_theta, the hub's rotary_emb_base
# The hub's config flags that change the architecture, with the value jaxserve runs; any other is refused.
HUB_FIXED = {"position_embedding_type": "rotary", "rotary_emb_interleaved": False, "rotary_emb_fraction": 1.0,
             "prenorm": False, "emb_pre_ln": False, "fused_mlp": False}
PARAMETRIZED = ".parametrizations.weight"  # the hub's LoRA layers: .original, .0.lora_A, .0.lora_B


@dataclasses.dataclass(frozen=True)
class Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int  # the longest sequence served (no position table to index)
    type_vocab_size: int = 1
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-5
    rope_theta: float = DEFAULT_THETA
    adapters: tuple[str, ...] = ()  # the checkpoint's LoRA tasks, in adapter order (none: plain weights)
    lora_scaling: float = 1.0  # lora_alpha / lora_rank
    task_prompts: tuple[tuple[str, str], ...] = ()  # config.json's task_instructions: (task, prompt)
    task: str | None = None  # the adapter merged into the weights at load; None: the backbone alone

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings

    def dims(self, dtype_bytes: int) -> ModelDims:
        return ModelDims(self.hidden_size, self.intermediate_size, self.num_heads, dtype_bytes, layers=self.num_layers)

    def with_task(self, task: str) -> Config:
        """This config with `task`'s adapter chosen; a CheckpointError naming the checkpoint's tasks otherwise."""
        if task not in self.adapters:
            known = ", ".join(repr(t) for t in self.adapters) or "none"
            raise CheckpointError(f"unknown task {task!r}; this checkpoint's task adapters: {known}")
        return dataclasses.replace(self, task=task)


def configure(raw: dict) -> Config:
    """config.json in the hub's layout (`model_type: xlm-roberta`) or transformers 5's (`jina_embeddings_v3`)."""
    layers.require_ints(raw, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "intermediate_size")
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    layers.rotary_head_dim(hidden, heads)
    hub = raw["model_type"] != "jina_embeddings_v3"
    if hub:
        for key, want in HUB_FIXED.items():
            if raw.get(key, want) != want:
                raise CheckpointError(f"unsupported Jina-embeddings-v3 config {key}={raw[key]!r}; "
                                      f"jaxserve runs {key}={want!r} only")
        theta = positive_float(raw.get("rotary_emb_base", DEFAULT_THETA), "rotary_emb_base")
    else:
        rope = {**(raw.get("rope_parameters") or {}), **(raw.get("rope_scaling") or {})}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise CheckpointError(f"unsupported RoPE parameters {rope}; only rope_type 'default'")
        theta = positive_float(rope.get("rope_theta", raw.get("rope_theta", DEFAULT_THETA)), "rope_theta")
    return Config(
        model_type=raw["model_type"], vocab_size=raw["vocab_size"], hidden_size=hidden,
        num_layers=raw["num_hidden_layers"], num_heads=heads, intermediate_size=raw["intermediate_size"],
        max_position_embeddings=positive_int(raw.get("max_position_embeddings", 8194), "max_position_embeddings"),
        type_vocab_size=positive_int(raw.get("type_vocab_size", 1), "type_vocab_size"),
        hidden_act=layers.check_activation(raw.get("hidden_act", "gelu")),
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-5)), rope_theta=theta, **adapter_fields(raw),
    )


def adapter_fields(raw: dict) -> dict:
    """The LoRA tasks and their scaling, where the checkpoint holds trained adapters (`load_trained_adapters`,
    default true, as the hub's code reads it); its `task_instructions` as prompts either way."""
    prompts = raw.get("task_instructions") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise CheckpointError(f"task_instructions must map task names to prompt texts, not {prompts!r}")
    fields = {"task_prompts": tuple((str(k), v) for k, v in prompts.items())}
    tasks = raw.get("lora_adaptations")
    if not tasks or raw.get("load_trained_adapters", True) is False:
        return fields
    if not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks) or len(set(tasks)) != len(tasks):
        raise CheckpointError(f"lora_adaptations must be a list of distinct task names, not {tasks!r}")
    rank = positive_int(raw.get("lora_rank"), "lora_rank")
    alpha = raw.get("lora_alpha", 1)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise CheckpointError(f"lora_alpha must be a number, not {alpha!r}")
    return {**fields, "adapters": tuple(tasks), "lora_scaling": float(alpha) / rank}


class Block(nn.Module):
    """x = norm1(x + attention(x)), then x = norm2(x + fc2(act(fc1(x)))) (post-LN), q and k rotated."""

    cfg: Config
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_bsd, positions, masks: Masks):  # positions [B, S] int32
        c = self.cfg
        b, s, _ = x_bsd.shape
        q, k, v = layers.qkv_heads(x_bsd, c.num_heads, c.num_heads, c.head_dim, self.dtype)  # [B, S, N, H]
        q, k = rotary(q, positions, c.rope_theta), rotary(k, positions, c.rope_theta)
        att = attention.attend(q, k, v, masks).reshape(b, s, c.hidden_size)
        x_bsd = layer_norm(c.layer_norm_eps, self.dtype, "norm1")(x_bsd + dense(c.hidden_size, self.dtype, "out")(att))
        h = layers.ACTIVATIONS[c.hidden_act](dense(c.intermediate_size, self.dtype, "fc1")(x_bsd))  # [B, S, F]
        return layer_norm(c.layer_norm_eps, self.dtype, "norm2")(x_bsd + dense(c.hidden_size, self.dtype, "fc2")(h))


class Encoder(nn.Module):
    """Token ids -> last hidden states [B, S, D], with the weights of the config's task (merged at load)."""

    cfg: Config
    dtype: jnp.dtype = jnp.float32
    attention: str = "dense"

    @nn.compact
    def __call__(self, token_ids, segment_ids, positions, type_ids, packed: bool = True):  # each [B, S] int32
        c = self.cfg
        x = embedding(c.vocab_size, c.hidden_size, self.dtype, "word")(token_ids)
        x = x + embedding(c.type_vocab_size, c.hidden_size, self.dtype, "token_type")(type_ids)
        x = layer_norm(c.layer_norm_eps, self.dtype, "emb_ln")(x)  # [B, S, D]
        masks = Masks(segment_ids, positions, packed, self.attention)
        for i in range(c.num_layers):
            x = Block(c, self.dtype, name=f"layer_{i}")(x, positions, masks)
        return x


# ---- checkpoint names ----

def lora_pair(a: np.ndarray, b: np.ndarray, cfg: Config, name: str, embedding_table: bool) -> tuple:
    """The chosen task's (A[t], B[t]) after checking both stacks have one slice per task and one rank."""
    n = len(cfg.adapters)
    stacked = a.ndim == b.ndim == 3 and a.shape[0] == b.shape[0] == n
    if not stacked or (a.shape[2] != b.shape[1] if embedding_table else a.shape[1] != b.shape[2]):  # the ranks
        raise CheckpointError(f"{name}: LoRA A {a.shape} and B {b.shape} are not {n} adapters of one rank "
                              f"(lora_adaptations: {', '.join(cfg.adapters)})")
    t = cfg.adapters.index(cfg.task)
    return a[t].astype(np.float32), b[t].astype(np.float32)


def merged(cfg: Config, name: str, embedding_table: bool) -> tuple:
    """One weight as the loader reads it: plain, or the hub's parametrization with the task's LoRA added."""
    if not cfg.adapters:
        return [f"{name}.weight"], lambda w: w
    sources = [f"{name}{PARAMETRIZED}.original", f"{name}{PARAMETRIZED}.0.lora_A", f"{name}{PARAMETRIZED}.0.lora_B"]

    def combine(w, a, b):
        if cfg.task is None:
            return w
        a_t, b_t = lora_pair(a, b, cfg, name, embedding_table)
        delta = a_t @ b_t if embedding_table else b_t @ a_t  # [V, D] table; [out, in] Linear
        if delta.shape != w.shape:
            raise CheckpointError(f"{name}: LoRA update {delta.shape} does not fit the weight {w.shape}")
        return w.astype(np.float32) + np.float32(cfg.lora_scaling) * delta

    return sources, combine


def linear(cfg: Config, name: str) -> dict:
    """A torch Linear [out, in] (its task's LoRA merged) -> a Flax Dense (kernel [in, out])."""
    sources, combine = merged(cfg, name, embedding_table=False)
    return {"kernel": (sources, lambda *ws: combine(*ws).T), "bias": layers.tensor(f"{name}.bias")}


def weights(cfg: Config) -> dict:
    """Our params tree from the hub's tensor names (which `JinaEmbeddingsV3Model.save_pretrained` writes too)."""
    tree = {
        "word": {"embedding": merged(cfg, "embeddings.word_embeddings", embedding_table=True)},
        "token_type": {"embedding": merged(cfg, "embeddings.token_type_embeddings", embedding_table=True)},
        "emb_ln": layers.layer_norm_weights("emb_ln"),
    }
    for i in range(cfg.num_layers):
        p = f"encoder.layers.{i}"
        tree[f"layer_{i}"] = {
            "qkv": linear(cfg, f"{p}.mixer.Wqkv"),  # q, k, v stacked
            "out": linear(cfg, f"{p}.mixer.out_proj"),
            "norm1": layers.layer_norm_weights(f"{p}.norm1"),
            "fc1": linear(cfg, f"{p}.mlp.fc1"),
            "fc2": linear(cfg, f"{p}.mlp.fc2"),
            "norm2": layers.layer_norm_weights(f"{p}.norm2"),
        }
    return tree


def is_jina_v3(raw: dict) -> bool:
    """The hub's config says `xlm-roberta`; its rotary positions tell it apart from XLM-R."""
    return raw.get("model_type") == "xlm-roberta" and raw.get("position_embedding_type") == "rotary"


FAMILY = Family(
    name="jina_embeddings_v3", model_types=("jina_embeddings_v3",), configure=configure, encoder=Encoder,
    weights=weights, encoder_prefixes=lambda cfg: ("roberta.",),
    ignored=("pooler.", "roberta.pooler.", "lm_head.", "embeddings.position_ids"),
)
