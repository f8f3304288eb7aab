"""The whole sentence-transformers pipeline from modules.json, against sentence-transformers' own `encode`.

Pooling (every mode, and several concatenated), Dense layers with their
activations, Normalize only where listed, and prompts (`prompt_name`,
`prompt`, `default_prompt_name`), in process and over HTTP.
"""

import json

import hf_tiny
import numpy as np
import pytest
import transformers
from conftest import cosine_rows, warm_encoder

from jaxserve.errors import InputError
from jaxserve.runtime.buckets import fixed

TABLE = fixed([(2, 16), (4, 16), (2, 64), (4, 64)], layout="packed")  # two seqlens, each with a batch ladder
TEXTS = ["the model", "a batch of jax documents is the query and the query is long", "x", "hello, world! 42",
         "the " * 80]  # the last one is over the 64-token limit
PROMPTS = {"query": "query: the ", "document": "a document: "}
DENSE = [{"in": 32, "out": 48, "activation": "torch.nn.modules.activation.Tanh", "seed": 3},
         {"in": 48, "out": 24, "bias": False, "activation": "torch.nn.modules.linear.Identity", "seed": 4}]


def checkpoint(path, **modules):
    cfg = transformers.BertConfig(vocab_size=len(hf_tiny.vocab("bert")), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    hf_tiny.write(path, "BertModel", cfg, "bert", scale=0.3)
    return hf_tiny.sentence_transformers_dir(path, **modules)


def sentence_transformer(path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu")


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """mean pooling -> Dense (tanh) -> Dense (identity, no bias) -> Normalize, with prompts and a default."""
    path = checkpoint(tmp_path_factory.mktemp("st") / "full", pooling="mean", dense=DENSE, prompts=PROMPTS,
                      default_prompt_name="document")
    return path, warm_encoder(path, TABLE), sentence_transformer(path)


@pytest.mark.parametrize("pooling", ["cls", "max", "mean", "mean_sqrt_len", "weightedmean", "lasttoken"])
def test_every_pooling_mode_matches_sentence_transformers(tmp_path, pooling):
    path = checkpoint(tmp_path / pooling, pooling=pooling, normalize=False)
    enc = warm_encoder(path, TABLE)
    want = sentence_transformer(path).encode(TEXTS)
    got = enc.embed(TEXTS)  # no Normalize module: raw pooled vectors, as sentence-transformers
    assert cosine_rows(got, want).min() >= 0.99999
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not enc.embedding_config.normalize


def test_several_modes_are_concatenated_in_sentence_transformers_order(tmp_path):
    path = checkpoint(tmp_path / "multi", pooling="mean")
    flags = {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True, "pooling_mode_max_tokens": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **flags}))
    enc = warm_encoder(path, TABLE)
    assert enc.embedding_config.pooling == "cls+max+mean" and enc.dim == 96
    want = sentence_transformer(path).encode(TEXTS)
    assert cosine_rows(enc.embed(TEXTS), want).min() >= 0.99999


def test_dense_layers_and_normalize_match_sentence_transformers(full):
    path, enc, st = full
    assert enc.dim == 24 and [d.activation for d in enc.embedding_config.dense] == ["tanh", "identity"]
    for name in ("query", "document"):
        got, want = enc.embed(TEXTS, prompt_name=name), st.encode(TEXTS, prompt_name=name)
        assert got.shape == want.shape == (len(TEXTS), 24)
        assert cosine_rows(got, want).min() >= 0.99999
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_default_prompt_and_free_prompts_match_sentence_transformers(full):
    path, enc, st = full
    # no prompt named: the checkpoint's default_prompt_name, as sentence-transformers does
    assert cosine_rows(enc.embed(TEXTS), st.encode(TEXTS)).min() >= 0.99999
    np.testing.assert_allclose(enc.embed(TEXTS), enc.embed(TEXTS, prompt_name="document"), atol=1e-6)
    free = "represent this: "
    assert cosine_rows(enc.embed(TEXTS, prompt=free), st.encode(TEXTS, prompt=free)).min() >= 0.99999
    assert not np.allclose(enc.embed(TEXTS, prompt_name="query"), enc.embed(TEXTS), atol=1e-3)


