"""EuroBERT against transformers' EuroBertModel and sentence-transformers 6.

The tiny checkpoint (2 layers, hidden 32, 2 query heads of 16 sharing 1 key/value head) is written by
transformers itself (Llama's tensor names: q/k/v/o_proj, gate/up/down_proj, input_layernorm, ...) with a
<bos> ... <eos> template as EuroBERT's tokenizer has, and saved by sentence-transformers with mean pooling and
a query prompt. The hub's config.json (remote code: `rope_theta`, `rope_scaling: null`, `clf_pooling`) reads
into the config transformers' gives. The classifier (attention biases on) is checked here for "bos" and
"mean" pooling; "late" in test_eurobert_late.py.
"""

import dataclasses
import json

import hf_tiny
import numpy as np
import pytest
from conftest import TINY_TABLE, cosine_rows, warm_encoder

from jaxserve.errors import CheckpointError
from jaxserve.models import FAMILIES, eurobert
from jaxserve.runtime.buckets import fixed

VOCAB = hf_tiny.vocab("gemma")
MAX_LEN = 64  # the tiny model's max_position_embeddings: TINY_TABLE's longest seqlen
CONFIG = {"vocab_size": len(VOCAB), "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": MAX_LEN,
          "pad_token_id": VOCAB["<pad>"], "bos_token_id": VOCAB["<bos>"], "eos_token_id": VOCAB["<eos>"],
          "mask_token_id": VOCAB["<mask>"], "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}
PROMPTS = {"query": "query: "}
TEXTS = ["x", "the model", "a batch of jax documents is the query " * 2, "hello, world! 42",
         " ".join(f"w{i % 10}" for i in range(40))]  # 80 tokens: truncated at MAX_LEN
# EuroBERT-210m's config.json as the hub ships it (remote code), at the tiny model's sizes.
HUB_CONFIG = {
    "model_type": "eurobert", "architectures": ["EuroBertForMaskedLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": VOCAB["<bos>"], "clf_pooling": "late", "eos_token_id": VOCAB["<eos>"],
    "head_dim": 16, "hidden_act": "silu", "hidden_dropout": 0.0, "hidden_size": 32, "initializer_range": 0.02,
    "intermediate_size": 48, "mask_token_id": VOCAB["<mask>"], "max_position_embeddings": MAX_LEN, "mlp_bias": False,
    "num_attention_heads": 2, "num_hidden_layers": 2, "num_key_value_heads": 1, "pad_token_id": VOCAB["<pad>"],
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500.0,
    "tie_word_embeddings": False, "use_cache": False, "vocab_size": len(VOCAB),
}


def hf_config(**overrides):
    import transformers

    return transformers.EuroBertConfig(**{**CONFIG, **overrides})


def st6_save(raw, out):
    """sentence-transformers 6's save of the transformers checkpoint `raw`: mean pooling, Normalize, a prompt."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.normalize import Normalize
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling
    from transformers import PreTrainedTokenizerFast

    # the tiny WordPiece tokenizer.json is loaded as is (not the family's own tokenizer class)
    (raw / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "pad_token": "<pad>", "model_max_length": MAX_LEN}))
    transformer = Transformer(str(raw))
    transformer.processor = PreTrainedTokenizerFast(tokenizer_file=str(raw / "tokenizer.json"), pad_token="<pad>")
    st = SentenceTransformer(modules=[transformer, Pooling(32, pooling_mode="mean"), Normalize()], device="cpu",
                             prompts=PROMPTS)
    st.max_seq_length = MAX_LEN
    st.save(str(out))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(sentence-transformers dir, Encoder warmed on TINY_TABLE)."""
    root = tmp_path_factory.mktemp("eurobert")
    raw = hf_tiny.write(root / "hf", "EuroBertModel", hf_config(), kind="gemma", seed=3, scale=0.3)
    path = st6_save(raw, root / "st")
    return path, warm_encoder(path, TINY_TABLE)


def test_hidden_states_match_transformers(checkpoint):
    path, enc = checkpoint
    assert (enc.model_config.num_heads, enc.model_config.num_kv_heads) == (2, 1)
    model = hf_tiny.torch_model(path, "EuroBertModel")
    docs = [np.asarray(ids, np.int32) for ids in enc.tokenizer.encode(TEXTS)]
    assert all(d[0] == VOCAB["<bos>"] and d[-1] == VOCAB["<eos>"] for d in docs)
    hf_tiny.check_hidden(enc.family, enc.model_config, enc.params, model, docs)


def test_attention_is_bidirectional(checkpoint):
    """A document's first token changes with its last one (a causal decoder's would not)."""
    _, enc = checkpoint
    a, b = (np.asarray(enc.tokenizer.encode([t])[0], np.int32) for t in ("the model", "the query"))
    ha, hb = hf_tiny.hidden_states(enc.family.encoder(enc.model_config), enc.params, [a, b], packed=True)
    assert np.abs(ha[0] - hb[0]).max() > 1e-3


def test_embeddings_match_sentence_transformers_with_prompt(checkpoint):
    from sentence_transformers import SentenceTransformer

    path, enc = checkpoint
    st = SentenceTransformer(str(path), device="cpu")
    assert dict(enc.embedding_config.prompts)["query"] == PROMPTS["query"] and enc.embedding_config.max_seq_length == MAX_LEN
    assert max(len(ids) for ids in hf_tiny.full_ids(path, TEXTS)) > MAX_LEN  # truncated the same way on both sides
    plain, query = enc.embed(TEXTS), enc.embed(TEXTS, prompt_name="query")
    assert cosine_rows(plain, st.encode(TEXTS)).min() >= 0.99999
    assert cosine_rows(query, st.encode_query(TEXTS)).min() >= 0.99999
    assert cosine_rows(query, plain).max() < 0.9999  # the prompt is there


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
    assert (info["family"], info["pooling"], info["max_input_length"]) == ("eurobert", "mean", MAX_LEN)
    resp = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "float"})
    assert resp.status == 200
    got = np.array([d["embedding"] for d in (await resp.json())["data"]])
    np.testing.assert_allclose(got, enc.embed(TEXTS), atol=1e-5)


