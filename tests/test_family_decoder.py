"""Qwen3, Qwen2 and Mistral decoder embedders: transformers, sentence-transformers and the server as references.

Each family's tiny checkpoint is written by transformers itself (hf_tiny) and
compiled once per module. Qwen3 has head_dim != hidden / heads; Qwen2 slides
on its second layer only; Mistral slides on both, with a window shorter than
the long documents.
"""

import dataclasses

import hf_tiny
import numpy as np
import pytest
from conftest import warm_encoder

from jaxserve import Encoder
from jaxserve.errors import CheckpointError
from jaxserve.models import FAMILIES, decoder
from jaxserve.runtime.buckets import fixed

VOCAB = hf_tiny.vocab("decoder")
PAD = VOCAB["<|im_end|>"]  # a classifier's pad token: never in the texts, so transformers scores the last token
WINDOW = 8
MAX_LEN = 64  # sentence_bert_config's max_seq_length: the tables stop here
COMMON = dict(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD)
# model_type -> (transformers class prefix, config fields beyond COMMON)
ARCHS = {
    "qwen3": ("Qwen3", dict(head_dim=16)),
    "qwen2": ("Qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "mistral": ("Mistral", dict(sliding_window=WINDOW)),
}
TEXTS = ["x", "the model", "a batch of jax documents is the query",
         "the model is a document of the batch " * 3, "hello, world! 42", "jax " * 80]
PACKED = fixed([(2, 32), (2, MAX_LEN)], layout="packed")
ONE_BUCKET = fixed([(4, MAX_LEN)], layout="packed")
FULL_LENGTH = fixed([(2, 128)], layout="packed")  # checkpoints without sentence_bert_config: the model's 128


def hf_config(model_type: str, **overrides):
    import transformers

    prefix, extra = ARCHS[model_type]
    return getattr(transformers, f"{prefix}Config")(**{**COMMON, **extra, **overrides})


def write(path, model_type: str, suffix: str = "Model", **config):
    """A tiny checkpoint of `<Prefix><suffix>` with a tokenizer that appends <|endoftext|>."""
    hf_tiny.write(path, ARCHS[model_type][0] + suffix, hf_config(model_type, **config), kind="decoder", seed=1,
                  scale=0.3)
    return path


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tmp_path_factory):
    """(model_type, checkpoint dir, transformers model, Encoder warmed on a packed table)."""
    model_type = request.param
    path = write(tmp_path_factory.mktemp(model_type) / "ckpt", model_type)
    hf_tiny.sentence_transformers_dir(path, pooling="lasttoken", max_seq_length=MAX_LEN)
    model = hf_tiny.torch_model(path, ARCHS[model_type][0] + "Model")
    return model_type, path, model, warm_encoder(path, PACKED)


LONG_DOCS = ["x", "the model", "a batch of jax documents is the query " * 3,
             "the model is a document " * 6 + "hello, world! 42 " * 4]


def test_hidden_states_match_transformers(arch):
    """Padded rows and one packed row equal transformers' states, documents longer than the window included."""
    model_type, path, model, enc = arch
    docs = hf_tiny.full_ids(path, LONG_DOCS)
    assert len(docs[-1]) > 4 * WINDOW and sum(map(len, docs)) <= 128
    want, worst = hf_tiny.check_hidden(enc.family, enc.model_config, enc.params, model, docs)
    print(f"{model_type}: max abs difference vs transformers {worst:.2e}")
    cfg = enc.model_config
    if any(cfg.windows):  # the window is exercised: without it the long document's states differ
        full = enc.family.encoder(dataclasses.replace(cfg, windows=(None,) * cfg.num_layers))
        assert np.abs(hf_tiny.hidden_states(full, enc.params, docs[-1:], packed=False)[0] - want[-1]).max() > 1e-2


def test_qwen3_with_biases_and_sliding_layers(tmp_path):
    """Qwen3's attention_bias (o_proj too) and layer_types with a sliding layer."""
    path = write(tmp_path / "q", "qwen3", attention_bias=True, use_sliding_window=True, sliding_window=WINDOW,
                 layer_types=["sliding_attention", "full_attention"])
    enc = Encoder.from_pretrained(str(path))
    assert enc.model_config.windows == (WINDOW, None) and enc.model_config.out_bias
    hf_tiny.check_hidden(enc.family, enc.model_config, enc.params, hf_tiny.torch_model(path, "Qwen3Model"),
                 hf_tiny.full_ids(path, LONG_DOCS))


def test_causal_lm_checkpoint_loads_without_its_lm_head(tmp_path):
    """A *ForCausalLM checkpoint: `model.` prefixed names, `lm_head.weight` ignored."""
    path = write(tmp_path / "lm", "qwen3", suffix="ForCausalLM", tie_word_embeddings=False)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "np") as f:
        assert "lm_head.weight" in f.keys() and "model.norm.weight" in f.keys()
    enc = Encoder.from_pretrained(str(path))
    assert enc.head.kind == "embedding"
    hf_tiny.check_hidden(enc.family, enc.model_config, enc.params, hf_tiny.torch_model(path, "Qwen3Model"),
                 hf_tiny.full_ids(path, LONG_DOCS[:3]))


def test_packed_equals_padded(arch):
    _, path, _, enc = arch
    hf_tiny.assert_packed_equals_padded(enc, path, TEXTS, MAX_LEN)


def test_bfloat16_close_to_float32(arch):
    _, path, _, enc = arch
    hf_tiny.assert_bfloat16_close(enc, path, TEXTS, ONE_BUCKET)


