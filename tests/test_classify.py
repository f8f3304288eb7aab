"""Sequence classification and cross-encoder reranking: tiny checkpoints against a numpy reference."""

import json

import numpy as np
import pytest
import tiny
from conftest import TINY_TABLE, warm_encoder

from jaxserve.errors import InputError

TEXTS = ["the model", "a batch of jax documents", "x", "hello, world! 42"]
PAIRS = [("the query", "the model is a document"), ("a query", "x"), ("jax", "the batch of documents " * 3)]


def reference(path, inputs, enc):
    cfg = json.loads((path / "config.json").read_text())
    tensors = tiny.random_tensors(cfg)
    pieces = enc.prepare_pairs(inputs, truncate=True)
    types = pieces.type_seqs or [None] * len(pieces.seqs)
    return np.stack([tiny.reference_logits(tensors, cfg, ids, t) for ids, t in zip(pieces.seqs, types)])


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_classifier_logits_match_reference(tmp_path, model_type):
    path = tiny.write_checkpoint(tmp_path / model_type, model_type=model_type, num_labels=3)
    enc = warm_encoder(path, TINY_TABLE)
    assert enc.head.kind == "classifier" and enc.head.labels == ("label_a", "label_b", "label_c")
    got = enc.classify(TEXTS)
    assert got.shape == (4, 3)
    np.testing.assert_allclose(got, reference(path, TEXTS, enc), atol=1e-4)


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_pairs_use_token_types_and_match_reference(tmp_path, model_type):
    path = tiny.write_checkpoint(tmp_path / model_type, model_type=model_type, num_labels=1)
    enc = warm_encoder(path, TINY_TABLE)
    pieces = enc.prepare_pairs(PAIRS, truncate=True)
    if model_type == "bert":  # [CLS] q [SEP] d [SEP], types 0 then 1
        ids, types = pieces.seqs[0], pieces.type_seqs[0]
        sep = ids.tolist().index(3)
        assert ids[0] == 2 and ids[-1] == 3 and types[: sep + 1].max() == 0 and types[sep + 1 :].min() == 1
    got = enc.classify(PAIRS)
    np.testing.assert_allclose(got, reference(path, PAIRS, enc), atol=1e-4)
    np.testing.assert_allclose(enc.rerank("the query", ["the model is a document", "x"]),
                               enc.classify([("the query", "the model is a document"), ("the query", "x")])[:, 0],
                               atol=1e-6)


def test_long_pairs_truncate_longest_first_or_refuse(tmp_path):
    path = tiny.write_checkpoint(tmp_path / "c", num_labels=1)
    enc = warm_encoder(path, TINY_TABLE)
    long_pair = [("the query", "the model " * 100)]
    (ids,) = enc.prepare_pairs(long_pair, truncate=True).seqs
    assert len(ids) == 64
    assert np.isfinite(enc.classify(long_pair)).all()
    with pytest.raises(InputError, match="over the model's limit of 64"):
        enc.classify(long_pair, truncate=False)


def test_wrong_kind_is_a_clear_error(tmp_path):
    emb = warm_encoder(tiny.write_checkpoint(tmp_path / "e"), TINY_TABLE)
    with pytest.raises(InputError, match="is an embedding model; this needs a classifier model"):
        emb.classify(["x"])
    clf = warm_encoder(tiny.write_checkpoint(tmp_path / "c", num_labels=2), TINY_TABLE)
    with pytest.raises(InputError, match="is a classifier model; this needs an embedding model"):
        clf.embed(["x"])


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = tiny.write_checkpoint(tmp_path_factory.mktemp("c") / "clf", num_labels=3)
    return path, warm_encoder(path, TINY_TABLE)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tiny.write_checkpoint(tmp_path_factory.mktemp("x") / "ce", model_type="roberta", num_labels=1)
    return path, warm_encoder(path, TINY_TABLE)


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


