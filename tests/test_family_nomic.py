"""NomicBERT (nomic-embed-text-v1 / v1.5) against transformers' NomicBertModel and sentence-transformers 6.

The tiny checkpoint (2 layers, hidden 32, 2 heads of 16) is written by transformers itself (the hub's tensor
names: Wqkv, fc11/fc12, norm1/norm2, emb_ln) and saved by sentence-transformers with nomic-embed's prompts
("search_query: ", "search_document: "). The same tensors with config.json in the hub's original layout
(n_embd, rotary_emb_base, activation_function swiglu, ...) read into the same config; with the hub's
`rotary_scaling_factor` each document past the trained length gets transformers' dynamic NTK rotation,
packed or alone.
"""

import json
import shutil

import hf_tiny
import numpy as np
import pytest
from conftest import TINY_TABLE, cosine_rows, warm_encoder

from jaxserve import Encoder
from jaxserve.errors import CheckpointError
from jaxserve.models import FAMILIES, nomic_bert

VOCAB = hf_tiny.vocab("bert")
MAX_LEN = 64  # the tiny model's max_position_embeddings: TINY_TABLE's longest seqlen
CONFIG = dict(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
              max_position_embeddings=MAX_LEN, pad_token_id=VOCAB["[PAD]"], bos_token_id=VOCAB["[CLS]"],
              eos_token_id=VOCAB["[SEP]"], rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
PROMPTS = {"query": "search_query: ", "document": "search_document: "}
TEXTS = ["x", "the model", "a batch of jax documents is the query " * 2, "hello, world! 42",
         " ".join(f"w{i % 10}" for i in range(40))]  # 80 tokens: truncated at MAX_LEN
# The config.json nomic-embed-text-v1.5 ships (the hub's layout), at the tiny model's sizes.
HUB_CONFIG = {
    "model_type": "nomic_bert", "architectures": ["NomicBertModel"], "activation_function": "swiglu",
    "vocab_size": len(VOCAB), "n_embd": 32, "n_head": 2, "n_inner": 48, "n_layer": 2, "n_positions": MAX_LEN,
    "max_trained_positions": MAX_LEN, "layer_norm_epsilon": 1e-12, "type_vocab_size": 2, "rotary_emb_base": 1000,
    "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "rotary_scaling_factor": None, "prenorm": False,
    "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "causal": False, "use_rms_norm": False,
    "parallel_block": False, "pad_token_id": VOCAB["[PAD]"],
}


def hf_config(**overrides):
    import transformers

    return transformers.NomicBertConfig(**{**CONFIG, **overrides})


def st6_save(raw, out):
    """sentence-transformers 6's save of the transformers checkpoint `raw`: mean pooling, Normalize, prompts."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.normalize import Normalize
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling
    from transformers import PreTrainedTokenizerFast

    transformer = Transformer(str(raw))
    transformer.processor = PreTrainedTokenizerFast(tokenizer_file=str(raw / "tokenizer.json"), pad_token="[PAD]")
    st = SentenceTransformer(modules=[transformer, Pooling(32, pooling_mode="mean"), Normalize()], device="cpu",
                             prompts=PROMPTS)
    st.max_seq_length = MAX_LEN
    st.save(str(out))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(sentence-transformers dir, Encoder warmed on TINY_TABLE)."""
    root = tmp_path_factory.mktemp("nomic")
    raw = hf_tiny.write(root / "hf", "NomicBertModel", hf_config(), kind="bert", seed=3, scale=0.3)
    path = st6_save(raw, root / "st")
    return path, warm_encoder(path, TINY_TABLE)


def test_hidden_states_match_transformers(checkpoint):
    path, enc = checkpoint
    model = hf_tiny.torch_model(path, "NomicBertModel")
    docs = [np.asarray(ids, np.int32) for ids in enc.tokenizer.encode(TEXTS)]
    hf_tiny.check_hidden(enc.family, enc.model_config, enc.params, model, docs)


def test_embeddings_match_sentence_transformers_with_prompts(checkpoint):
    from sentence_transformers import SentenceTransformer

    path, enc = checkpoint
    st = SentenceTransformer(str(path), device="cpu")
    assert dict(enc.embedding_config.prompts) == PROMPTS and enc.embedding_config.max_seq_length == MAX_LEN
    assert max(len(ids) for ids in hf_tiny.full_ids(path, TEXTS)) > MAX_LEN  # truncated the same way on both sides
    pairs = [(enc.embed(TEXTS), st.encode(TEXTS)),
             (enc.embed(TEXTS, prompt_name="query"), st.encode_query(TEXTS)),
             (enc.embed(TEXTS, prompt_name="document"), st.encode_document(TEXTS))]
    for got, want in pairs:
        assert cosine_rows(got, want).min() >= 0.99999
    assert cosine_rows(pairs[1][0], pairs[0][0]).max() < 0.9999  # the prompt is there


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
    assert (info["family"], info["pooling"], info["max_input_length"]) == ("nomic_bert", "mean", MAX_LEN)
    resp = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "float"})
    assert resp.status == 200
    got = np.array([d["embedding"] for d in (await resp.json())["data"]])
    np.testing.assert_allclose(got, enc.embed(TEXTS), atol=1e-5)


