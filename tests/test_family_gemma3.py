"""Gemma 3 text models (EmbeddingGemma): transformers, sentence-transformers and the server as references.

Two tiny checkpoints written by transformers itself (hf_tiny), each compiled once per module:
- embeddinggemma: bidirectional attention; its sliding layers see keys up to 8 // 2 positions away, both ways;
- causal: causal attention with a window of 8, attention biases, its own RoPE bases and linear RoPE
  scaling on the full layers.
Both have three layers (sliding, full, sliding), head_dim 16 != hidden 32 / 4 heads, 2 KV heads and
query_pre_attn_scalar 32 != head_dim; the long documents run past the window several times.
"""

import dataclasses
import json

import hf_tiny
import numpy as np
import pytest
from conftest import warm_encoder

from jaxserve import Encoder
from jaxserve.errors import CheckpointError
from jaxserve.models import FAMILIES, gemma3
from jaxserve.models.attention import Spec
from jaxserve.runtime.buckets import fixed

VOCAB = hf_tiny.vocab("gemma")
WINDOW = 8  # config.json's sliding_window
MAX_LEN = 64  # sentence_bert_config's max_seq_length: the tables stop here
COMMON = dict(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=32, max_position_embeddings=128,
              sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              pad_token_id=VOCAB["<pad>"], eos_token_id=VOCAB["<eos>"], bos_token_id=VOCAB["<bos>"])
ARCHS = {
    "embeddinggemma": dict(use_bidirectional_attention=True),
    "causal": dict(use_bidirectional_attention=False, attention_bias=True, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
}
TEXTS = ["x", "the model", "a batch of jax documents is the query",
         "the model is a document of the batch " * 3, "hello, world! 42", "jax " * 80]
LONG_DOCS = ["x", "the model", "a batch of jax documents is the query " * 3,
             "the model is a document " * 6 + "hello, world! 42 " * 4]
PACKED = fixed([(2, 32), (2, MAX_LEN)], layout="packed")
ONE_BUCKET = fixed([(4, MAX_LEN)], layout="packed")
FULL_LENGTH = fixed([(2, 128)], layout="packed")  # checkpoints without sentence_bert_config: the model's 128


def hf_config(arch: str, **overrides):
    import transformers

    return transformers.Gemma3TextConfig(**{**COMMON, **ARCHS[arch], **overrides})


def write(path, arch: str, model_class: str = "Gemma3TextModel", **config):
    hf_tiny.write(path, model_class, hf_config(arch, **config), kind="gemma", seed=1, scale=0.3)
    return path


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tmp_path_factory):
    """(arch, checkpoint dir, transformers model, Encoder warmed on a packed table)."""
    path = write(tmp_path_factory.mktemp(request.param) / "ckpt", request.param)
    hf_tiny.sentence_transformers_dir(path, pooling="mean", max_seq_length=MAX_LEN)
    model = hf_tiny.torch_model(path, "Gemma3TextModel")
    return request.param, path, model, warm_encoder(path, PACKED)


def test_hidden_states_match_transformers(arch):
    """Padded rows and one packed row equal transformers' states, documents longer than the window included;
    the window and the attention direction both matter (changing either changes the states)."""
    name, path, model, enc = arch
    docs = hf_tiny.full_ids(path, LONG_DOCS)
    assert len(docs[-1]) > 4 * WINDOW and sum(map(len, docs)) <= 128
    want, worst = hf_tiny.check_hidden(enc.family, enc.model_config, enc.params, model, docs)
    print(f"{name}: max abs difference vs transformers {worst:.2e}")
    cfg = enc.model_config
    assert cfg.bidirectional == (name == "embeddinggemma")
    for changed in (dataclasses.replace(cfg, layer_types=("full_attention",) * 3),
                    dataclasses.replace(cfg, bidirectional=not cfg.bidirectional)):
        other = hf_tiny.hidden_states(enc.family.encoder(changed), enc.params, docs[-1:], packed=False)[0]
        assert np.abs(other - want[-1]).max() > 1e-2


