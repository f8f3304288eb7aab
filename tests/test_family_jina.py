"""JinaBERT v2 (jina-embeddings-v2-*, jina-reranker-v1) against a reference written here.

transformers has no JinaBERT class and the hub's remote code (jinaai/jina-bert-implementation) is not
reachable from the test machines, so the reference is `reference_hidden` below: a float64 torch forward
written from the hub's modeling code as TEI's candle `backends/candle/src/models/jina.rs` and `alibi.rs`
transcribe it: word + token-type embeddings and LayerNorm (no position table); per layer post-LN BERT
attention with ALiBi's bias -slope_h * |i - j| added to the scaled scores (slopes recomputed here by the
hub's recursive rule), then LayerNorm(x + wo(gelu(a) * b)) with [a; b] = gated_layers(x). The tiny
checkpoint (2 layers, hidden 32, 4 heads of 8: slopes 1/4 .. 1/256) is seeded tensors under the hub's names
with the hub's config.json (model_type bert, position_embedding_type alibi, feed_forward_type geglu), and
sentence-transformers modules (mean pooling, Normalize) as jina-embeddings-v2 ship them.
"""

import json
import math

import hf_tiny
import numpy as np
import pytest
from conftest import TINY_TABLE, cosine_rows, warm_encoder

from jaxserve.errors import CheckpointError
from jaxserve.models import family_of, jina_bert
from jaxserve.runtime.buckets import fixed

VOCAB = hf_tiny.vocab("bert")
MAX_LEN = 64
D, N, F, LAYERS = 32, 4, 48, 2
TEXTS = ["x", "the model", "a batch of jax documents is the query " * 2, "hello, world! 42",
         " ".join(f"w{i % 10}" for i in range(40))]  # 80 tokens: truncated at MAX_LEN
# jina-embeddings-v2-base-en's config.json at the tiny model's sizes.
HUB_CONFIG = {
    "_name_or_path": "jinaai/jina-bert-implementation", "architectures": ["JinaBertForMaskedLM"],
    "auto_map": {"AutoConfig": "jinaai/jina-bert-implementation--configuration_bert.JinaBertConfig",
                 "AutoModel": "jinaai/jina-bert-implementation--modeling_bert.JinaBertModel"},
    "model_type": "bert", "position_embedding_type": "alibi", "feed_forward_type": "geglu", "hidden_act": "gelu",
    "emb_pooler": "mean", "attention_probs_dropout_prob": 0.0, "hidden_dropout_prob": 0.1, "hidden_size": D,
    "intermediate_size": F, "num_hidden_layers": LAYERS, "num_attention_heads": N, "max_position_embeddings": MAX_LEN,
    "type_vocab_size": 2, "vocab_size": len(VOCAB), "layer_norm_eps": 1e-12, "pad_token_id": 0,
}


def seeded_tensors(seed: int, prefix: str = "") -> dict[str, np.ndarray]:
    """The hub's tensor names (JinaBertModel's state dict) with N(0, 0.3²) values, LayerNorm weights around 1."""
    rng = np.random.default_rng(seed)
    shapes = {"embeddings.word_embeddings.weight": (len(VOCAB), D), "embeddings.token_type_embeddings.weight": (2, D),
              "embeddings.LayerNorm.weight": (D,), "embeddings.LayerNorm.bias": (D,)}
    for i in range(LAYERS):
        p = f"encoder.layer.{i}"
        for n in ("query", "key", "value"):
            shapes |= {f"{p}.attention.self.{n}.weight": (D, D), f"{p}.attention.self.{n}.bias": (D,)}
        shapes |= {f"{p}.attention.output.dense.weight": (D, D), f"{p}.attention.output.dense.bias": (D,),
                   f"{p}.attention.output.LayerNorm.weight": (D,), f"{p}.attention.output.LayerNorm.bias": (D,),
                   f"{p}.mlp.gated_layers.weight": (2 * F, D), f"{p}.mlp.wo.weight": (D, F), f"{p}.mlp.wo.bias": (D,),
                   f"{p}.mlp.layernorm.weight": (D,), f"{p}.mlp.layernorm.bias": (D,)}
    out = {}
    for name, shape in shapes.items():
        w = rng.normal(0, 0.3, shape).astype(np.float32)
        out[prefix + name] = 1 + w if "LayerNorm.weight" in name or "layernorm.weight" in name else w
    return out


