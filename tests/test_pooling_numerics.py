"""Pooling holds on a GPU, where float32 dots run as TF32 unless asked for HIGHEST precision.

A CPU computes every float32 dot in full (it ignores `jax.default_matmul_precision`, and rejects
the bf16/tf32 dot algorithms), so the tests run the pooling jaxpr through an interpreter that does
what a GPU does: the float32 operands of every dot not at HIGHEST precision are rounded to TF32
(10 mantissa bits, so integers are exact only up to 2048). A document of 3001 tokens then tells
the float path of positions from the integer one. Every float32 dot after the encoder (the Dense
layers, the multi-vector projection, the SPLADE head) asks for the same precision as the pooling's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from jax.extend.core import ClosedJaxpr, Literal

from jaxserve.checkpoint.config import DenseLayer
from jaxserve.heads import forwards, sparse
from jaxserve.heads.pooling import dense_layers, pool
from jaxserve.models import family_of

MODES = ("mean", "mean_sqrt_len_tokens", "weightedmean", "max", "cls", "lasttoken", "cls+mean")
LENGTHS = (3001, 1000, 77)  # one row of 4096 slots: documents past TF32's exact integers, and short ones
SEQLEN, SLOTS, DIM = 4096, 4, 16


def tf32(x):
    """float32 -> the nearest value with 10 mantissa bits (as a GPU's TF32 tensor cores read it)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + jnp.uint32(0xFFF) + ((bits >> 13) & 1)) & jnp.uint32(0xFFFFE000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _highest(precision) -> bool:
    return isinstance(precision, tuple) and all(p == jax.lax.Precision.HIGHEST for p in precision)


def _run(jaxpr, consts, args):
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, Literal) else env[v]
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = eqn.params.get("jaxpr")
        if isinstance(sub, ClosedJaxpr):  # a nested jit (jnp functions are jitted)
            outs = _run(sub.jaxpr, sub.consts, ins)
        else:
            if eqn.primitive.name == "dot_general" and not _highest(eqn.params["precision"]):
                ins = [tf32(x) if x.dtype == jnp.float32 else x for x in ins]
            outs = eqn.primitive.bind(*ins, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def as_on_gpu(fn, *args):
    """`fn(*args)` with every float32 dot below HIGHEST precision rounded to TF32."""
    closed = jax.make_jaxpr(fn)(*args)
    return _run(closed.jaxpr, closed.consts, args)[0]


def packed_row():
    seg = np.zeros((1, SEQLEN), np.int32)
    pos = np.zeros((1, SEQLEN), np.int32)
    start = 0
    for k, n in enumerate(LENGTHS, 1):
        seg[0, start : start + n] = k
        pos[0, start : start + n] = np.arange(n)
        start += n
    hidden = np.random.default_rng(0).standard_normal((1, SEQLEN, DIM)).astype(np.float32)
    return hidden, seg, pos


def reference(mode: str, hidden, seg, pos) -> np.ndarray:
    """[K, D x modes] in float64 numpy, the way sentence-transformers pools each document."""
    out = []
    for m in mode.split("+"):
        rows = []
        for k in range(1, SLOTS + 1):
            at = seg[0] == k
            h = hidden[0, at].astype(np.float64)  # [n, D]
            p = pos[0, at]
            if not at.any():
                rows.append(np.zeros(DIM))
            elif m == "mean":
                rows.append(h.mean(0))
            elif m == "mean_sqrt_len_tokens":
                rows.append(h.sum(0) / np.sqrt(len(h)))
            elif m == "weightedmean":
                w = (p + 1.0)[:, None]
                rows.append((w * h).sum(0) / w.sum())
            elif m == "max":
                rows.append(h.max(0))
            elif m == "cls":
                rows.append(h[p == 0][0])
            else:  # lasttoken
                rows.append(h[p == p.max()][0])
        out.append(np.stack(rows))
    return np.concatenate(out, -1)


@pytest.mark.parametrize("mode", MODES)
def test_pooling_is_exact_under_tf32(mode):
    hidden, seg, pos = packed_row()
    got = as_on_gpu(lambda h, s, p: pool(mode, h, s, p, SLOTS), jnp.asarray(hidden), jnp.asarray(seg), jnp.asarray(pos))
    np.testing.assert_allclose(np.asarray(got)[0], reference(mode, hidden, seg, pos), rtol=1e-5, atol=1e-5)


def test_tf32_emulation_rounds_past_2048():
    """The interpreter does round what it should (else the test above proves nothing)."""
    x = jnp.asarray([2048.0, 3001.0, 1.0 + 2.0**-12], jnp.float32)
    assert np.asarray(tf32(x)).tolist() == [2048.0, 3000.0, 1.0]
    dot = lambda a, b: jnp.einsum("i,i->", a, b)
    assert float(as_on_gpu(dot, jnp.asarray([3001.0]), jnp.asarray([1.0]))) == 3000.0
    highest = lambda a, b: jnp.einsum("i,i->", a, b, precision=jax.lax.Precision.HIGHEST)
    assert float(as_on_gpu(highest, jnp.asarray([3001.0]), jnp.asarray([1.0]))) == 3001.0


@pytest.mark.parametrize("mode", MODES)
def test_lowered_pooling_asks_for_highest_precision(mode):
    """What the compiled program carries: every dot of the pooling at HIGHEST, whatever the default."""
    args = [jax.ShapeDtypeStruct((2, 64, DIM), jnp.float32)] + [jax.ShapeDtypeStruct((2, 64), jnp.int32)] * 2
    with jax.default_matmul_precision("tensorfloat32"):
        text = jax.jit(lambda h, s, p: pool(mode, h, s, p, SLOTS)).lower(*args).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert all("HIGHEST" in line for line in dots), dots


def dots(fn, *args) -> list[str]:
    """The dot_generals of `fn`'s lowered program (at the process's default matmul precision)."""
    text = jax.jit(fn).lower(*args).as_text()
    return [line for line in text.splitlines() if "dot_general" in line]


def f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def assert_highest(lines):
    assert lines and all("precision = [HIGHEST, HIGHEST]" in line and "f32>" in line for line in lines), lines


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", [(2, SLOTS, DIM), (2, 64, DIM)], ids=["pooled", "tokens"])
def test_dense_layers_ask_for_highest_precision(shape, residual):
    """The Dense modules after pooling, and the multi-vector projection (the same layers, per token)."""
    layers = [DenseLayer("2_Dense", DIM, 8, True, "tanh", residual), DenseLayer("3_Dense", 8, 4, False, "identity")]
    params = [{"kernel": f32(DIM, 8), "bias": f32(8)} | ({"residual": f32(DIM, 8)} if residual else {}),
              {"kernel": f32(8, 4)}]
    assert_highest(dots(lambda p, x: dense_layers(layers, p, x), params, f32(*shape)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_splade_transform_asks_for_highest_precision(dtype):
    raw = tiny.tiny_config("bert")
    cfg = family_of(raw).configure(raw)
    d, dt = cfg.hidden_size, jnp.dtype(dtype)
    head = {"transform": {"kernel": jax.ShapeDtypeStruct((d, d), dt), "bias": jax.ShapeDtypeStruct((d,), dt)},
            "ln": {"scale": jax.ShapeDtypeStruct((d,), dt), "bias": jax.ShapeDtypeStruct((d,), dt)}}
    assert_highest(dots(lambda h, x: forwards.transform(cfg, h, x), head, jax.ShapeDtypeStruct((2, 64, d), dt)))


@pytest.mark.parametrize("strategy", sparse.STRATEGIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_splade_vocabulary_projection_precision(strategy, dtype):
    """A float32 model's projection at HIGHEST; a bfloat16 model's at the device's default (TF32 on a GPU, finer
    than its weights: HIGHEST would make a fifth of its FLOPs several times slower). The per-sequence sum stays
    at HIGHEST either way."""
    vocab = 300
    cfg = sparse.SparseConfig(vocab_size=vocab, strategy=strategy, cap=8)
    fn = lambda t, dec, bias, member: forwards.pooled_weights(cfg, t, dec, bias, member)
    lines = dots(fn, f32(2, 64, DIM), jax.ShapeDtypeStruct((vocab, DIM), jnp.dtype(dtype)), f32(vocab),
                 f32(2, 64, SLOTS))
    projection = [line for line in lines if "contracting_dims = [2] x [1]" in line]  # bsd,vd->bsv
    if dtype == "float32":
        assert_highest(lines)
    else:
        assert projection and all("precision = [DEFAULT, DEFAULT]" in line for line in projection), lines
        assert all("precision = [HIGHEST, HIGHEST]" in line for line in lines if line not in projection), lines
