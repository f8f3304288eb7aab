"""Every pooling mode on tiny random checkpoints, against the numpy reference."""

import json

import numpy as np
import pytest
import tiny
from conftest import TINY_TABLE, cosine_rows, warm_encoder

from jaxserve.checkpoint.tokenize import TextTokenizer

TEXTS = ["the model", "a batch of jax documents is the query and the query is long", "x", "hello, world! 42", ""]


def reference(path, texts, pooling, normalize=True, max_len=64):
    cfg = json.loads((path / "config.json").read_text())
    tensors = tiny.random_tensors(cfg)
    tok = TextTokenizer.from_dir(path, max_len)
    return np.stack([tiny.reference_embedding(tensors, cfg, ids, pooling, normalize) for ids in tok.encode(texts)])


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
@pytest.mark.parametrize("pooling", ["mean", "cls", "max", "lasttoken"])
def test_pooling_modes_match_reference(tiny_checkpoint, pooling, model_type):
    path = tiny_checkpoint(pooling=pooling, model_type=model_type)
    enc = warm_encoder(path, TINY_TABLE)
    assert enc.embedding_config.pooling == pooling
    got = enc.embed(TEXTS)
    want = reference(path, TEXTS, pooling)
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_normalize_off_returns_raw_pooled_vectors(tiny_checkpoint):
    path = tiny_checkpoint(pooling="mean")
    got = warm_encoder(path, TINY_TABLE).embed(TEXTS, normalize=False)
    want = reference(path, TEXTS, "mean", normalize=False)
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert not np.allclose(np.linalg.norm(got, axis=1), 1.0)


def test_plain_transformers_checkpoint_defaults_to_mean_at_full_length(tiny_checkpoint):
    path = tiny_checkpoint(pooling=None)
    enc = warm_encoder(path, TINY_TABLE)
    assert enc.embedding_config.pooling == "mean"
    assert enc.embedding_config.max_seq_length == 64
    assert not enc.embedding_config.normalize  # sentence-transformers adds no Normalize module either


def test_max_seq_length_from_sentence_bert_config_truncates(tiny_checkpoint):
    path = tiny_checkpoint(max_seq_length=10)
    enc = warm_encoder(path, TINY_TABLE)
    long_text = "the model " * 30
    (ids,) = enc.tokenizer.encode([long_text])
    assert len(ids) == 10 and ids[0] == 2 and ids[-1] == 3  # [CLS] ... [SEP]
    same_prefix = "the model " * 4 + "the"  # 9 body tokens -> truncated to 8 like the long text
    np.testing.assert_allclose(enc.embed([long_text]), enc.embed([same_prefix]), atol=1e-6)
    assert cosine_rows(enc.embed([long_text]), reference(path, [long_text], "mean", max_len=10))[0] > 0.99999


def test_roberta_limit_accounts_for_position_offset(tiny_checkpoint):
    path = tiny_checkpoint(model_type="roberta")
    enc = warm_encoder(path, TINY_TABLE)
    assert enc.model_config.position_offset == 2
    assert enc.embedding_config.max_seq_length == 64  # 66 positions - offset
    (ids,) = enc.tokenizer.encode(["a " * 200])
    assert len(ids) == 64
    assert np.isfinite(enc.embed(["a " * 200])).all()