def test_prompt_tokens_count_toward_the_length_limit(full):
    _, enc, st = full
    long = ["the model " * 40]
    pieces, _ = enc.prepare(long, prompt=PROMPTS["query"])
    assert pieces.lengths.tolist() == [64]  # truncated with the prompt inside the limit
    assert cosine_rows(enc.embed(long, prompt_name="query"), st.encode(long, prompt_name="query")).min() >= 0.99999


def test_unknown_prompt_name_names_the_known_ones(full):
    _, enc, _ = full
    with pytest.raises(InputError, match=r"unknown prompt_name 'passage'.*'query', 'document'"):
        enc.embed(TEXTS, prompt_name="passage")
    with pytest.raises(InputError, match="not both"):
        enc.embed(TEXTS, prompt_name="query", prompt="x")


def test_bfloat16_pipeline(full):
    path, _, st = full
    enc = warm_encoder(path, TABLE, dtype="bfloat16")
    assert cosine_rows(enc.embed(TEXTS, prompt_name="query"), st.encode(TEXTS, prompt_name="query")).min() >= 0.999


async def test_prompts_over_http(make_server, full):
    _, enc, st = full
    client = await make_server(enc)
    want = st.encode(TEXTS, prompt_name="query")
    tei = await client.post("/embed", json={"inputs": TEXTS, "prompt_name": "query"})
    assert tei.status == 200 and cosine_rows(await tei.json(), want).min() >= 0.99999
    openai = await client.post("/v1/embeddings", json={"input": TEXTS, "prompt_name": "query"})
    got = [d["embedding"] for d in (await openai.json())["data"]]
    assert cosine_rows(got, want).min() >= 0.99999 and len(got[0]) == 24
    free = await client.post("/embed", json={"inputs": TEXTS, "prompt": "represent this: "})
    assert cosine_rows(await free.json(), st.encode(TEXTS, prompt="represent this: ")).min() >= 0.99999
    bad = await client.post("/embed", json={"inputs": TEXTS, "prompt_name": "passage"})
    assert bad.status == 422 and "'query', 'document'" in (await bad.json())["error"]  # TEI's shape there
    bad = await client.post("/v1/embeddings", json={"input": TEXTS, "prompt_name": "passage"})
    assert bad.status == 400 and "'query', 'document'" in (await bad.json())["error"]["message"]
    both = await client.post("/v1/embeddings", json={"input": TEXTS, "prompt_name": "query", "prompt": "x"})
    assert both.status == 400
    wrong_type = await client.post("/embed", json={"inputs": TEXTS, "prompt_name": 3})
    assert wrong_type.status == 422
    info = await (await client.get("/info")).json()
    assert info["prompts"] == PROMPTS and info["default_prompt_name"] == "document" and info["dimensions"] == 24
    assert [d["out"] for d in info["dense_layers"]] == [48, 24]


async def test_server_default_prompt_name(make_server, full):
    _, enc, st = full
    client = await make_server(enc, default_prompt_name="query")
    resp = await client.post("/embed", json={"inputs": TEXTS})
    assert cosine_rows(await resp.json(), st.encode(TEXTS, prompt_name="query")).min() >= 0.99999
    assert (await (await client.get("/info")).json())["default_prompt_name"] == "query"


async def test_truncate_dim_is_the_served_width(make_server, tmp_path):
    """A save with `truncate_dim` (config_sentence_transformers.json) serves vectors of that width, as
    sentence-transformers' `encode` cuts them: the same directions, here normalised after the cut (sentence-
    transformers cuts its Normalize module's unit vectors); a request asks for that width or less."""
    path = checkpoint(tmp_path / "cut", pooling="mean", dense=DENSE)
    config = json.loads((path / "config_sentence_transformers.json").read_text())
    (path / "config_sentence_transformers.json").write_text(json.dumps({**config, "truncate_dim": 8}))
    enc = warm_encoder(path, TABLE)
    want = sentence_transformer(path).encode(TEXTS)
    got = enc.embed(TEXTS)
    assert enc.dim == 8 and got.shape == want.shape == (len(TEXTS), 8)
    assert cosine_rows(got, want).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    client = await make_server(enc)
    assert (await (await client.get("/info")).json())["dimensions"] == 8
    raw = await (await client.post("/embed", json={"inputs": TEXTS, "normalize": False})).json()
    np.testing.assert_allclose(raw, enc.embed(TEXTS, normalize=False), rtol=1e-4, atol=1e-6)
    assert cosine_rows(raw, want).min() >= 0.99999
    openai = await client.post("/v1/embeddings", json={"input": TEXTS, "dimensions": 4})
    assert cosine_rows([d["embedding"] for d in (await openai.json())["data"]], want[:, :4]).min() >= 0.99999
    wide = await client.post("/v1/embeddings", json={"input": TEXTS, "dimensions": 16})
    assert wide.status == 400 and "from 1 to 8" in (await wide.json())["error"]["message"]