def test_hub_layout_reads_as_transformers_layout(checkpoint, tmp_path):
    """The hub's config.json keys give the config transformers' keys give; the same tensors then load."""
    import jax

    path, enc = checkpoint
    native = json.loads((path / "config.json").read_text())
    assert nomic_bert.Config.from_dict(HUB_CONFIG) == nomic_bert.Config.from_dict(native) == enc.model_config
    hub = shutil.copytree(path, tmp_path / "hub")
    (hub / "config.json").write_text(json.dumps(HUB_CONFIG))
    loaded = Encoder.from_pretrained(str(hub))
    assert loaded.model_config == enc.model_config
    for a, b in zip(*(jax.tree.leaves(e.params) for e in (loaded, enc))):
        np.testing.assert_array_equal(a, b)


def test_dynamic_ntk_scaling_matches_transformers_per_document(tmp_path):
    """The hub's rotary_scaling_factor past max_trained_positions: each document, packed beside others or alone,
    as transformers' dynamic RoPE gives it alone (trained length 16; documents of 4 to 44 tokens)."""
    import transformers

    trained = 16
    path = hf_tiny.write(tmp_path / "ntk", "NomicBertModel", hf_config(max_position_embeddings=128), kind="bert",
                         seed=4, scale=0.3)
    (path / "config.json").write_text(json.dumps({**HUB_CONFIG, "n_positions": 128, "max_trained_positions": trained,
                                                  "rotary_scaling_factor": 2.0}))
    enc = Encoder.from_pretrained(str(path))
    assert (enc.model_config.rope_scaling, enc.model_config.trained_positions) == (2.0, trained)
    docs = [np.asarray(ids, np.int32) for ids in hf_tiny.full_ids(path, [
        "the model", "a batch of jax documents", "hello, world! 42 " * 3, "the query of the model " * 6])]
    assert min(len(d) for d in docs) < trained and max(len(d) for d in docs) > 2 * trained

    reference = hf_config(max_position_embeddings=trained,
                          rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000.0})
    want = []
    for d in docs:  # a fresh model each: transformers' dynamic RoPE keeps the longest length it has seen
        model = transformers.NomicBertModel.from_pretrained(path, config=reference, attn_implementation="eager").eval()
        want.append(hf_tiny.hidden(model, d))
    unscaled = hf_tiny.hidden(transformers.NomicBertModel.from_pretrained(path, config=hf_config(
        max_position_embeddings=128), attn_implementation="eager").eval(), docs[-1])
    assert np.abs(unscaled - want[-1]).max() > 1e-2  # the scaling matters for the long documents
    for packed in (False, True):
        got = hf_tiny.hidden_states(enc.family.encoder(enc.model_config), enc.params, docs, packed)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=f"packed={packed}")