def test_packed_equals_padded(arch):
    _, path, _, enc = arch
    hf_tiny.assert_packed_equals_padded(enc, path, TEXTS, MAX_LEN)


def test_bfloat16_close_to_float32(arch):
    _, path, _, enc = arch
    hf_tiny.assert_bfloat16_close(enc, path, TEXTS, ONE_BUCKET)


def test_matches_sentence_transformers_mean(arch):
    """Mean pooling as sentence-transformers', with left padding (GemmaTokenizer's default) and right."""
    _, path, _, enc = arch
    assert enc.embedding_config.pooling == "mean"
    hf_tiny.assert_matches_sentence_transformers(enc, path, TEXTS, "<pad>", MAX_LEN)


def test_classifier_logits_match_transformers(tmp_path):
    """Gemma3TextForSequenceClassification: the `score` Linear on each sequence's last token (<eos>), packed rows."""
    labels = {0: "neg", 1: "neutral", 2: "pos"}
    path = write(tmp_path / "cls", "embeddinggemma", "Gemma3TextForSequenceClassification", num_labels=3,
                 id2label=labels)
    enc = warm_encoder(path, FULL_LENGTH)
    assert enc.head.labels == ("neg", "neutral", "pos") and enc.family.pooling_for_head(enc.model_config) == "lasttoken"
    model = hf_tiny.torch_model(path, "Gemma3TextForSequenceClassification")
    want = np.stack([hf_tiny.logits(model, ids) for ids in enc.tokenizer.encode(TEXTS)])
    np.testing.assert_allclose(enc.classify(TEXTS), want, atol=1e-4)


def test_causal_lm_checkpoint_loads_without_its_lm_head(tmp_path):
    """A Gemma3ForCausalLM checkpoint: `model.` prefixed names, `lm_head.weight` ignored."""
    from safetensors import safe_open

    path = write(tmp_path / "lm", "causal", "Gemma3ForCausalLM", tie_word_embeddings=False)
    with safe_open(str(path / "model.safetensors"), "np") as f:
        assert "lm_head.weight" in f.keys() and "model.norm.weight" in f.keys()
    enc = Encoder.from_pretrained(str(path))
    assert enc.head.kind == "embedding"
    hf_tiny.check_hidden(enc.family, enc.model_config, enc.params, hf_tiny.torch_model(path, "Gemma3TextModel"),
                         hf_tiny.full_ids(path, LONG_DOCS[2:]))


async def test_served_over_http(arch, make_server):
    _, _, _, enc = arch
    client = await make_server(enc)
    resp = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "float"})
    assert resp.status == 200
    got = np.array([d["embedding"] for d in (await resp.json())["data"]])
    np.testing.assert_allclose(got, enc.embed(TEXTS), atol=1e-5)
    info = await (await client.get("/info")).json()
    assert info["family"] == "gemma3" and info["architecture"] == "gemma3_text"
    assert info["pooling"] == "mean" and info["max_input_length"] == MAX_LEN


# ---- config.json -> Config ----

# EmbeddingGemma-300m's config.json (written by transformers 4.57), its 24 layers every sixth one full.
EMBEDDINGGEMMA_300M = {
    "architectures": ["Gemma3TextModel"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": 1, "final_logit_softcapping": None,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 768, "initializer_range": 0.02,
    "intermediate_size": 1152, "max_position_embeddings": 2048, "model_type": "gemma3_text",
    "num_attention_heads": 3, "num_hidden_layers": 24, "num_key_value_heads": 1, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": 512, "use_bidirectional_attention": True, "use_cache": True,
    "vocab_size": 262144,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(24)],
}


def test_embeddinggemma_config():
    cfg = FAMILIES["gemma3_text"].configure(EMBEDDINGGEMMA_300M)
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.max_positions) == (256, 3, 1, 2048)
    assert cfg.bidirectional and cfg.window == 257  # |query - key| <= 256
    assert cfg.specs[0] == Spec(causal=False, window=257) and cfg.specs[5] == Spec(causal=False)
    assert cfg.ropes[0] == gemma3.Rope(10_000.0) and cfg.ropes[5] == gemma3.Rope(1_000_000.0)
    dims = cfg.dims(2)
    assert (dims.kv_heads, dims.head_dim, dims.gated, dims.layers, dims.mask_kinds) == (1, 256, True, 24, 2)


