"""Alibaba GTE (gte-*-en-v1.5, gte-multilingual-base) against transformers' GteModel and sentence-transformers 6.

The tiny checkpoint (2 layers, hidden 32, 2 heads of 16) is written by transformers itself (the hub's tensor
names: qkv_proj, up_gate_proj, attn_ln, mlp_ln) and saved by sentence-transformers with CLS pooling, as
gte-*-en-v1.5 are. The hub's own config (`model_type: new`) reads into the config transformers' `gte` gives;
its static `ntk` rope_scaling is checked against transformers' model with the hub's frequencies put in
its rotary embedding (the reference TEI and the hub's NTKScalingRotaryEmbedding compute).
"""

import dataclasses
import json
import shutil

import hf_tiny
import numpy as np
import pytest
from conftest import TINY_TABLE, cosine_rows, warm_encoder

from jaxserve import Encoder
from jaxserve.errors import CheckpointError
from jaxserve.models import FAMILIES, gte

VOCAB = hf_tiny.vocab("bert")
MAX_LEN = 64  # the tiny model's max_position_embeddings: TINY_TABLE's longest seqlen
CONFIG = {"vocab_size": len(VOCAB), "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 2, "max_position_embeddings": MAX_LEN, "pad_token_id": VOCAB["[PAD]"],
          "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}
TEXTS = ["x", "the model", "a batch of jax documents is the query " * 2, "hello, world! 42",
         " ".join(f"w{i % 10}" for i in range(40))]  # 80 tokens: truncated at MAX_LEN
# The hub's config.json (gte-base-en-v1.5's layout: remote code `NewModel`) at the tiny model's sizes.
HUB_CONFIG = {
    "model_type": "new", "architectures": ["NewModel"], "vocab_size": len(VOCAB), "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": MAX_LEN,
    "hidden_act": "gelu", "layer_norm_eps": 1e-12, "type_vocab_size": 1, "rope_theta": 500.0, "rope_scaling": None,
    "position_embedding_type": "rope", "layer_norm_type": "layer_norm", "logn_attention_scale": False,
    "logn_attention_clip1": False, "pack_qkv": True, "unpad_inputs": True, "use_memory_efficient_attention": True,
    "pad_token_id": VOCAB["[PAD]"],
}


def hf_config(**overrides):
    import transformers

    return transformers.GteConfig(**{**CONFIG, **overrides})


def st6_save(raw, out):
    """sentence-transformers 6's save of the transformers checkpoint `raw`: CLS pooling, Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.normalize import Normalize
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling
    from transformers import PreTrainedTokenizerFast

    # transformers maps `gte` to XLM-R's sentencepiece tokenizer: the tiny WordPiece tokenizer.json is loaded as is
    (raw / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "pad_token": "[PAD]", "model_max_length": MAX_LEN}))
    transformer = Transformer(str(raw))
    transformer.processor = PreTrainedTokenizerFast(tokenizer_file=str(raw / "tokenizer.json"), pad_token="[PAD]")
    st = SentenceTransformer(modules=[transformer, Pooling(32, pooling_mode="cls"), Normalize()], device="cpu")
    st.max_seq_length = MAX_LEN
    st.save(str(out))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(sentence-transformers dir, Encoder warmed on TINY_TABLE)."""
    root = tmp_path_factory.mktemp("gte")
    raw = hf_tiny.write(root / "hf", "GteModel", hf_config(), kind="bert", seed=3, scale=0.3)
    path = st6_save(raw, root / "st")
    return path, warm_encoder(path, TINY_TABLE)


def test_hidden_states_match_transformers(checkpoint):
    path, enc = checkpoint
    model = hf_tiny.torch_model(path, "GteModel")
    docs = [np.asarray(ids, np.int32) for ids in enc.tokenizer.encode(TEXTS)]
    hf_tiny.check_hidden(enc.family, enc.model_config, enc.params, model, docs)


def test_embeddings_match_sentence_transformers(checkpoint):
    from sentence_transformers import SentenceTransformer

    path, enc = checkpoint
    st = SentenceTransformer(str(path), device="cpu")
    assert enc.embedding_config.max_seq_length == MAX_LEN
    assert max(len(ids) for ids in hf_tiny.full_ids(path, TEXTS)) > MAX_LEN  # truncated the same way on both sides
    assert cosine_rows(enc.embed(TEXTS), st.encode(TEXTS)).min() >= 0.99999


def test_packed_rows_equal_padded_rows(checkpoint):
    path, enc = checkpoint
    hf_tiny.assert_packed_equals_padded(enc, path, TEXTS, MAX_LEN)


def test_bfloat16_close_to_float32(checkpoint):
    path, enc = checkpoint
    hf_tiny.assert_bfloat16_close(enc, path, TEXTS, TINY_TABLE)


async def test_served_over_http(make_server, checkpoint):
    _, enc = checkpoint
    client = await make_server(enc)
    info = await (await client.get("/info")).json()
    assert (info["family"], info["pooling"], info["max_input_length"]) == ("gte", "cls", MAX_LEN)
    resp = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "float"})
    assert resp.status == 200
    got = np.array([d["embedding"] for d in (await resp.json())["data"]])
    np.testing.assert_allclose(got, enc.embed(TEXTS), atol=1e-5)


