"""EuroBERT's "late" classifier pooling (transformers' default `classifier_pooling`): dense, GELU and classifier on
every token, the logits averaged over the document's tokens, against transformers' EuroBertForSequenceClassification
on a tiny checkpoint (test_family_eurobert's builders), packed rows as padded ones. An embedding checkpoint with the
same default config stays a plain encoder."""

import hf_tiny
import numpy as np
import pytest
from conftest import warm_encoder
from test_family_eurobert import HUB_CONFIG, MAX_LEN, TEXTS, hf_config

from jaxserve.models import FAMILIES, eurobert
from jaxserve.runtime.buckets import fixed

DOCS = [*TEXTS, "the query", "jax", "a model of the batch " * 3]  # the last of TEXTS truncated at MAX_LEN


@pytest.fixture(scope="module", params=[2, 1])
def late(request, tmp_path_factory):
    labels = {i: f"label{i}" for i in range(request.param)}
    path = hf_tiny.write(tmp_path_factory.mktemp("late") / "clf", "EuroBertForSequenceClassification",
                         hf_config(num_labels=request.param, id2label=labels,
                                   label2id={v: k for k, v in labels.items()}, attention_bias=True),
                         kind="gemma", seed=7, scale=0.3)
    return path, warm_encoder(path, fixed([(4, MAX_LEN)], layout="packed"))


def test_late_logits_match_transformers(late):
    path, enc = late
    cfg = enc.model_config
    assert cfg.classifier_pooling == "late" and cfg.late_head and enc.head.kind == "classifier"
    assert enc.family.pooling_for_head(cfg) == "mean" and "dense" in enc.params and "dense" not in enc.params["head"]
    model = hf_tiny.torch_model(path, "EuroBertForSequenceClassification")
    assert model.classifier_pooling == "late"
    want = np.stack([hf_tiny.logits(model, np.asarray(ids, np.int32)) for ids in enc.tokenizer.encode(DOCS)])
    got = enc.classify(DOCS)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_late_packed_rows_equal_padded_rows(late):
    path, enc = late
    assert enc.prepare(DOCS)[1].docs.max() > 1  # packed: rows shared by several documents
    padded = warm_encoder(path, fixed([(4, MAX_LEN)], layout="padded"))
    assert padded.prepare(DOCS)[1].docs.max() == 1
    np.testing.assert_allclose(enc.classify(DOCS), padded.classify(DOCS), atol=2e-5)


def test_only_a_late_classifier_runs_the_head_per_token():
    """The hub's EuroBERT config (a masked LM, `clf_pooling` late) is a plain encoder; the same config as a
    classifier ends in the head's per-token dense; "bos" and "mean" classifiers pool first."""
    family = FAMILIES["eurobert"]
    plain = eurobert.configure(HUB_CONFIG)
    assert plain.classifier_pooling == "late" and not plain.late_head
    assert type(family.encoder(plain)).__name__ == "Decoder" and "dense" not in family.weights(plain)
    classifier = {**HUB_CONFIG, "architectures": ["EuroBertForSequenceClassification"]}
    late = eurobert.configure(classifier)
    assert late.late_head and isinstance(family.encoder(late), eurobert.LateEncoder)
    assert set(family.weights(late)) == {"encoder", "dense"} and set(family.head_weights(late)) == {"out"}
    for pooling, mode in (("bos", "cls"), ("mean", "mean")):
        cfg = eurobert.configure({**classifier, "clf_pooling": pooling})
        assert not cfg.late_head and family.pooling_for_head(cfg) == mode
        assert set(family.head_weights(cfg)) == {"dense", "out"}
