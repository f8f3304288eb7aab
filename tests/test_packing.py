"""Packed rows (segment ids, positions restarting) equal one-document rows; long-input modes."""

import numpy as np
import pytest
from conftest import cosine_rows

from jaxserve import Encoder
from jaxserve.checkpoint.tokenize import from_sequences
from jaxserve.errors import InputError
from jaxserve.runtime.buckets import fixed

SMALL = [(4, 64), (4, 128), (2, 256)]


@pytest.fixture(scope="module")
def minilm_packed(minilm):
    """MiniLM on its default table, whose rows are packed: the session's, already warm on most workers."""
    assert minilm.engine.table.layout == "packed"
    return minilm


def sentences(texts):
    return [s.strip() + "." for t in texts for s in t.split(".") if s.strip()][:60]


def test_packed_equals_padded_and_reference_minilm(minilm_packed, minilm_reference):
    texts, want = minilm_reference
    short = sentences(texts)
    _, packed_rows = minilm_packed.prepare(short)
    assert packed_rows.layout == "packed" and packed_rows.docs.max() > 1  # rows really are shared
    packed = minilm_packed.embed(short)
    padded_enc = Encoder.from_pretrained(None)
    padded_enc.warmup(fixed(SMALL))
    padded = padded_enc.embed(short)
    assert cosine_rows(packed, padded).min() >= 0.99999
    # the reference texts (short and over-length) through the packed engine
    assert cosine_rows(minilm_packed.embed(texts), want).min() >= 0.99999


@pytest.mark.parametrize("pooling", ["mean", "cls", "max", "lasttoken"])
def test_packed_equals_padded_every_pooling(tiny_checkpoint, pooling):
    path = str(tiny_checkpoint(pooling=pooling))
    texts = ["the model " * (i % 7) + f"doc {i}" for i in range(30)]
    padded = Encoder.from_pretrained(path)
    padded.warmup(fixed([(2, 32), (2, 64)]))
    packed = Encoder.from_pretrained(path)
    packed.warmup(fixed([(2, 32), (2, 64)], layout="packed"))
    assert packed.prepare(texts)[1].docs.max() > 1
    np.testing.assert_allclose(packed.embed(texts), padded.embed(texts), atol=2e-5)


def test_chunk_mode_is_token_weighted_mean_of_windows(tiny_checkpoint):
    enc = Encoder.from_pretrained(str(tiny_checkpoint(max_seq_length=20)))
    enc.warmup(fixed([(4, 20)]))
    text = " ".join(f"w{i % 10}" for i in range(40))  # 80 body tokens (w + ##digit)
    (body,) = enc.tokenizer.encode_bodies([text])
    assert len(body) == 80 and enc.tokenizer.max_body == 18
    pieces = enc.tokenizer.pieces([body], "chunk")
    stride = 18 - 9  # default overlap 32, capped at half a window
    starts = list(range(0, 80 - 18, stride)) + [80 - 18]
    assert len(pieces.seqs) == len(starts)
    for seq, s in zip(pieces.seqs, starts):
        np.testing.assert_array_equal(seq[1:-1], body[s : s + 18])
    one_per_window = from_sequences([enc.tokenizer.wrap(body[s : s + 18]) for s in starts], np.arange(len(starts)),
                                    np.ones(len(starts)))
    windows = enc.run(one_per_window)
    want = windows.mean(0)  # every window has 18 tokens: equal weights
    got = enc.embed([text], long="chunk", normalize=False)[0]
    np.testing.assert_allclose(got, want, atol=1e-5)
    unit = enc.embed([text], long="chunk")[0]
    np.testing.assert_allclose(unit, want / np.linalg.norm(want), atol=1e-5)
    assert not np.allclose(unit, enc.embed([text])[0], atol=1e-3)  # differs from truncation


def test_chunk_keeps_short_documents_whole_and_in_order(tiny_checkpoint):
    enc = Encoder.from_pretrained(str(tiny_checkpoint(max_seq_length=20)))
    enc.warmup(fixed([(4, 20)], layout="packed"))
    texts = ["the model", "x " * 50, "a query"]
    chunked = enc.embed(texts, long="chunk")
    truncated = enc.embed(texts)
    np.testing.assert_allclose(chunked[[0, 2]], truncated[[0, 2]], atol=1e-5)


def test_error_mode_names_token_count_and_limit(tiny_checkpoint):
    enc = Encoder.from_pretrained(str(tiny_checkpoint(max_seq_length=20)))
    enc.warmup(fixed([(4, 20)]))
    with pytest.raises(InputError, match=r"input 1 has 32 tokens, over the model's limit of 20"):
        enc.embed(["ok", "the " * 30], long="error")
    assert enc.embed(["ok", "the " * 18], long="error").shape == (2, 32)
    with pytest.raises(InputError, match="unknown long-input mode"):
        enc.embed(["ok"], long="squash")


def test_key_mask_equals_segment_mask_for_one_document_rows(tiny_checkpoint):
    """The unpacked path's [B, 1, 1, S] key mask gives the packed mask's results; an all-padding row stays finite."""
    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    module = enc.module
    seg = np.array([[1] * 9 + [0] * 7, [0] * 16], np.int32)  # a 9-token document, then a row of padding only
    ids = np.where(seg > 0, 5 + np.arange(16), 0).astype(np.int32)
    pos = np.tile(np.arange(16, dtype=np.int32), (2, 1))
    args = ({"params": enc.engine.params}, ids, seg, pos, np.zeros_like(seg))
    unpacked = np.asarray(module.apply(*args, packed=False))
    packed = np.asarray(module.apply(*args, packed=True))
    assert np.isfinite(unpacked).all() and np.isfinite(packed).all()
    np.testing.assert_allclose(unpacked[0, :9], packed[0, :9], atol=1e-5)


def test_attention_bias_equals_softmax_over_visible_keys():
    """The additive-bias attention equals a float64 softmax over each query's visible keys only;
    a query that sees no key gets the plain mean of the values (uniform softmax), not NaN."""
    from jaxserve.models.attention import FULL, Masks, _dense, attend, attention_bias, visible

    rng = np.random.default_rng(0)
    b, s, n, h = 2, 12, 3, 8
    q, k, v = (rng.standard_normal((b, s, n, h)).astype(np.float32) * 3 for _ in range(3))
    seg = np.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12], np.int32)
    pos = np.array([list(range(5)) + list(range(4)) + [0] * 3, list(range(12))], np.int32)
    for packed in (True, False):
        mask = np.asarray(visible(seg, pos, seg, pos, FULL, packed))[:, None]  # [B, 1, S or 1, S]
        got = np.asarray(attend(q, k, v, Masks(seg, pos, packed)))
        scores = np.einsum("bqnh,bknh->bnqk", q.astype(np.float64), k) / np.sqrt(h)
        scores = np.where(mask, scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        want = np.einsum("bnqk,bknh->bqnh", p / p.sum(-1, keepdims=True), v)
        np.testing.assert_allclose(got, want, atol=2e-5)
    scaled = q / np.sqrt(h)
    none_visible = np.asarray(_dense(scaled, k, v, attention_bias(np.zeros((b, 1, 1, s), bool))))
    np.testing.assert_allclose(none_visible, np.broadcast_to(v.mean(1, keepdims=True), v.shape), atol=1e-5)
