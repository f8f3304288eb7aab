"""Numerics against references: sentence-transformers (MiniLM) and transformers/PyTorch (tiny models)."""

import json

import numpy as np
import pytest
import tiny
from conftest import FIXTURES, MINILM_SMALL_TABLE, TINY_TABLE, cosine_rows, warm_encoder


def test_minilm_matches_sentence_transformers_float32(minilm, minilm_reference):
    texts, want = minilm_reference
    got = minilm.embed(texts)
    assert got.shape == want.shape and got.dtype == np.float32
    cos = cosine_rows(got, want)
    assert cos.min() >= 0.99999, cos
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_minilm_matches_sentence_transformers_bfloat16(minilm_reference):
    texts, want = minilm_reference
    enc = warm_encoder(None, MINILM_SMALL_TABLE, dtype="bfloat16")
    got = enc.embed(texts)
    assert got.dtype == np.float32
    cos = cosine_rows(got, want)
    assert cos.min() >= 0.999, cos


def test_reference_covers_over_length_documents(minilm, minilm_reference):
    counts = json.loads((FIXTURES / "minilm_reference.json").read_text())["untruncated_token_counts"]
    assert max(counts) > minilm.embedding_config.max_seq_length
    assert min(counts) <= 4


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_tiny_model_matches_transformers_pytorch(tmp_path, model_type):
    """Hidden states equal transformers' BertModel / RobertaModel (RoBERTa's position offset included)."""
    ref = np.load(FIXTURES / "tiny_torch_reference.npz")
    path = tiny.write_checkpoint(tmp_path / model_type, model_type=model_type)
    enc = warm_encoder(path, TINY_TABLE)
    texts = ["the model", "a batch of jax documents is the query", "x", "hello, world! 42"]
    seqs = enc.tokenizer.encode(texts)
    for i, ids in enumerate(seqs):
        n = len(ids)
        h = enc.module.apply(
            {"params": enc.params}, ids[None], np.ones((1, n), np.int32), np.arange(n, dtype=np.int32)[None],
            np.zeros((1, n), np.int32),
        )[0]
        np.testing.assert_allclose(np.asarray(h), ref[f"{model_type}_{i}"], atol=2e-4, rtol=1e-4)
    want = np.stack([ref[f"{model_type}_{i}"].mean(0) for i in range(len(texts))])
    assert cosine_rows(enc.embed(texts), want).min() >= 0.99999