def test_do_lower_case_lowercases_the_texts(tmp_path):
    """A cased tokenizer under a Transformer module with `do_lower_case` (sentence_bert_config.json): the texts
    lowercased before tokenizing, as sentence-transformers does (tests/test_tokenize.py: every path's ids)."""
    from transformers import PreTrainedTokenizerFast

    path = checkpoint(tmp_path / "lower", pooling="mean", max_seq_length=64)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    tokenizer["normalizer"]["lowercase"] = False
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": True}))
    PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), pad_token="[PAD]").save_pretrained(str(path))
    enc = warm_encoder(path, TABLE)
    texts = ["The Model", "JAX Documents QUERY", "the model"]
    st = sentence_transformer(path)
    assert [s.tolist() for s in enc.tokenizer.encode(texts)] == [st.tokenizer(t)["input_ids"] for t in texts]
    assert cosine_rows(enc.embed(texts), st.encode(texts)).min() >= 0.99999


def test_a_dense_layer_after_normalize_is_refused(tmp_path):
    """Pooling -> Normalize -> Dense: sentence-transformers' output is the Dense of the unit vector, not a unit
    vector; jaxserve normalises last only, so it refuses the order rather than serve other vectors."""
    from jaxserve.checkpoint.config import EmbeddingConfig, read_model_config
    from jaxserve.errors import CheckpointError

    path = checkpoint(tmp_path / "order", pooling="mean", dense=DENSE[:1])
    modules = json.loads((path / "modules.json").read_text())
    (path / "modules.json").write_text(json.dumps([modules[0], modules[1], modules[3], modules[2]]))
    with pytest.raises(CheckpointError, match="Dense module .*'2_Dense'.* after Normalize"):
        EmbeddingConfig.from_checkpoint(path, read_model_config(path)[1])


def test_a_default_prompt_name_the_model_lacks_stops_the_server_at_start(full):
    from jaxserve.http.loading import check_prompt
    from jaxserve.http.server import ServerConfig

    with pytest.raises(InputError, match="unknown prompt_name 'nope'"):
        check_prompt(ServerConfig(default_prompt_name="nope"), full[1])


# The pipelines of the decoder embedders people deploy, on tiny checkpoints of their families.
QWEN3_PROMPTS = {"query": "Instruct: Given a web search query, retrieve relevant passages\nQuery:", "document": ""}
GEMMA_PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}


def decoder_checkpoint(path, family):
    """Qwen3-Embedding's shape (last token, Normalize, instruct prompt) or EmbeddingGemma's (mean, Dense 32->64->32
    without bias, Normalize, task prompts)."""
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    if family == "qwen3":
        cfg = transformers.Qwen3Config(vocab_size=len(hf_tiny.vocab("decoder")), pad_token_id=0, **common)
        hf_tiny.write(path, "Qwen3Model", cfg, "decoder", scale=0.3)
        return hf_tiny.sentence_transformers_dir(path, pooling="lasttoken", max_seq_length=64, prompts=QWEN3_PROMPTS,
                                                 default_prompt_name="document"), "<|endoftext|>"
    cfg = transformers.Gemma3TextConfig(vocab_size=len(hf_tiny.vocab("gemma")), pad_token_id=0, query_pre_attn_scalar=16,
                                        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                        use_bidirectional_attention=True, **common)
    hf_tiny.write(path, "Gemma3TextModel", cfg, "gemma", scale=0.3)
    dense = [{"in": 32, "out": 64, "bias": False, "activation": "torch.nn.modules.linear.Identity", "seed": 5},
             {"in": 64, "out": 32, "bias": False, "activation": "torch.nn.modules.linear.Identity", "seed": 6}]
    return hf_tiny.sentence_transformers_dir(path, pooling="mean", dense=dense, max_seq_length=64,
                                             prompts=GEMMA_PROMPTS), "<pad>"


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_decoder_embedder_pipelines_match_sentence_transformers(tmp_path, family):
    path, pad = decoder_checkpoint(tmp_path / family, family)
    enc = warm_encoder(path, TABLE)
    st = hf_tiny.sentence_transformer_on_tokenizer_json(path, pad, 64)
    for name in ("query", "document"):
        got, want = enc.embed(TEXTS, prompt_name=name), st.encode(TEXTS, prompt_name=name)
        assert got.shape == want.shape and cosine_rows(got, want).min() >= 0.99999, name
    np.testing.assert_allclose(np.linalg.norm(enc.embed(TEXTS), axis=1), 1.0, atol=1e-5)
    bf16 = warm_encoder(path, TABLE, dtype="bfloat16")
    assert cosine_rows(bf16.embed(TEXTS, prompt_name="query"), st.encode(TEXTS, prompt_name="query")).min() >= 0.999