def test_matches_sentence_transformers_lasttoken(arch):
    """Last-token pooling as sentence-transformers', with left padding (as Qwen3-Embedding's tokenizer) or right."""
    _, path, _, enc = arch
    assert enc.embedding_config.pooling == "lasttoken"
    hf_tiny.assert_matches_sentence_transformers(enc, path, TEXTS, "<|endoftext|>", MAX_LEN)


@pytest.mark.parametrize("pad", ["<|im_end|>", "<|endoftext|>"])
@pytest.mark.parametrize("model_type", list(ARCHS))
def test_classifier_logits_match_transformers(tmp_path, model_type, pad):
    """*ForSequenceClassification: the `score` Linear on each sequence's rightmost token that is not the pad
    token, packed rows: the last (<|endoftext|>) while the pad token is another, the one before it when the
    config pads with the token the tokenizer appends (fine-tunes of Qwen3 often do)."""
    labels = {0: "neg", 1: "neutral", 2: "pos"}
    suffix = "ForSequenceClassification"
    path = write(tmp_path / model_type, model_type, suffix=suffix, num_labels=3, id2label=labels,
                 pad_token_id=VOCAB[pad])
    enc = warm_encoder(path, FULL_LENGTH)
    assert enc.head.labels == ("neg", "neutral", "pos")
    model = hf_tiny.torch_model(path, ARCHS[model_type][0] + suffix)
    want = np.stack([hf_tiny.logits(model, ids) for ids in enc.tokenizer.encode(TEXTS)])
    np.testing.assert_allclose(enc.classify(TEXTS), want, atol=1e-4)


async def test_served_over_http(arch, make_server):
    model_type, _, _, enc = arch
    client = await make_server(enc)
    resp = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "float"})
    assert resp.status == 200
    got = np.array([d["embedding"] for d in (await resp.json())["data"]])
    np.testing.assert_allclose(got, enc.embed(TEXTS), atol=1e-5)
    info = await (await client.get("/info")).json()
    assert info["family"] == "decoder" and info["architecture"] == model_type
    assert info["pooling"] == "lasttoken" and info["max_input_length"] == MAX_LEN


# ---- config.json -> Config ----

# Qwen3-Embedding-0.6B's config.json (written by transformers 4.51).
QWEN3_EMBEDDING_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151643, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 32768, "max_window_layers": 28,
    "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "float32", "transformers_version": "4.51.3", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151669,
}


def test_qwen3_embedding_config():
    cfg = FAMILIES["qwen3"].configure(QWEN3_EMBEDDING_0_6B)
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.rope_theta) == (128, 16, 8, 1e6)
    assert cfg.windows == (None,) * 28 and cfg.qk_norm and not cfg.qkv_bias and cfg.max_positions == 32768
    dims = cfg.dims(2)
    assert (dims.kv_heads, dims.head_dim, dims.gated, dims.layers, dims.mask_kinds) == (8, 128, True, 28, 1)
    assert FAMILIES["qwen2"] is FAMILIES["mistral"] is FAMILIES["qwen3"]


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_config_matches_transformers_reading(model_type):
    """Windows, head_dim and RoPE base as transformers derives them from the same dict."""
    hf = hf_config(model_type, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    cfg = decoder.Config.from_dict(hf.to_dict())
    windows = hf.layer_types if model_type != "mistral" else ["sliding_attention"] * 2
    assert cfg.windows == tuple(hf.sliding_window if t == "sliding_attention" else None for t in windows)
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or 32 // 4)
    assert cfg.rope_theta == 5e5 and cfg.dims(4).mask_kinds == len(set(cfg.windows))


def test_config_defaults_and_refusals():
    base = {k: v for k, v in QWEN3_EMBEDDING_0_6B.items() if k not in ("head_dim", "sliding_window", "rope_theta")}
    assert decoder.Config.from_dict(base).head_dim == 128  # Qwen3Config's default
    assert decoder.Config.from_dict(base).rope_theta == 10_000.0
    mistral = {**base, "model_type": "mistral", "use_sliding_window": False}
    assert decoder.Config.from_dict(mistral).windows == (4096,) * 28  # MistralConfig's default window
    assert decoder.Config.from_dict({**mistral, "sliding_window": None}).windows == (None,) * 28
    assert decoder.Config.from_dict({**mistral, "head_dim": None}).head_dim == 1024 // 16
    qwen2 = {**base, "model_type": "qwen2", "use_sliding_window": True, "num_hidden_layers": 30}
    assert decoder.Config.from_dict(qwen2).windows == (None,) * 28 + (4096, 4096)  # from max_window_layers 28
    assert decoder.Config.from_dict(qwen2).qkv_bias and not decoder.Config.from_dict(qwen2).out_bias
    refused = [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn'"),
        ({"rope_parameters": {"type": "linear", "factor": 2.0, "rope_theta": 1e6}}, "RoPE type 'linear'"),
        ({"num_key_value_heads": 5}, "multiple of num_key_value_heads"),
        ({"layer_types": ["full_attention"] * 27}, "for each of 28 layers"),
        ({"layer_types": ["sliding_attention"] * 28}, "no sliding window is set"),
        ({"hidden_act": "tanh"}, "unsupported hidden_act"),
        ({"use_sliding_window": True, "sliding_window": 0}, "positive integer"),
        ({"is_causal": False}, "unsupported is_causal=false"),  # transformers' bidirectional decoder
    ]
    for change, message in refused:
        with pytest.raises(CheckpointError, match=message):
            decoder.Config.from_dict({**base, **change})
