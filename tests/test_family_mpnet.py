"""MPNet and DistilBERT against transformers' PyTorch models, on tiny checkpoints transformers writes itself.

MPNet's relative position buckets are exact up to distance 8 and log-spaced up
to 128, so the documents here run past 64 tokens, and a packed row puts a long
document after another one: it must get the positions and bias it gets alone in its row.
"""

import dataclasses

import hf_tiny
import jax
import numpy as np
import pytest
from conftest import cosine_rows, warm_encoder

from jaxserve import Encoder
from jaxserve.errors import CheckpointError
from jaxserve.models import FAMILIES, mpnet
from jaxserve.runtime.buckets import fixed

MAX_LEN = 128  # tokens, special ones included: both tiny models' position tables end here
HIDDEN = 32
PACKED = fixed([(4, MAX_LEN)], layout="packed")
PADDED = fixed([(4, MAX_LEN)])
TEXTS = [
    "the model",
    "hello, world! 42",
    "a batch of jax documents is the query " * 3,  # 29 tokens
    " ".join(f"w{i % 10}" for i in range(42)),  # 86 tokens: distances past 64
    "x",
    "the query of the model " * 30,  # over MAX_LEN: truncated
]
# Hand-packed rows of TEXTS' sequences: the 86-token document starts after the 29-token one.
PACKING = [[2, 3], [0, 1, 4], [5]]


@dataclasses.dataclass(frozen=True)
class Case:
    family: str  # as /info reports it
    prefix: str  # transformers class prefix: MPNet, DistilBert
    kind: str  # hf_tiny tokenizer template
    config: dict  # transformers config fields

    def write(self, path, head: str = "Model", scale: float | None = 0.5, **overrides):
        import transformers

        config = getattr(transformers, f"{self.prefix}Config")(**{**self.config, **overrides})
        return hf_tiny.write(path, f"{self.prefix}{head}", config, kind=self.kind, seed=0, scale=scale)


CASES = {
    "mpnet": Case("mpnet", "MPNet", "roberta", dict(
        vocab_size=len(hf_tiny.vocab("roberta")), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=MAX_LEN + 2)),  # positions count from padding_idx + 1 = 2
    "distilbert": Case("distilbert", "DistilBert", "bert", dict(
        vocab_size=len(hf_tiny.vocab("bert")), dim=HIDDEN, n_layers=2, n_heads=4, hidden_dim=64,
        max_position_embeddings=MAX_LEN)),
}


def sequences(enc, texts=TEXTS):
    return enc.prepare_pairs(texts, truncate=True).seqs


def rows(seqs, packing):
    """[R, MAX_LEN] token ids, segment ids and positions of `seqs` laid out as `packing` says."""
    out = {k: np.zeros((len(packing), MAX_LEN), np.int32) for k in ("ids", "seg", "pos")}
    for r, row in enumerate(packing):
        col = 0
        for slot, i in enumerate(row, start=1):
            n = len(seqs[i])
            out["ids"][r, col:col + n], out["seg"][r, col:col + n] = seqs[i], slot
            out["pos"][r, col:col + n] = np.arange(n)
            col += n
        assert col <= MAX_LEN, "the packing must fit a row"
    return out


def hidden_states(enc, seqs, packing, packed):
    """Each sequence's last hidden states [n, D], from one forward over `packing`'s rows."""
    x = rows(seqs, packing)
    apply = jax.jit(enc.module.apply, static_argnames="packed")
    h = np.asarray(apply({"params": enc.params}, x["ids"], x["seg"], x["pos"], np.zeros_like(x["ids"]), packed=packed))
    out = {}
    for r, row in enumerate(packing):
        col = 0
        for i in row:
            out[i] = h[r, col:col + len(seqs[i])]
            col += len(seqs[i])
    return [out[i] for i in range(len(seqs))]


