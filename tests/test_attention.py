"""Attention kernels over packed rows: blockwise and Pallas (interpreted) equal dense and a float64
reference; the blockwise kernel's memory stays bounded at long seqlens; the memory estimate's
blockwise and grouped-query terms (these last without JAX)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.dims import ModelDims, blockwise_block
from jaxserve.models import attention
from jaxserve.models.attention import FULL, Masks, Spec, _blockwise, attend, key_blocks
from jaxserve.runtime.buckets import derive

SPECS = [FULL, Spec(causal=True), Spec(window=3), Spec(causal=True, window=5), Spec(window=40)]


def packed_rows(lengths_per_row: list[list[int]], seqlen: int):
    """Segment ids and positions [B, S]: each row's documents back to back from slot 0, then padding."""
    seg = np.zeros((len(lengths_per_row), seqlen), np.int32)
    pos = np.zeros_like(seg)
    for r, lengths in enumerate(lengths_per_row):
        start = 0
        for d, n in enumerate(lengths):
            seg[r, start:start + n] = d + 1
            pos[r, start:start + n] = np.arange(n)
            start += n
    return seg, pos


def reference(q, k, v, seg, pos, spec: Spec, scale: float | None = None):
    """float64 softmax over each real query's visible keys (its document, the spec's rule) -> [B, S, N, H]."""
    n, kv = q.shape[2], k.shape[2]
    k, v = (np.repeat(x.astype(np.float64), n // kv, axis=2) for x in (k, v))  # query head i uses KV head i // G
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = np.einsum("bqnh,bknh->bnqk", q.astype(np.float64) * scale, k)
    delta = pos[:, :, None] - pos[:, None, :]
    ok = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
    if spec.causal:
        ok &= delta >= 0
    if spec.window is not None:
        ok &= np.abs(delta) < spec.window
    scores = np.where(ok[:, None], scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    p = np.exp(scores - np.where(np.isfinite(top), top, 0))  # padding queries see nothing here: rows of 0
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bnqk,bknh->bqnh", p, v)


def qkv(rng, b, s, n, kv, h):
    q = rng.standard_normal((b, s, n, h)).astype(np.float32) * 2
    k, v = (rng.standard_normal((b, s, kv, h)).astype(np.float32) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("kv", [6, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_blockwise_equals_dense_and_reference(spec, kv):
    """Packed rows (several documents, padding, a document across block edges), a seqlen that is
    not a multiple of the block: blockwise == dense == float64 reference on every real token."""
    rng = np.random.default_rng(0)
    b, s, n, h = 3, 45, 6, 8
    q, k, v = qkv(rng, b, s, n, kv, h)
    seg, pos = packed_rows([[7, 20, 11], [45], [3, 1, 16]], s)
    want = reference(q, k, v, seg, pos, spec)
    dense = np.asarray(attend(q, k, v, Masks(seg, pos), spec))
    masks = Masks(seg, pos, impl="blockwise")
    blocks = np.asarray(_blockwise(q / np.sqrt(h), k, v, masks, spec, block=8))  # 6 blocks, 3 padding slots
    whole = np.asarray(attend(q, k, v, masks, spec))  # one block: the whole row
    real = seg > 0
    for got in (dense, blocks, whole):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got[real], want[real], atol=2e-5)


@pytest.mark.parametrize("spec", [Spec(causal=True), Spec(window=3), Spec(causal=True, window=9), FULL], ids=str)
def test_key_blocks_cover_every_visible_key(spec):
    """The key blocks a query block visits hold every key it may see (a document's slots are
    consecutive): never fewer, and for windows no more than the window's span needs."""
    for block in (1, 4, 8):
        nblocks = 40 // block
        for i in range(nblocks):
            lo, hi = (int(x) for x in key_blocks(i, block, nblocks, spec))
            for t in range(i * block, (i + 1) * block):  # query slots, all in one document
                need = [u for u in range(nblocks * block)
                        if (not spec.causal or u <= t) and (spec.window is None or abs(t - u) < spec.window)]
                assert lo <= min(need) // block and max(need) // block < hi
            if spec.window is not None:
                assert hi - lo <= (block + 2 * (spec.window - 1)) // block + 2
            if spec.causal:
                assert hi == i + 1


def test_long_context_bounded_memory_and_equal_to_dense():
    """Blockwise memory does not grow with S²: at 16384 tokens its temporaries are at most two
    copies of q plus a block pair's scores (dense would need 4 x 16384² float32 scores per head); a
    causal windowed row of 8192 tokens runs through it and matches the reference at sampled
    queries; at 2048 tokens (where dense fits too) the two agree everywhere."""
    n, kv, h = 4, 2, 32
    long = 16384

    def temp(s, spec):
        q = jax.ShapeDtypeStruct((1, s, n, h), jnp.float32)
        k = jax.ShapeDtypeStruct((1, s, kv, h), jnp.float32)
        ids = jax.ShapeDtypeStruct((1, s), jnp.int32)
        fn = jax.jit(lambda q, k, v, seg, pos: attend(q, k, v, Masks(seg, pos, impl="blockwise"), spec))
        return fn.lower(q, k, k, ids, ids).compile().memory_analysis().temp_size_in_bytes

    q_bytes = long * n * h * 4
    block = blockwise_block(long, attention.KEY_BLOCK)
    bound = 2 * q_bytes + 4 * 4 * n * block * block  # two copies of q, four float32 block pairs of scores
    for spec in (Spec(causal=True), Spec(window=256)):
        assert temp(long, spec) < bound < 4 * n * long * long / 50
        assert temp(long, spec) <= 2 * temp(long // 2, spec)  # at most linear in S, never quadratic

    rng = np.random.default_rng(1)
    s, spec = 8192, Spec(causal=True, window=700)
    q, k, v = qkv(rng, 1, s, n, kv, h)
    seg, pos = packed_rows([[3000, 5000]], s)
    got = np.asarray(attend(q, k, v, Masks(seg, pos, impl="blockwise"), spec))
    rows = np.array([0, 699, 700, 2999, 3000, 3001, 5123, 7999])  # sampled queries: document edges, window edges
    scores = np.einsum("qnh,knh->nqk", q[0, rows].astype(np.float64) / np.sqrt(h), np.repeat(k[0], n // kv, 1))
    delta = pos[0, rows][:, None] - pos[0][None, :]
    ok = (seg[0, rows][:, None] == seg[0][None, :]) & (delta >= 0) & (delta < spec.window)
    masked = np.where(ok[None], scores, -np.inf)
    p = np.exp(masked - masked.max(-1, keepdims=True))
    want = np.einsum("nqk,knh->qnh", p / p.sum(-1, keepdims=True), np.repeat(v[0], n // kv, 1))
    np.testing.assert_allclose(got[0, rows], want, atol=2e-5)

    s = 2048
    q, k, v = qkv(rng, 2, s, n, kv, h)
    seg, pos = packed_rows([[1000, 900, 100], [2048]], s)
    real = seg > 0
    for spec in (FULL, Spec(causal=True), Spec(window=300)):
        dense = np.asarray(attend(q, k, v, Masks(seg, pos), spec))
        blocks = np.asarray(attend(q, k, v, Masks(seg, pos, impl="blockwise"), spec))
        np.testing.assert_allclose(blocks[real], dense[real], atol=2e-5)


@pytest.mark.parametrize("kv", [4, 2], ids=["mha", "gqa"])
def test_pallas_interpreted_equals_dense(kv):
    """The Pallas GPU kernel, run by Pallas' interpreter on the CPU at tiny shapes: packed rows,
    causal or not, grouped heads repeated; a windowed layer falls back and still equals dense."""
    rng = np.random.default_rng(2)
    b, s, n, h = 2, 64, 4, 16
    q, k, v = qkv(rng, b, s, n, kv, h)
    seg, pos = packed_rows([[10, 34], [64]], s)
    real = seg > 0
    for spec in (FULL, Spec(causal=True), Spec(causal=True, window=4)):
        dense = np.asarray(attend(q, k, v, Masks(seg, pos), spec))
        fused = np.asarray(attend(q, k, v, Masks(seg, pos, impl="pallas"), spec))
        assert np.isfinite(fused).all()
        np.testing.assert_allclose(fused[real], dense[real], atol=2e-5)


def test_plan_orders_candidates_and_says_why_it_skips():
    plan = attention.plan
    assert [plan("auto", "cpu", s, 64, "float32").candidates for s in (256, 384)] == [("dense",), ("blockwise",)]
    assert plan("auto", "gpu", 512, 64, "bfloat16") == attention.Plan(("cudnn", "pallas", "blockwise"))
    assert plan("auto", "gpu", 96, 64, "bfloat16") == attention.Plan(
        ("cudnn", "dense"), ("pallas: no tile of 128/64 rows divides seqlen 96 and fits 227 KB of shared memory at "
                             "head_dim 64",))
    fp32 = plan("auto", "gpu", 128, 64, "float32")
    assert fp32.candidates == ("pallas", "dense") and fp32.skipped == (
        "cudnn: needs bfloat16 or float16 activations, not float32",)
    assert plan("auto", "gpu", 128, 96, "bfloat16").candidates == ("cudnn", "dense")  # Pallas: powers of two only
    assert plan("auto", "gpu", 128, 512, "bfloat16").candidates == ("dense",)
    assert plan("cudnn", "cpu", 128, 64, "bfloat16") == attention.Plan(("dense",), ("cudnn: needs a CUDA GPU (this is cpu)",))
    assert plan("pallas", "gpu", 1024, 64, "bfloat16").candidates == ("pallas", "blockwise")  # forced: no cuDNN
    sharded = plan("auto", "gpu", 512, 64, "bfloat16", devices=2)  # Pallas has no sharding rule; cuDNN has one
    assert sharded.candidates == ("cudnn", "blockwise") and "no sharding rule" in sharded.skipped[0]
    assert plan("xla", "gpu", 128, 64, "bfloat16").candidates == ("dense",)
    assert plan("blockwise", "gpu", 128, 64, "bfloat16").candidates == ("blockwise",)
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        plan("flash", "gpu", 128, 64, "bfloat16")
    with pytest.raises(ValueError, match="unknown attention implementation"):
        Masks(np.ones((1, 4), np.int32), np.zeros((1, 4), np.int32), impl="flash")


def test_pallas_tiles_fit_hoppers_shared_memory():
    """bf16: 128-row tiles to head_dim 128 (upstream's tested default), 64 at head_dim 256, where 128 would
    need 352 KB of the 227 KB; none under the 64-row minimum or where no tile divides the seqlen."""
    block = attention.pallas_block
    assert [block(4096, h) for h in (16, 32, 64, 128, 256)] == [128, 128, 128, 128, 64]
    assert attention.pallas_shared_bytes(128, 128, 2) == 192 * 1024
    assert attention.pallas_shared_bytes(64, 256, 2) == 168 * 1024
    assert attention.pallas_shared_bytes(128, 256, 2) == 352 * 1024 > attention.SHARED_MEMORY_BYTES
    assert block(192, 64) == 64 and block(64, 64) == 64 and block(96, 64) == 0 and block(32, 64) == 0
    assert block(4096, 128, 4) == 64 and block(4096, 256, 4) == 0  # float32 tiles hold twice the bytes
    assert attention.pallas_fits((1, 64, 2, 16), Spec(causal=True), None)
    assert not attention.pallas_fits((1, 64, 2, 16), Spec(window=8), None)
    assert not attention.pallas_fits((1, 64, 2, 8), FULL, None)  # head dim under Triton's smallest dot
    assert not attention.pallas_fits((1, 32, 2, 16), FULL, None)  # seqlen under the minimum tile
    assert attention.cudnn_fits(Spec(causal=True, window=8), None) and not attention.cudnn_fits(Spec(window=8), None)
    assert not attention.cudnn_fits(FULL, lambda q, k: 0.0)


_segment_layout = jax.jit(attention.segment_layout, static_argnums=1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(1, 12), max_size=4), min_size=3, max_size=3))
def test_segment_layout_is_each_documents_first_slot_and_length(rows):
    """cuDNN's ragged layout from packed segment ids: per row, document d starts at the sum of the lengths
    before it and holds its length; absent documents and the last offset are -1 (rows of [3, 50]: one compile)."""
    slots = 4
    seg, _ = packed_rows(rows, 50)  # up to 48 real tokens: some rows end in padding, some are all padding
    offsets, lengths = (np.asarray(x) for x in _segment_layout(seg, slots))
    assert offsets.shape == (len(rows), slots + 1) and lengths.shape == (len(rows), slots)
    for r, docs in enumerate(rows):
        starts = np.cumsum([0, *docs])[:-1]
        assert offsets[r].tolist() == [*starts.tolist(), *[-1] * (slots + 1 - len(docs))]
        assert lengths[r].tolist() == [*docs, *[-1] * (slots - len(docs))]
        for d, (o, n) in enumerate(zip(starts, docs)):  # the slots it names are exactly document d's
            assert (seg[r, o:o + n] == d + 1).all() and (seg[r] == d + 1).sum() == n


@pytest.mark.parametrize("h,s", [(256, 128), (64, 256)], ids=["head_dim256-tile64", "head_dim64-tile128"])
def test_pallas_interpreted_at_the_tiles_auto_picks(h, s):
    """bf16 at the tiles `pallas_block` picks for a GPU (64 rows at head_dim 256, 128 at 64), run by Pallas'
    interpreter on the CPU: packed rows, causal or not, grouped heads; equal to the float64 reference."""
    assert attention.plan("auto", "gpu", s, h, "bfloat16").candidates[1] == "pallas"
    block = attention.pallas_block(s, h)
    assert block == (64 if h == 256 else 128) and s // block == 2  # two query tiles, two key tiles
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, 1, s, 2, 1, h)
    seg, pos = packed_rows([[block - 10, 30, s - block - 20]], s)  # a document across the tile edge; padding
    real = seg > 0
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    for spec in (FULL, Spec(causal=True)):
        want = reference(*(np.asarray(x, np.float32) for x in (q, k, v)), seg, pos, spec)
        got = np.asarray(attend(q, k, v, Masks(seg, pos, impl="pallas"), spec), np.float32)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got[real], want[real], atol=3e-2)


@pytest.mark.parametrize("impl,slots", [("cudnn", 4), ("cudnn", 1), ("pallas", 4)])
def test_fused_kernels_lower_for_cuda_on_this_cpu(impl, slots, monkeypatch):
    """The GPU programs are built here as a GPU would build them (jax.export for the cuda platform runs
    the CUDA lowering rules): cuDNN's custom call gets the ragged layout (q/kv seqlens and offsets) for
    packed rows, the padding mask for one-document rows, causal and window by its config; grouped KV
    heads as they are. Only jax's probes of the hardware (cuDNN version, compute capability) are stubbed."""
    import re

    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 90800)
    monkeypatch.setattr(fa, "check_compute_capability", lambda capability: True)  # Hopper
    q = jax.ShapeDtypeStruct((2, 128, 4, 256), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 128, 2, 256), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((2, 128), jnp.int32)
    targets = ("__cudnn$fmhaSoftmax", "__gpu$xla.gpu.triton")
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]
    for spec in (FULL, Spec(causal=True), Spec(causal=True, window=16)):
        fn = jax.jit(lambda q, k, v, s, p: attend(q, k, v, Masks(s, p, slots > 1, attention.Kernel(impl, slots)), spec))
        text = jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(q, kv, kv, ids, ids).mlir_module()
        text = text.replace("\\22", '"')
        calls = re.findall(r"custom_call @([\w$.]+)\(([^)]*)\)", text)
        if impl == "pallas":  # the Triton kernel, except in the windowed layer (xla there)
            assert ("mha_forward" in text) == (spec.window is None) and not any(c == targets[0] for c, _ in calls)
            continue
        (operands,) = [args.count("%") for c, args in calls if c == targets[0]]
        assert operands == (7 if slots > 1 else 5)  # q, k, v, q/kv seqlens (+ q/kv offsets when packed)
        mask = re.search(r'"mask_type": "(\w+)"', text).group(1)
        padding = "" if slots > 1 else "PADDING"
        want = {FULL: padding or "NO_MASK"}.get(spec, "_".join(filter(None, (padding, "CAUSAL"))))
        assert mask == want
        assert re.search(r'"max_seg_per_batch": "?(\d+)', text).group(1) == str(slots)
        window = re.search(r'"sliding_window_length": "?(\d+)', text)
        assert (window and int(window.group(1))) == (spec.window or 0) or (not window and spec.window is None)


# ---- the memory estimate (no JAX below) ----

QWEN_06B = ModelDims(hidden=1024, intermediate=3072, heads=16, dtype_bytes=2, layers=28, kv_heads=8, head_dim=128,
                     gated=True)


def test_estimate_mirrors_the_kernels_constants():
    assert ModelDims(8, 8, 1).dense_max_seqlen == attention.DENSE_MAX_SEQLEN
    assert ModelDims(8, 8, 1).key_block == attention.KEY_BLOCK


@given(st.integers(1, 40000), st.sampled_from([64, 128, 512]))
def test_blockwise_block_divides_or_pads(seqlen, block):
    b = blockwise_block(seqlen, block)
    assert b == seqlen if seqlen <= block else (block // 8 <= b <= block and (seqlen % b == 0 or b == block))


@settings(max_examples=50)
@given(st.integers(1, 64), st.sampled_from([16, 128, 512, 768, 2048, 8192, 32768]), st.sampled_from([1, 2, 4, 8, 16]))
def test_estimate_grows_with_batch_and_seqlen_and_shrinks_with_kv_heads(batch, seqlen, kv):
    dims = ModelDims(hidden=1024, intermediate=3072, heads=16, kv_heads=kv, head_dim=128, gated=True)
    est = dims.activation_bytes(batch, seqlen)
    assert dims.activation_bytes(batch + 1, seqlen) > est
    assert dims.activation_bytes(batch, seqlen + 16) > est
    if kv > 1:  # fewer KV heads: a narrower fused QKV, never more bytes
        assert ModelDims(hidden=1024, intermediate=3072, heads=16, kv_heads=kv // 2, head_dim=128,
                         gated=True).activation_bytes(batch, seqlen) <= est
    assert ModelDims(hidden=1024, intermediate=3072, heads=16, head_dim=128, gated=True,
                     layers=36).activation_bytes(batch, seqlen) == ModelDims(
        hidden=1024, intermediate=3072, heads=16, head_dim=128, gated=True).activation_bytes(batch, seqlen)


def test_blockwise_estimate_is_linear_in_seqlen():
    """Past dense_max_seqlen the scores are one block pair's: per-row bytes grow like S, not S²."""
    for s in (1024, 2048, 4096, 8192, 16384):
        assert QWEN_06B.activation_bytes(1, 2 * s) <= 2 * QWEN_06B.activation_bytes(1, s)
    dense_like = 2 * 4 * QWEN_06B.heads * 32768 ** 2
    assert QWEN_06B.activation_bytes(1, 32768) < dense_like / 20
    # at the crossover the dense scores (2 x N x S² float32) are what blockwise saves
    s = QWEN_06B.dense_max_seqlen
    assert QWEN_06B.activation_bytes(1, s) > 2 * 4 * QWEN_06B.heads * s * s


def test_derive_keeps_one_row_past_the_token_cap():
    """A seqlen longer than max_batch_tokens still gets batch 1 (the cap batches rows, it never drops one)."""
    table = derive([512, 8192, 32768], QWEN_06B, 2**30, 80 * 2**30, None, max_batch_tokens=4096, max_batch=256)
    assert [(b.seqlen, b.batch) for b in table.buckets] == [(512, 8), (8192, 1), (32768, 1)]
    assert not table.dropped


def test_derive_long_seqlens_fit_a_big_model():
    """An 8B-sized decoder on an 80 GB budget: every seqlen to 32768 fits, batches shrink with S."""
    dims = ModelDims(hidden=4096, intermediate=12288, heads=32, dtype_bytes=2, layers=36, kv_heads=8, head_dim=128,
                     gated=True)
    weights = 15 * 2**30
    table = derive([512, 4096, 32768], dims, weights, 72 * 2**30, None, max_batch_tokens=2**40, max_batch=2**40,
                   multiple=8)
    batches = [b.batch for b in table.buckets]
    assert batches == sorted(batches, reverse=True) and batches[-1] >= 8
    assert all(b.estimated_bytes <= 72 * 2**30 for b in table.buckets)