def test_a_plain_causal_lm_gets_last_token_pooling(tmp_path):
    """No modules.json: a `...ForCausalLM` checkpoint is pooled at its last token, as sentence-transformers
    decides, not normalised; with config.json's `is_causal` false, at the mean."""
    cfg = transformers.Qwen3Config(vocab_size=len(hf_tiny.vocab("decoder")), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=True)
    hf_tiny.write(tmp_path, "Qwen3ForCausalLM", cfg, "decoder", scale=0.3)
    assert not (tmp_path / "modules.json").exists()
    enc = warm_encoder(tmp_path, TABLE)
    assert (enc.embedding_config.pooling, enc.embedding_config.normalize) == ("lasttoken", False)
    st = hf_tiny.sentence_transformer_on_tokenizer_json(tmp_path, "<|endoftext|>", 64)
    got, want = enc.embed(TEXTS), st.encode(TEXTS)
    assert cosine_rows(got, want).min() >= 0.99999
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    from jaxserve.checkpoint.config import plain_pooling

    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "is_causal": False}))
    assert plain_pooling(tmp_path) == "mean"


def test_a_str_is_one_text_and_any_iterable_a_batch_as_sentence_transformers(full):
    """`embed("x")` is one text's [dim] vector, as `encode("x")` (before: the str's characters, one vector each,
    [len, dim]); a generator or tuple is a batch, read once (before: a generator was tokenized, then `len` of it
    raised TypeError)."""
    _, enc, st = full
    one, want = enc.embed(TEXTS[1]), st.encode(TEXTS[1])
    assert one.shape == want.shape == (24,)
    np.testing.assert_allclose(one, want, atol=1e-5)
    np.testing.assert_array_equal(one, enc.embed([TEXTS[1]])[0])
    batch = enc.embed(TEXTS)
    np.testing.assert_array_equal(enc.embed(t for t in TEXTS), batch)
    np.testing.assert_array_equal(enc.embed(tuple(TEXTS)), batch)
    tokens, want_tokens = enc.embed_all(TEXTS[1]), st.encode(TEXTS[1], output_value="token_embeddings")
    assert tokens.shape == tuple(want_tokens.shape)
    np.testing.assert_array_equal(tokens, enc.embed_all([TEXTS[1]])[0])


def test_an_input_not_a_str_is_refused_by_its_index_before_any_warm_up(full):
    """Before: `[None]` reached the tokenizer (TypeError: 'NoneType' object is not iterable), after the table's
    warm-up on first use."""
    path, _, _ = full
    from jaxserve import Encoder

    cold = Encoder.from_pretrained(str(path))
    for bad, name in ((lambda: [TEXTS[0], None], "input 1 is NoneType"),
                      (lambda: iter(["a", "b", 3]), "input 2 is int"), (lambda: [b"bytes"], "input 0 is bytes"),
                      (lambda: 5, "a str or an iterable of str, not int")):
        for method in (cold.embed, cold.embed_all):
            with pytest.raises(InputError, match=name):
                method(bad())
    assert not cold.engine.tables  # nothing warmed