def write_checkpoint(path, tensors, config):
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    hf_tiny.make_tokenizer("bert").save(str(path / "tokenizer.json"))
    return path


def hub_slopes(n: int) -> list[float]:
    """The hub's `_get_alibi_head_slopes` (recursive for head counts that are not powers of two)."""
    def power_of_2(k):
        start = 2 ** (-2 ** -(math.log2(k) - 3))
        return [start * start ** i for i in range(k)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + hub_slopes(2 * closest)[0::2][:n - closest]


def reference_hidden(t: dict, ids: np.ndarray, alibi: bool = True, prefix: str = "") -> np.ndarray:
    """Last hidden states [S, D] of one document (no padding), float64 (see the module docstring)."""
    import torch
    import torch.nn.functional as fn

    w = {k[len(prefix):]: torch.as_tensor(v, dtype=torch.float64) for k, v in t.items() if k.startswith(prefix)}
    ln = lambda x, p: fn.layer_norm(x, (D,), w[f"{p}.weight"], w[f"{p}.bias"], eps=1e-12)
    lin = lambda x, p: x @ w[f"{p}.weight"].T + w.get(f"{p}.bias", 0)
    ids = torch.as_tensor(ids, dtype=torch.long)
    x = ln(w["embeddings.word_embeddings.weight"][ids] + w["embeddings.token_type_embeddings.weight"][0],
           "embeddings.LayerNorm")
    s, h = len(ids), D // N
    pos = torch.arange(s, dtype=torch.float64)
    bias = -torch.tensor(hub_slopes(N), dtype=torch.float64)[:, None, None] * (pos[None, :] - pos[:, None]).abs()
    for i in range(LAYERS):
        p = f"encoder.layer.{i}"
        q, k, v = (lin(x, f"{p}.attention.self.{n}").reshape(s, N, h).transpose(0, 1) for n in ("query", "key", "value"))
        scores = q @ k.transpose(1, 2) / math.sqrt(h) + (bias if alibi else 0)  # [N, S, S]
        ctx = (scores.softmax(-1) @ v).transpose(0, 1).reshape(s, D)
        x = ln(x + lin(ctx, f"{p}.attention.output.dense"), f"{p}.attention.output.LayerNorm")
        g = lin(x, f"{p}.mlp.gated_layers")
        x = ln(x + lin(fn.gelu(g[:, :F]) * g[:, F:], f"{p}.mlp.wo"), f"{p}.mlp.layernorm")
    return x.numpy()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(checkpoint dir with sentence-transformers modules, its tensors, Encoder warmed on TINY_TABLE)."""
    tensors = seeded_tensors(3)
    path = write_checkpoint(tmp_path_factory.mktemp("jina") / "v2", tensors, HUB_CONFIG)
    hf_tiny.sentence_transformers_dir(path, pooling="mean", max_seq_length=MAX_LEN)
    return path, tensors, warm_encoder(path, TINY_TABLE)


def test_alibi_slopes_match_the_hub_rule():
    for n in (1, 2, 4, 8, 12, 16, 24):
        np.testing.assert_allclose(jina_bert.alibi_slopes(n), hub_slopes(n), rtol=1e-6)
    np.testing.assert_allclose(jina_bert.alibi_slopes(8), 2.0 ** -np.arange(1, 9))


def test_routed_by_alibi_not_model_type():
    assert family_of(HUB_CONFIG).name == "jina_bert"
    assert family_of({**HUB_CONFIG, "position_embedding_type": "absolute"}).name == "bert"


def test_hidden_states_match_reference(checkpoint):
    """Padded rows, one packed row and the blockwise kernel, each document as the reference gives it alone."""
    _, tensors, enc = checkpoint
    assert enc.family.name == "jina_bert"
    docs = [np.asarray(ids, np.int32) for ids in enc.tokenizer.encode(TEXTS)]
    want = [reference_hidden(tensors, d) for d in docs]
    assert np.abs(reference_hidden(tensors, docs[2], alibi=False) - want[2]).max() > 1e-2  # ALiBi matters
    for impl, packed in [("dense", False), ("dense", True), ("blockwise", True)]:
        got = hf_tiny.hidden_states(enc.family.encoder(enc.model_config, attention=impl), enc.params, docs, packed)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=f"{impl}, packed={packed}")


def test_embeddings_match_reference_mean_pooling(checkpoint):
    path, tensors, enc = checkpoint
    assert enc.embedding_config.max_seq_length == MAX_LEN
    assert max(len(ids) for ids in hf_tiny.full_ids(path, TEXTS)) > MAX_LEN  # truncated to MAX_LEN on our side
    docs = [np.asarray(ids, np.int32) for ids in enc.tokenizer.encode(TEXTS)]
    assert max(len(d) for d in docs) == MAX_LEN
    want = np.stack([reference_hidden(tensors, d).mean(0) for d in docs])
    assert cosine_rows(enc.embed(TEXTS), want).min() >= 0.99999


def test_packed_rows_equal_padded_rows(checkpoint):
    path, _, enc = checkpoint
    hf_tiny.assert_packed_equals_padded(enc, path, TEXTS, MAX_LEN)


async def test_served_over_http(make_server, checkpoint):
    _, _, enc = checkpoint
    client = await make_server(enc)
    info = await (await client.get("/info")).json()
    assert (info["family"], info["pooling"], info["max_input_length"]) == ("jina_bert", "mean", MAX_LEN)
    resp = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "float"})
    assert resp.status == 200
    got = np.array([d["embedding"] for d in (await resp.json())["data"]])
    np.testing.assert_allclose(got, enc.embed(TEXTS), atol=1e-5)


def test_reranker_logits_match_reference(tmp_path):
    """JinaBertForSequenceClassification (jina-reranker-v1): `bert.`-prefixed encoder, BERT's tanh pooler on the
    first token, classifier."""
    rng = np.random.default_rng(7)
    tensors = seeded_tensors(5, prefix="bert.") | {
        "bert.pooler.dense.weight": rng.normal(0, 0.3, (D, D)).astype(np.float32),
        "bert.pooler.dense.bias": rng.normal(0, 0.3, (D,)).astype(np.float32),
        "classifier.weight": rng.normal(0, 0.3, (1, D)).astype(np.float32),
        "classifier.bias": rng.normal(0, 0.3, (1,)).astype(np.float32)}
    config = {**HUB_CONFIG, "architectures": ["JinaBertForSequenceClassification"], "num_labels": 1,
              "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    enc = warm_encoder(write_checkpoint(tmp_path / "reranker", tensors, config), fixed([(4, MAX_LEN)]))
    assert enc.head.kind == "classifier"
    want = []
    for ids in enc.tokenizer.encode(TEXTS[:4]):
        first = reference_hidden(tensors, np.asarray(ids), prefix="bert.")[0]
        pooled = np.tanh(first @ tensors["bert.pooler.dense.weight"].T + tensors["bert.pooler.dense.bias"])
        want.append(pooled @ tensors["classifier.weight"].T + tensors["classifier.bias"])
    np.testing.assert_allclose(enc.classify(TEXTS[:4]), np.stack(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("edit, message", [
    ({"_name_or_path": "jinaai/jina-bert-v2-qk-post-norm"}, "unsupported JinaBERT variant jina-bert-v2-qk-post-norm"),
    ({"auto_map": {"AutoConfig": "jinaai/jina-bert-v2-qk-post-norm--configuration_bert.JinaBertConfig"}},
     "unsupported JinaBERT variant"),
    ({"feed_forward_type": "original"}, "unsupported JinaBERT feed_forward_type 'original'"),
    ({"num_attention_heads": 5}, "not divisible by num_attention_heads 5"),
    ({"max_position_embeddings": None}, "lacks integer field.*max_position_embeddings"),
])
def test_unsupported_configs_are_clear_errors(edit, message):
    with pytest.raises(CheckpointError, match=message):
        family_of({**HUB_CONFIG, **edit}).configure({**HUB_CONFIG, **edit})


@pytest.mark.parametrize("edit, message", [
    ({"position_embedding_type": "relative_key"}, "unsupported position_embedding_type 'relative_key'"),
    ({"position_embedding_type": "absolute", "is_decoder": True}, "unsupported is_decoder=True"),  # causal in transformers
])
def test_plain_bert_variants_still_refused(edit, message):
    with pytest.raises(CheckpointError, match=message):
        family_of({**HUB_CONFIG, **edit}).configure({**HUB_CONFIG, **edit})