def test_hub_layout_reads_as_transformers_layout(checkpoint, tmp_path):
    """The hub's `new` config gives the config transformers' `gte` gives (but its name); the same tensors load."""
    import jax

    path, enc = checkpoint
    native = json.loads((path / "config.json").read_text())
    hub_cfg = gte.configure(HUB_CONFIG)
    assert hub_cfg.model_type == "new" and gte.configure(native) == enc.model_config
    assert dataclasses.replace(hub_cfg, model_type="gte") == enc.model_config
    hub = shutil.copytree(path, tmp_path / "hub")
    (hub / "config.json").write_text(json.dumps(HUB_CONFIG))
    loaded = Encoder.from_pretrained(str(hub))
    assert loaded.family.name == "gte"
    for a, b in zip(*(jax.tree.leaves(e.params) for e in (loaded, enc))):
        np.testing.assert_array_equal(a, b)


def test_hub_ntk_scaling_without_token_types(tmp_path):
    """gte-base-en-v1.5's layout: no token-type table, rope_scaling {type: ntk, factor: 2}: every length rotates
    with base * 2 and frequencies / 2 ** (2 / H), packed or alone."""
    import torch
    import transformers

    path = hf_tiny.write(tmp_path / "ntk", "GteModel", hf_config(type_vocab_size=0, max_position_embeddings=128),
                         kind="bert", seed=4, scale=0.3)
    factor, base, dim = 2.0, 500.0, 16
    (path / "config.json").write_text(json.dumps({**HUB_CONFIG, "type_vocab_size": 0, "max_position_embeddings": 128,
                                                  "rope_scaling": {"type": "ntk", "factor": factor}}))
    enc = Encoder.from_pretrained(str(path))
    assert enc.model_config.type_vocab_size == 0 and "token_type" not in enc.params
    model = transformers.GteModel.from_pretrained(path, config=hf_config(type_vocab_size=0, max_position_embeddings=128),
                                                  attn_implementation="eager").eval()
    docs = [np.asarray(ids, np.int32) for ids in hf_tiny.full_ids(path, [
        "the model", "a batch of jax documents", "hello, world! 42 " * 3, "the query of the model " * 6])]
    unscaled = hf_tiny.hidden(model, docs[-1])
    hub = 1.0 / (base * factor) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim) / factor ** (2 / dim)
    model.rotary_emb.inv_freq.copy_(hub)
    want = [hf_tiny.hidden(model, d) for d in docs]
    assert np.abs(unscaled - want[-1]).max() > 1e-2  # the scaling matters
    for packed in (False, True):
        got = hf_tiny.hidden_states(enc.family.encoder(enc.model_config), enc.params, docs, packed)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=f"packed={packed}")


def test_classifier_logits_match_transformers(tmp_path):
    """GteForSequenceClassification (gte-multilingual-reranker-base): BERT's pooler (tanh) and classifier."""
    path = hf_tiny.write(tmp_path / "clf", "GteForSequenceClassification", hf_config(num_labels=1), kind="bert",
                         seed=5, scale=0.3)
    enc = warm_encoder(path, TINY_TABLE)
    model = hf_tiny.torch_model(path, "GteForSequenceClassification")
    want = np.stack([hf_tiny.logits(model, np.asarray(ids, np.int32)) for ids in enc.tokenizer.encode(TEXTS[:4])])
    np.testing.assert_allclose(enc.classify(TEXTS[:4]), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("edit, message", [
    ({"position_embedding_type": "absolute"}, "unsupported GTE config position_embedding_type='absolute'"),
    ({"layer_norm_type": "rms_norm"}, "layer_norm_type='rms_norm'"),
    ({"logn_attention_scale": True}, "logn_attention_scale=True"),
    ({"pack_qkv": False}, "pack_qkv=False"),
    ({"rope_scaling": {"type": "ntk", "factor": 2.0, "mixed_b": 0.5}}, "unsupported GTE rope_scaling"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "unsupported GTE rope_scaling"),
    ({"rope_scaling": {"type": "ntk"}}, "rope_scaling factor must be a positive number"),
    ({"type_vocab_size": None}, "type_vocab_size must be a non-negative integer"),
    ({"rope_theta": None}, "rope_theta must be a positive number, not None"),
    ({"num_attention_heads": 3}, "is not an even head dim"),
    ({"hidden_act": "mystery"}, "unsupported hidden_act 'mystery'"),
])
def test_unsupported_hub_configs_are_clear_errors(edit, message):
    with pytest.raises(CheckpointError, match=message):
        FAMILIES["new"].configure({**HUB_CONFIG, **edit})


def test_unsupported_rope_type_is_a_clear_error():
    raw = {"model_type": "gte", **CONFIG, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(CheckpointError, match="unsupported RoPE type 'yarn'"):
        FAMILIES["gte"].configure(raw)