def normalize(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@dataclasses.dataclass(frozen=True)
class Embedder:
    case: Case
    path: object  # the checkpoint directory
    enc: Encoder
    seqs: list  # TEXTS as model sequences
    reference: list  # transformers' last hidden states [n, D] of each


@pytest.fixture(scope="module", params=list(CASES))
def embedder(request, tmp_path_factory):
    """A tiny embedding checkpoint (mean pooling), transformers' model of it, and jaxserve's (packed rows)."""
    case = CASES[request.param]
    path = case.write(tmp_path_factory.mktemp(case.family) / "emb")
    hf_tiny.sentence_transformers_dir(path, pooling="mean", max_seq_length=MAX_LEN, hidden_size=HIDDEN)
    enc = warm_encoder(path, PACKED)
    torch_model = hf_tiny.torch_model(path, f"{case.prefix}Model")
    seqs = sequences(enc)
    reference = [hf_tiny.hidden(torch_model, ids) for ids in seqs]
    return Embedder(case, path, enc, seqs, reference)


def test_hidden_states_match_transformers(embedder):
    seqs, reference = embedder.seqs, embedder.reference
    assert sorted(len(s) for s in seqs)[-2:] == [86, MAX_LEN]
    one_per_row = [[i] for i in range(len(seqs))]
    for packing, packed in [(one_per_row, False), (PACKING, True)]:
        for got, want in zip(hidden_states(embedder.enc, seqs, packing, packed), reference):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_distilbert_sinusoidal_positions_match_transformers(tmp_path):
    """transformers saves the sinusoidal table as a weight and reads it back: so does jaxserve."""
    path = CASES["distilbert"].write(tmp_path / "sin", scale=None, sinusoidal_pos_embds=True, activation="relu")
    enc = Encoder.from_pretrained(str(path))
    torch_model = hf_tiny.torch_model(path, "DistilBertModel")
    seqs = sequences(enc)
    for got, ids in zip(hidden_states(enc, seqs, PACKING, True), seqs):
        np.testing.assert_allclose(got, hf_tiny.hidden(torch_model, ids), atol=1e-4, rtol=1e-4)


def test_embeddings_match_sentence_transformers(embedder):
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(str(embedder.path), device="cpu").encode(TEXTS)
    got = embedder.enc.embed(TEXTS)
    assert cosine_rows(got, want).min() >= 0.99999
    pooled = normalize(np.stack([h.mean(0) for h in embedder.reference]))
    assert cosine_rows(got, pooled).min() >= 0.99999


def test_packed_rows_equal_padded_rows(embedder):
    texts = TEXTS + [f"doc {i} " + "the model " * (i % 5) for i in range(12)]
    _, rows = embedder.enc.prepare(texts)
    assert rows.layout == "packed" and rows.docs.max() > 1  # rows really are shared
    padded = warm_encoder(embedder.path, PADDED)
    np.testing.assert_allclose(embedder.enc.embed(texts), padded.embed(texts), atol=2e-5)


def test_bfloat16_close_to_float32_reference(embedder):
    enc = warm_encoder(embedder.path, PACKED, dtype="bfloat16")
    want = np.stack([h.mean(0) for h in embedder.reference])
    assert cosine_rows(enc.embed(TEXTS), want).min() >= 0.999


@pytest.mark.parametrize("name", list(CASES))
def test_classifier_logits_match_transformers(tmp_path, name):
    """The *ForSequenceClassification head on the first token, in packed and in padded rows."""
    case = CASES[name]
    labels = {0: "neg", 1: "neutral", 2: "pos"}
    path = case.write(tmp_path / "clf", head="ForSequenceClassification", num_labels=3, id2label=labels,
                      label2id={v: k for k, v in labels.items()})
    enc = warm_encoder(path, PACKED)
    assert enc.head.kind == "classifier" and enc.head.labels == ("neg", "neutral", "pos")
    torch_model = hf_tiny.torch_model(path, f"{case.prefix}ForSequenceClassification")
    want = np.stack([hf_tiny.logits(torch_model, ids) for ids in sequences(enc)])
    got = enc.classify(TEXTS)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    padded = warm_encoder(path, PADDED)
    np.testing.assert_allclose(padded.classify(TEXTS), got, atol=2e-5)


async def test_served_over_http(make_server, embedder):
    client = await make_server(embedder.enc)
    info = await (await client.get("/info")).json()
    assert info["family"] == embedder.case.family and info["max_input_length"] == MAX_LEN
    resp = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "float"})
    assert resp.status == 200
    got = np.array([d["embedding"] for d in (await resp.json())["data"]])
    np.testing.assert_allclose(got, embedder.enc.embed(TEXTS), atol=1e-5)