def test_hub_layout_reads_as_transformers_layout(checkpoint):
    """The hub's config.json (rope_theta, rope_scaling null, clf_pooling) gives the config transformers' gives."""
    path, enc = checkpoint
    native = json.loads((path / "config.json").read_text())
    assert eurobert.configure(native) == enc.model_config
    assert eurobert.configure(HUB_CONFIG) == enc.model_config
    bos = eurobert.configure({**HUB_CONFIG, "clf_pooling": "bos"})
    assert bos == dataclasses.replace(enc.model_config, classifier_pooling="bos")
    assert FAMILIES["eurobert"].pooling_for_head(bos) == "cls"


@pytest.mark.parametrize("pooling", ["bos", "mean"])
def test_classifier_logits_match_transformers(tmp_path, pooling):
    """EuroBertForSequenceClassification: dense, GELU, classifier on the BOS token or the tokens' mean; with
    attention biases on q, k, v and the output projection."""
    labels = {0: "neg", 1: "pos"}
    path = hf_tiny.write(tmp_path / "clf", "EuroBertForSequenceClassification",
                         hf_config(num_labels=2, id2label=labels, label2id={v: k for k, v in labels.items()},
                                   classifier_pooling=pooling, attention_bias=True),
                         kind="gemma", seed=5, scale=0.3)
    enc = warm_encoder(path, fixed([(4, MAX_LEN)]))
    assert enc.head.labels == ("neg", "pos") and enc.model_config.qkv_bias and enc.model_config.out_bias
    model = hf_tiny.torch_model(path, "EuroBertForSequenceClassification")
    want = np.stack([hf_tiny.logits(model, np.asarray(ids, np.int32)) for ids in enc.tokenizer.encode(TEXTS[:4])])
    np.testing.assert_allclose(enc.classify(TEXTS[:4]), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("edit, message", [
    ({"mlp_bias": True}, "unsupported EuroBERT config mlp_bias=True"),
    ({"clf_pooling": "max"}, "unsupported EuroBERT classifier_pooling 'max'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported RoPE type 'yarn'"),
    ({"num_key_value_heads": 3, "num_attention_heads": 4, "head_dim": 8}, "not a multiple of num_key_value_heads"),
    ({"hidden_act": "mystery"}, "unsupported hidden_act 'mystery'"),
    ({"head_dim": 7}, "head_dim 7 is odd"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
    ({"intermediate_size": None}, "lacks integer field.*intermediate_size"),
])
def test_unsupported_configs_are_clear_errors(edit, message):
    with pytest.raises(CheckpointError, match=message):
        FAMILIES["eurobert"].configure({**HUB_CONFIG, **edit})
