"""ModernBERT against transformers' PyTorch model, on tiny checkpoints transformers writes itself.

The tiny model has 3 layers (global, local, local, as `global_attn_every_n_layers`
3 lays them out) and a local window of 8 (4 positions either side), so most
documents here run past the window, and packed rows put such documents side
by side: each must get the rotary positions and the window it gets alone.
"""

import json

import hf_tiny
import numpy as np
import pytest
from conftest import cosine_rows, warm_encoder

from jaxserve.errors import CheckpointError
from jaxserve.models import FAMILIES, modernbert
from jaxserve.models.attention import visible
from jaxserve.runtime.buckets import fixed

MAX_LEN = 128  # tokens, special ones included: the tiny model's max_position_embeddings
HIDDEN = 32
LOCAL_ATTENTION = 8  # a local layer sees keys at most 4 positions away
PACKED = fixed([(4, MAX_LEN)], layout="packed")
PADDED = fixed([(4, MAX_LEN)])
VOCAB = hf_tiny.vocab("bert")
CONFIG = dict(
    vocab_size=len(VOCAB), hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
    local_attention=LOCAL_ATTENTION, max_position_embeddings=MAX_LEN, pad_token_id=VOCAB["[PAD]"],
    bos_token_id=VOCAB["[CLS]"], cls_token_id=VOCAB["[CLS]"], eos_token_id=VOCAB["[SEP]"],
    sep_token_id=VOCAB["[SEP]"],
)
TEXTS = [
    "the model",
    "hello, world! 42",
    "a batch of jax documents is the query " * 3,  # 29 tokens
    " ".join(f"w{i % 10}" for i in range(42)),  # 86 tokens
    "x",
    "the query of the model " * 30,  # over MAX_LEN: truncated
]
# Hand-packed rows of TEXTS' sequences: the 86-token document starts after the 29-token one.
PACKING = [[2, 3], [0, 1, 4], [5]]


def write(path, head="Model", scale=0.3, **overrides):
    """A tiny checkpoint, with the tokenizer_config.json real ModernBERT checkpoints carry: its special
    tokens (sentence-transformers pads with them) and no token type ids among the model's inputs."""
    import transformers

    config = transformers.ModernBertConfig(**{**CONFIG, **overrides})
    hf_tiny.write(path, f"ModernBert{head}", config, kind="bert", seed=0, scale=scale)
    specials = {f"{k}_token": f"[{k.upper()}]" for k in ("cls", "sep", "pad", "unk", "mask")}
    (path / "tokenizer_config.json").write_text(json.dumps({
        **specials, "model_max_length": MAX_LEN, "tokenizer_class": "PreTrainedTokenizerFast",
        "model_input_names": ["input_ids", "attention_mask"]}))
    return path


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


def hidden_states(enc, seqs, packing, packed, attention="dense"):
    """Each sequence's last hidden states [n, D], from one forward over `packing`'s rows."""
    import jax

    x = rows(seqs, packing)
    module = enc.family.encoder(enc.model_config, np.float32, attention=attention)
    apply = jax.jit(module.apply, static_argnames="packed")
    h = np.asarray(apply({"params": enc.params}, x["ids"], x["seg"], x["pos"], np.zeros_like(x["ids"]), packed=packed))
    out = {}
    for r, row in enumerate(packing):
        col = 0
        for i in row:
            out[i] = h[r, col:col + len(seqs[i])]
            col += len(seqs[i])
    return [out[i] for i in range(len(seqs))]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """A tiny embedding checkpoint (mean pooling), jaxserve's model of it (packed rows), and
    transformers' last hidden states of each of TEXTS."""
    path = write(tmp_path_factory.mktemp("modernbert") / "emb")
    hf_tiny.sentence_transformers_dir(path, pooling="mean", max_seq_length=MAX_LEN, hidden_size=HIDDEN)
    enc = warm_encoder(path, PACKED)
    torch_model = hf_tiny.torch_model(path, "ModernBertModel")
    seqs = sequences(enc)
    return path, enc, seqs, [hf_tiny.hidden(torch_model, ids) for ids in seqs]