RAW_CONFIGS = {
    "embeddinggemma": EMBEDDINGGEMMA_300M,
    "odd window, bidirectional": {**EMBEDDINGGEMMA_300M, "sliding_window": 7},
    "causal, defaults": {k: v for k, v in EMBEDDINGGEMMA_300M.items()
                         if k not in ("use_bidirectional_attention", "layer_types", "sliding_window", "rope_theta",
                                      "rope_local_base_freq", "head_dim", "query_pre_attn_scalar")},
    "pattern 2, legacy linear scaling": {**EMBEDDINGGEMMA_300M, "layer_types": None, "sliding_window_pattern": 2,
                                         "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 5e5},
    "rope_parameters": {**EMBEDDINGGEMMA_300M, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 2e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 5e4}}},
}


@pytest.mark.parametrize("case", list(RAW_CONFIGS))
def test_config_matches_transformers_reading(case):
    """Layer kinds, window, head_dim and each kind's RoPE as Gemma3TextConfig derives them from the same dict."""
    import transformers

    raw = RAW_CONFIGS[case]
    hf = transformers.Gemma3TextConfig.from_dict(raw)
    cfg = gemma3.Config.from_dict(raw)
    assert cfg.layer_types == tuple(hf.layer_types) and cfg.window == hf.sliding_window
    assert (cfg.head_dim, cfg.query_pre_attn_scalar) == (hf.head_dim, hf.query_pre_attn_scalar)
    for kind, rope in [("full_attention", cfg.global_rope), ("sliding_attention", cfg.local_rope)]:
        params = hf.rope_parameters[kind]
        want = gemma3.Rope(params["rope_theta"], params["factor"] if params["rope_type"] == "linear" else 1.0)
        assert rope == want, kind


def test_config_refusals():
    refused = [
        ({"model_type": "gemma3"}, "only the text model"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn' for full_attention"),
        ({"rope_scaling": {"type": "linear", "factor": 4.0}}, "no rope_type"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "per layer type"),
        ({"num_key_value_heads": 2}, "multiple of num_key_value_heads"),
        ({"layer_types": ["full_attention"] * 23}, "for each of 24 layers"),
        ({"sliding_window": None}, "sliding_window is null"),
        ({"hidden_activation": "tanh"}, "unsupported hidden_activation"),
        ({"head_dim": 255}, "odd"),
        ({"is_causal": False, "use_bidirectional_attention": False}, "unsupported is_causal=false"),
    ]
    for change, message in refused:
        with pytest.raises(CheckpointError, match=message):
            gemma3.Config.from_dict({**EMBEDDINGGEMMA_300M, **change})


@pytest.mark.parametrize("name", list(ARCHS))
def test_an_llm_reranker_needs_causal_attention(tmp_path, name):
    """A LogitScore save (sentence-transformers' CrossEncoder of a causal LM) scores the last token of a causal
    decoder; on a bidirectional Gemma3 (EmbeddingGemma's attention) that token would see nothing it was trained
    to: refused at load, naming why, where the causal one loads as a one-output reranker."""
    path = write(tmp_path / "ckpt", name, "Gemma3ForCausalLM")
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": "1_LogitScore",
         "type": "sentence_transformers.cross_encoder.modules.logit_score.LogitScore"}]))
    (path / "1_LogitScore").mkdir()
    (path / "1_LogitScore" / "config.json").write_text(json.dumps({"true_token_id": 5, "false_token_id": 6}))
    if ARCHS[name]["use_bidirectional_attention"]:
        with pytest.raises(CheckpointError, match="bidirectional attention is not one"):
            Encoder.from_pretrained(str(path))
    else:
        enc = Encoder.from_pretrained(str(path))
        assert enc.head.kind == "classifier" and enc.head.logit_score.token_ids == (5, 6)