@pytest.mark.parametrize("layout", ["transformers", "hub"])
def test_classifier_logits_match_transformers(tmp_path, layout):
    """NomicBertForSequenceClassification: BERT's pooler (tanh) and classifier on the CLS token. The hub's
    remote-code classifier holds the same tensors under `bert.` (its `self.bert`), with the hub's config."""
    from safetensors.numpy import load_file, save_file

    labels = {0: "neg", 1: "pos"}
    path = hf_tiny.write(tmp_path / "clf", "NomicBertForSequenceClassification",
                         hf_config(num_labels=2, id2label=labels, label2id={v: k for k, v in labels.items()}),
                         kind="bert", seed=5, scale=0.3)
    model = hf_tiny.torch_model(path, "NomicBertForSequenceClassification")
    if layout == "hub":
        tensors = load_file(str(path / "model.safetensors"))
        assert any(k.startswith("nomic_bert.") for k in tensors)
        save_file({k.replace("nomic_bert.", "bert.", 1): v for k, v in tensors.items()}, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps({
            **HUB_CONFIG, "architectures": ["NomicBertForSequenceClassification"], "num_labels": 2,
            "id2label": {str(k): v for k, v in labels.items()}}))
    enc = warm_encoder(path, TINY_TABLE)
    assert enc.head.labels == ("neg", "pos")
    want = np.stack([hf_tiny.logits(model, np.asarray(ids, np.int32)) for ids in enc.tokenizer.encode(TEXTS[:4])])
    np.testing.assert_allclose(enc.classify(TEXTS[:4]), want, atol=1e-4, rtol=1e-4)


def test_transformers_config_fields():
    """transformers' defaults where config.json omits a field; head_dim may differ from hidden / heads."""
    raw = {"model_type": "nomic_bert", **{k: v for k, v in CONFIG.items() if k != "rope_parameters"}, "head_dim": 8}
    cfg = FAMILIES["nomic_bert"].configure(raw)
    assert (cfg.rope_theta, cfg.hidden_act, cfg.head_dim, cfg.rope_scaling) == (1000.0, "silu", 8, None)
    dynamic = FAMILIES["nomic_bert"].configure({**raw, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    assert dynamic == cfg  # transformers' dynamic RoPE is the default one up to max_position_embeddings


@pytest.mark.parametrize("edit, message", [
    (dict(prenorm=True), "unsupported NomicBERT config prenorm=True"),
    (dict(rotary_emb_fraction=0.5), "rotary_emb_fraction=0.5"),
    (dict(qkv_proj_bias=True), "qkv_proj_bias=True"),
    (dict(rotary_emb_interleaved=True), "rotary_emb_interleaved=True"),
    (dict(rotary_emb_scale_base=512), "rotary_emb_scale_base=512"),  # the hub's xPos scaling
    (dict(activation_function="gelu"), "unsupported NomicBERT activation_function 'gelu'"),
    (dict(moe_every_n_layers=2, num_experts=8), "mixture-of-experts NomicBERT"),
    (dict(rotary_scaling_factor=-1), "rotary_scaling_factor must be a positive number"),
    (dict(rotary_emb_base=None), "rotary_emb_base must be a positive number"),
    (dict(n_head=3), "head dim .* is not an even integer"),
    (dict(n_inner=None), "lacks integer field.*n_inner"),
])
def test_unsupported_hub_configs_are_clear_errors(edit, message):
    with pytest.raises(CheckpointError, match=message):
        FAMILIES["nomic_bert"].configure({**HUB_CONFIG, **edit})


def test_unsupported_rope_type_is_a_clear_error():
    raw = {"model_type": "nomic_bert", **CONFIG, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(CheckpointError, match="unsupported RoPE type 'yarn'"):
        FAMILIES["nomic_bert"].configure(raw)