def test_tiny_model_has_global_and_local_layers(embedder):
    _, enc, seqs, _ = embedder
    cfg = enc.model_config
    assert cfg.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    assert [s.window for s in cfg.specs] == [None, LOCAL_ATTENTION // 2 + 1, LOCAL_ATTENTION // 2 + 1]
    assert cfg.thetas == (160_000.0, 10_000.0, 10_000.0)
    assert sorted(len(s) for s in seqs)[-4:] == [16, 29, 86, MAX_LEN]  # far past the window


@pytest.mark.parametrize("attention", ["dense", "blockwise"])
def test_hidden_states_match_transformers(embedder, attention):
    """Alone in a row and packed beside other documents longer than the window: transformers' states."""
    _, enc, seqs, reference = embedder
    one_per_row = [[i] for i in range(len(seqs))]
    for packing, packed in [(one_per_row, False), (PACKING, True)]:
        for got, want in zip(hidden_states(enc, seqs, packing, packed, attention), reference):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_local_window_equals_transformers_mask():
    """Spec's exclusive window is transformers' inclusive |q - k| <= local_attention // 2, for odd windows too."""
    import torch
    import transformers
    from transformers.masking_utils import create_bidirectional_sliding_window_mask

    s = 24
    for local in (8, 9, 2):
        config = transformers.ModernBertConfig(**{**CONFIG, "local_attention": local})
        config._attn_implementation = "eager"
        want = create_bidirectional_sliding_window_mask(
            config=config, inputs_embeds=torch.zeros(1, s, HIDDEN), attention_mask=torch.ones(1, s, dtype=torch.long))
        want = want[0, 0].numpy() == 0  # additive mask: 0 where seen
        cfg = modernbert.Config.from_dict({"model_type": "modernbert", **config.to_dict()})
        seg, pos = np.ones((1, s), np.int32), np.arange(s, dtype=np.int32)[None]
        got = np.asarray(visible(seg, pos, seg, pos, cfg.specs[1]))[0]
        np.testing.assert_array_equal(got, want)


def test_packed_rows_equal_padded_rows(embedder):
    path, enc, _, _ = embedder
    texts = TEXTS + [f"doc {i} " + "the model " * (i % 6) + "a batch " * (i % 4) for i in range(14)]
    pieces, packed_rows = enc.prepare(texts)
    lengths = np.diff(pieces.offsets)
    shared = [packed_rows.members[a:b] for a, b in zip(packed_rows.starts[:-1], packed_rows.starts[1:]) if b - a > 1]
    assert any((lengths[row] > LOCAL_ATTENTION).sum() > 1 for row in shared), "long documents must share rows"
    padded = warm_encoder(path, PADDED)
    np.testing.assert_allclose(enc.embed(texts), padded.embed(texts), atol=2e-5)


def test_bfloat16_close_to_float32_reference(embedder):
    path, _, _, reference = embedder
    enc = warm_encoder(path, PACKED, dtype="bfloat16")
    want = np.stack([h.mean(0) for h in reference])
    assert cosine_rows(enc.embed(TEXTS), want).min() >= 0.999


def test_embeddings_match_sentence_transformers(embedder):
    from sentence_transformers import SentenceTransformer

    path, enc, _, reference = embedder
    want = SentenceTransformer(str(path), device="cpu").encode(TEXTS)
    got = enc.embed(TEXTS)
    assert cosine_rows(got, want).min() >= 0.99999
    assert cosine_rows(got, np.stack([h.mean(0) for h in reference])).min() >= 0.99999


@pytest.mark.parametrize("pooling, biases", [("cls", False), ("mean", True)])
def test_classifier_logits_match_transformers(tmp_path, pooling, biases):
    """ModernBertForSequenceClassification: head on the CLS token or the mean state; every bias off
    (as released checkpoints) or on, so each bias tensor is read."""
    labels = {0: "neg", 1: "neutral", 2: "pos"}
    flags = {k: biases for k in ("attention_bias", "mlp_bias", "norm_bias", "classifier_bias")}
    path = write(tmp_path / "clf", head="ForSequenceClassification", classifier_pooling=pooling,
                 num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()}, **flags)
    enc = warm_encoder(path, PACKED)
    assert enc.head.labels == ("neg", "neutral", "pos") and enc.family.pooling_for_head(enc.model_config) == pooling
    torch_model = hf_tiny.torch_model(path, "ModernBertForSequenceClassification")
    want = np.stack([hf_tiny.logits(torch_model, ids) for ids in sequences(enc)])
    _, packed_rows = enc.prepare(TEXTS)
    assert packed_rows.docs.max() > 1
    np.testing.assert_allclose(enc.classify(TEXTS), want, atol=1e-4, rtol=1e-4)


async def test_served_over_http(make_server, embedder):
    _, enc, _, _ = embedder
    client = await make_server(enc)
    info = await (await client.get("/info")).json()
    assert (info["family"], info["pooling"], info["max_input_length"]) == ("modernbert", "mean", MAX_LEN)
    resp = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "float"})
    assert resp.status == 200
    got = np.array([d["embedding"] for d in (await resp.json())["data"]])
    np.testing.assert_allclose(got, enc.embed(TEXTS), atol=1e-5)


@pytest.mark.parametrize("fields", [
    {},  # transformers 5 defaults
    {"global_attn_every_n_layers": 2, "global_rope_theta": 5000.0, "local_rope_theta": 77.0},  # older configs
    {"layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
     "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 321.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 12.0}}},
])
def test_layer_kinds_and_rope_bases_as_transformers_reads_them(fields):
    import transformers

    raw = {"model_type": "modernbert", **CONFIG, "num_hidden_layers": 4, **fields}
    want = transformers.ModernBertConfig.from_dict(raw)
    cfg = FAMILIES["modernbert"].configure(raw)
    assert list(cfg.layer_types) == want.layer_types
    assert list(cfg.thetas) == [want.rope_parameters[t]["rope_theta"] for t in want.layer_types]


@pytest.mark.parametrize("edit, message", [
    (dict(hidden_activation="mystery"), "unsupported hidden_activation 'mystery'"),
    (dict(classifier_pooling="max"), "unsupported classifier_pooling 'max'"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "unsupported RoPE type 'linear'"),
    (dict(local_rope_theta=None), "RoPE base of sliding_attention layers must be a positive number"),
    (dict(layer_types=["full_attention"]), "layer_types .* for each of 3 layers"),
    (dict(num_attention_heads=5), "hidden_size 32 is not divisible by num_attention_heads 5"),
    (dict(hidden_size=None), "lacks integer field.*hidden_size"),
    (dict(local_attention=0), "local_attention must be an integer >= 2"),
])
def test_unsupported_configs_are_clear_errors(edit, message):
    raw = {"model_type": "modernbert", **CONFIG, **edit}
    with pytest.raises(CheckpointError, match=message):
        FAMILIES["modernbert"].configure(raw)