async def test_predict_and_classify_routes(make_server, classifier):
    path, enc = classifier
    client = await make_server(enc)
    want = softmax(reference(path, TEXTS, enc))
    resp = await client.post("/predict", json={"inputs": [[t] for t in TEXTS]})
    assert resp.status == 200
    for got, p in zip(await resp.json(), want):
        assert [g["label"] for g in got] == [enc.head.labels[i] for i in np.argsort(-p)]
        np.testing.assert_allclose([g["score"] for g in got], np.sort(p)[::-1], atol=1e-5)
    single = await (await client.post("/predict", json={"inputs": TEXTS[0], "top_k": 2, "raw_scores": True})).json()
    assert len(single) == 2 and single[0]["score"] == pytest.approx(reference(path, TEXTS[:1], enc)[0].max(), abs=1e-4)
    pair = await (await client.post("/predict", json={"inputs": [list(PAIRS[0])]})).json()
    np.testing.assert_allclose(max(g["score"] for g in pair[0]), softmax(reference(path, PAIRS[:1], enc))[0].max(),
                               atol=1e-5)
    body = await (await client.post("/classify", json={"model": "m", "input": TEXTS})).json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and body["data"][0]["num_classes"] == 3
    np.testing.assert_allclose([d["probs"] for d in body["data"]], want, atol=1e-5)
    assert [d["label"] for d in body["data"]] == [enc.head.labels[i] for i in want.argmax(1)]
    resp = await client.post("/v1/embeddings", json={"input": ["x"]})
    assert resp.status == 400 and "needs" in (await resp.json())["error"]["message"]
    for route, payload in [("/embed", {"inputs": ["x"]}), ("/rerank", {"query": "q", "texts": ["x"]})]:
        resp = await client.post(route, json=payload)  # TEI's routes: TEI's shape and code (Backend: infer.rs)
        body = await resp.json()
        assert resp.status == 424 and "needs" in body["error"] and body["error_type"] == "Backend"


async def test_rerank_route_sorts_by_score(make_server, cross_encoder):
    path, enc = cross_encoder
    client = await make_server(enc)
    texts = ["the model is a document", "x", "the batch of documents " * 3, "jax"]
    resp = await client.post("/rerank", json={"query": "the query", "texts": texts, "return_text": True})
    assert resp.status == 200
    got = await resp.json()
    logits = reference(path, [("the query", t) for t in texts], enc)[:, 0]
    want = 1 / (1 + np.exp(-logits))
    assert [g["index"] for g in got] == list(np.argsort(-want))
    np.testing.assert_allclose([g["score"] for g in got], np.sort(want)[::-1], atol=1e-5)
    assert all(g["text"] == texts[g["index"]] for g in got)
    raw = await (await client.post("/rerank", json={"query": "the query", "texts": texts, "raw_scores": True})).json()
    np.testing.assert_allclose(sorted(g["score"] for g in raw), np.sort(logits), atol=1e-4)
    too_long = await client.post("/rerank", json={"query": "q", "texts": ["the " * 100], "truncate": False})
    assert too_long.status == 422 and (await too_long.json())["error_type"] == "Validation"
    assert (await client.post("/rerank", json={"query": "", "texts": ["x"]})).status == 422
    assert (await client.post("/v1/embeddings", json={"input": ["x"]})).status == 400
    assert (await client.post("/rerank", json={"query": "q", "texts": ["x"]})).status == 200


def test_a_str_is_one_input_a_pair_one_score(classifier, cross_encoder):
    """`classify("x")` is one text's [num_labels] row and `rerank(q, "doc")` one pair's score, as CrossEncoder's
    `predict` of one pair (before: one row per character); an element neither a str nor a (str, str) pair is
    refused by its index."""
    _, clf = classifier
    row = clf.classify(TEXTS[0])
    assert row.shape == (3,)
    np.testing.assert_array_equal(row, clf.classify([TEXTS[0]])[0])
    _, ce = cross_encoder
    score = ce.rerank("the query", "the model")
    assert np.ndim(score) == 0
    assert score == ce.rerank("the query", ["the model"])[0]
    np.testing.assert_array_equal(ce.rerank("the query", (t for t in TEXTS)), ce.rerank("the query", TEXTS))
    for bad, name in (([TEXTS[0], ("a",)], "input 1 is tuple"), ([("a", None)], "input 0 is tuple"),
                      ([None], "input 0 is NoneType")):
        with pytest.raises(InputError, match=f"{name}, not a str or a \\(str, str\\) pair"):
            clf.classify(bad)
    with pytest.raises(InputError, match="input 1 is NoneType, not a str$"):
        ce.rerank("the query", ["a", None])