def test_relative_buckets_equal_transformers():
    """Every distance, both directions, past MAX_DISTANCE: the bucket transformers computes."""
    import torch
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    rel = np.arange(-600, 601, dtype=np.int32)
    want = MPNetEncoder.relative_position_bucket(torch.as_tensor(rel, dtype=torch.long)).numpy()
    table = np.arange(mpnet.NUM_BUCKETS, dtype=np.float32)[:, None]  # [R, 1]: the bias is the bucket itself
    got = mpnet.relative_bias(table, np.zeros((1, 1), np.int32), rel[None])  # [1, 1, 1, K]
    np.testing.assert_array_equal(np.asarray(got)[0, 0, 0], want)


@pytest.mark.parametrize("family, edit, message", [
    ("mpnet", dict(relative_attention_num_buckets=16), "relative_attention_num_buckets 16 < 32"),
    ("mpnet", dict(hidden_act="mystery"), "unsupported hidden_act 'mystery'"),
    ("distilbert", dict(dim=None), "lacks integer field.*dim"),
    ("distilbert", dict(n_heads=5), "dim 32 is not divisible by n_heads 5"),
    ("distilbert", dict(activation="mystery"), "unsupported activation 'mystery'"),
])
def test_unsupported_configs_are_clear_errors(family, edit, message):
    raw = {"model_type": family, **CASES[family].config, **edit}
    with pytest.raises(CheckpointError, match=message):
        FAMILIES[family].configure(raw)


@pytest.mark.parametrize("kv", [4, 2])
def test_score_bias_dense_and_blockwise_equal_softmax_reference(kv):
    """attend's score bias: added to the scaled scores of visible keys, from each document's own positions,
    the same in the dense kernel and in the blockwise one (several key blocks), grouped-query heads too."""
    from jaxserve.models.attention import FULL, Masks, _blockwise, attend, visible

    rng = np.random.default_rng(0)
    b, s, n, h = 2, 12, 4, 8
    q = rng.standard_normal((b, s, n, h)).astype(np.float32)
    k, v = (rng.standard_normal((b, s, kv, h)).astype(np.float32) for _ in range(2))
    seg = np.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12], np.int32)
    pos = np.array([list(range(5)) + list(range(4)) + [0] * 3, list(range(12))], np.int32)
    table = rng.standard_normal((mpnet.NUM_BUCKETS, n)).astype(np.float32) * 2
    bias = lambda pq, pk: mpnet.relative_bias(jax.numpy.asarray(table), pq, pk)
    rel = pos[:, None, :] - pos[:, :, None]  # [B, Sq, Sk] key position - query position
    want_bias = table[mpnet.BUCKETS[np.clip(rel, -128, 128) + 128]].transpose(0, 3, 1, 2)  # [B, N, S, S]
    scores = np.einsum("bqnh,bknh->bnqk", q.astype(np.float64), np.repeat(k, n // kv, 2)) / np.sqrt(h) + want_bias
    scores = np.where(np.asarray(visible(seg, pos, seg, pos, FULL))[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("bnqk,bknh->bqnh", p / p.sum(-1, keepdims=True), np.repeat(v, n // kv, 2))
    real = seg > 0  # padding queries' outputs are never pooled
    dense = np.asarray(attend(q, k, v, Masks(seg, pos), score_bias=bias))
    blocks = np.asarray(_blockwise(q / np.sqrt(h), k, v, Masks(seg, pos, impl="blockwise"), FULL, bias, block=5))
    for got in (dense, blocks):
        np.testing.assert_allclose(got[real], want[real], atol=2e-5)
