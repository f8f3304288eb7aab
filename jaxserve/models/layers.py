"""Building blocks the families share: Flax layers, rotary positions, and checkpoint-name helpers.

Weight helpers describe one leaf of our params tree as (the checkpoint's
tensor names, how to turn them into the leaf); `jaxserve.checkpoint.loader` applies
them and checks every shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxserve.errors import CheckpointError

ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}


def check_activation(name: str, field: str = "hidden_act") -> str:
    """`name` if it is an activation we have; else a CheckpointError naming the config field."""
    if name not in ACTIVATIONS:
        raise CheckpointError(f"unsupported {field} {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return name


def require_ints(raw: dict, *keys: str) -> None:
    missing = [k for k in keys if not isinstance(raw.get(k), int) or isinstance(raw.get(k), bool)]
    if missing:
        raise CheckpointError(f"config.json lacks integer field(s): {', '.join(missing)}")


def optional_int(raw: dict, key: str, default: int | None = None) -> int | None:
    """An integer field that may be null (`pad_token_id`); absent, its default."""
    value = raw.get(key, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise CheckpointError(f"config.json field {key} must be an integer or null, not {value!r}")
    return value


def rotary_head_dim(hidden: int, heads: int) -> int:
    """hidden / heads, which rotary embedding needs whole and even; else a CheckpointError."""
    if hidden % heads or (hidden // heads) % 2:
        raise CheckpointError(f"hidden_size {hidden} / num_attention_heads {heads} is not an even head dim; "
                              "rotary embedding needs one")
    return hidden // heads


# ---- Flax layers (params in the compute dtype) ----

def dense(features: int, dtype, name: str, use_bias: bool = True) -> nn.Dense:
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name)


def embedding(num: int, features: int, dtype, name: str) -> nn.Embed:
    return nn.Embed(num, features, dtype=dtype, param_dtype=dtype, name=name)


def layer_norm(eps: float, dtype, name: str, use_bias: bool = True) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=eps, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name)


def qkv_heads(x_bsd, num_heads: int, num_kv_heads: int, head_dim: int, dtype, use_bias: bool = True):
    """One fused projection `qkv` -> q [B, S, N, H], k and v [B, S, KV, H] (KV = N without grouped heads).

    Call from a compact method: the projection is a submodule of the caller."""
    b, s, _ = x_bsd.shape
    n, kv = num_heads, num_kv_heads
    qkv = dense((n + 2 * kv) * head_dim, dtype, "qkv", use_bias=use_bias)(x_bsd)  # [B, S, (N + 2KV) H]
    return jnp.split(qkv.reshape(b, s, n + 2 * kv, head_dim), [n, n + kv], axis=2)


def gated_mlp(x_bsd, intermediate: int, hidden: int, act: str, dtype, names: tuple[str, str], use_bias: bool,
              out_bias: bool | None = None):
    """act(a) * b, with a and b the halves of one fused projection `names[0]`, then `names[1]` back to
    `hidden` (SwiGLU, GeGLU); `out_bias` (default `use_bias`) where only the second has a bias (GTE).
    Call from a compact method: the projections are submodules of the caller."""
    a, b = jnp.split(dense(2 * intermediate, dtype, names[0], use_bias=use_bias)(x_bsd), 2, axis=-1)  # [B, S, F] each
    out_bias = use_bias if out_bias is None else out_bias
    return dense(hidden, dtype, names[1], use_bias=out_bias)(ACTIVATIONS[act](a) * b)  # [B, S, D]


class RMSNorm(nn.Module):
    """x / rms(x) * scale, computed in float32. `offset=1` for Gemma's (1 + weight) convention."""

    eps: float
    dtype: jnp.dtype
    offset: float = 0.0

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros if self.offset else nn.initializers.ones,
                           (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (self.offset + scale.astype(jnp.float32))).astype(self.dtype)


def rotary(x, positions, theta, rotary_dim: int | None = None):
    """Rotary position embedding (the rotate-half form transformers uses) of x [B, S, N, H] at positions [B, S].

    Positions restart per document, so packed documents each get their own rotation. `theta` is one base for
    every token, or a base per token [B, S] (dynamic NTK scaling, where each document's length sets its base).
    """
    h = x.shape[-1]
    d = rotary_dim or h
    exponents = np.arange(0, d, 2, dtype=np.float64) / d  # [d/2]
    if isinstance(theta, (int, float)):
        inv_freq = jnp.asarray(1.0 / theta ** exponents, jnp.float32)  # [d/2]
    else:
        inv_freq = 1.0 / theta.astype(jnp.float32)[..., None] ** jnp.asarray(exponents, jnp.float32)  # [B, S, d/2]
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, S, d/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, :, None, :]  # [B, S, 1, d]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    xr = x[..., :d].astype(jnp.float32)
    half = d // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], -1)
    out = (xr * cos + rotated * sin).astype(x.dtype)
    return out if d == h else jnp.concatenate([out, x[..., d:]], -1)


# ---- checkpoint names -> params leaves ----

def linear(prefix: str, bias: bool = True) -> dict:
    """A torch Linear [out, in] -> a Flax Dense (kernel [in, out])."""
    out = {"kernel": ([f"{prefix}.weight"], lambda w: w.T)}
    if bias:
        out["bias"] = ([f"{prefix}.bias"], lambda b: b)
    return out


def fused_linear(prefixes: list[str], bias: bool = True) -> dict:
    """Several torch Linears with the same input (Q, K, V) -> one Dense, outputs concatenated."""
    out = {"kernel": ([f"{n}.weight" for n in prefixes], lambda *ws: np.concatenate([w.T for w in ws], axis=1))}
    if bias:
        out["bias"] = ([f"{n}.bias" for n in prefixes], lambda *bs: np.concatenate(bs))
    return out


def layer_norm_weights(prefix: str, bias: bool = True) -> dict:
    out = {"scale": ([f"{prefix}.weight"], lambda w: w)}
    if bias:
        out["bias"] = ([f"{prefix}.bias"], lambda b: b)
    return out


def rms_norm_weights(prefix: str) -> dict:
    return {"scale": ([f"{prefix}.weight"], lambda w: w)}


def tensor(name: str) -> tuple:
    """A leaf copied as is."""
    return ([name], lambda w: w)
