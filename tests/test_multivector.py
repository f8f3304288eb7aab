"""Multi-vector (ColBERT) checkpoints as sentence-transformers' MultiVectorEncoder and PyLate save them, against
MultiVectorEncoder's own `encode_query` / `encode_document` (which loads PyLate saves as PyLate runs them).

Tiny BERT checkpoints are written by transformers, with "[Q]"/"[D]" markers added to the tokenizer, then
saved by sentence-transformers 6 (Transformer with query expansion, token-level Dense without bias,
MultiVectorMask with a punctuation skiplist, token Normalize) or laid out as PyLate saves them
(config_sentence_transformers.json with model_type ColBERT and its top-level knobs, Transformer + Dense).
Parity: the same token count per text, cosine >= 0.9999 per token.
"""

import itertools
import json
import string

import hf_tiny
import numpy as np
import pytest
from conftest import warm_encoder
from hypothesis import given, settings
from hypothesis import strategies as hs

from jaxserve import Encoder
from jaxserve.errors import InputError
from jaxserve.heads import multivector
from jaxserve.runtime.buckets import fixed

QUERY_LENGTH = 16
DOCUMENT_LENGTH = 48
TABLE = fixed([(4, 16), (4, 64)], layout="packed")
QUERIES = ["x", "the model?", "a batch of jax documents, the query " * 3, "hello, world! 42"]  # the third: cut
DOCUMENTS = ["x", "the model, of jax.", "a batch of jax documents is the query " * 6, "hello, world! 42", "!!"]
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512)
DIM = 8


def bert(root, markers: list[str], special: bool, seed: int = 2, family: str = "bert", local: int = 40):
    """A tiny BertModel (or ModernBertModel, local attention `local` // 2 positions each side) and its tokenizer.json with
    `markers` added (special, as MultiVectorEncoder users add them; or plain added tokens, as PyLate's
    add_tokens does)."""
    import transformers
    from tokenizers import AddedToken, Tokenizer

    vocab = hf_tiny.vocab("bert")
    if family == "modernbert":
        config = transformers.ModernBertConfig(
            vocab_size=len(vocab) + len(markers), hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=2, local_attention=local, max_position_embeddings=512, pad_token_id=vocab["[PAD]"],
            bos_token_id=vocab["[CLS]"], cls_token_id=vocab["[CLS]"], eos_token_id=vocab["[SEP]"],
            sep_token_id=vocab["[SEP]"])
        raw = hf_tiny.write(root / "hf", "ModernBertModel", config, kind="bert", seed=seed, scale=0.3)
    else:
        config = transformers.BertConfig(vocab_size=len(vocab) + len(markers), pad_token_id=0, **SMALL)
        raw = hf_tiny.write(root / "hf", "BertModel", config, kind="bert", seed=seed, scale=0.3)
    tok = Tokenizer.from_file(str(raw / "tokenizer.json"))
    added = [AddedToken(m, special=special, normalized=False) for m in markers]
    (tok.add_special_tokens if special else tok.add_tokens)(added)
    tok.save(str(raw / "tokenizer.json"))
    return raw


def processor(raw, family: str = "bert"):
    from transformers import PreTrainedTokenizerFast

    names = {"model_input_names": ["input_ids", "attention_mask"]} if family == "modernbert" else {}
    return PreTrainedTokenizerFast(tokenizer_file=str(raw / "tokenizer.json"), pad_token="[PAD]", mask_token="[MASK]",
                                   unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", **names)


def st_checkpoint(root, attend: bool = False, strategy: str = "fixed", expansion: bool = True,
                  skiplist=tuple(string.punctuation), normalize: bool = True, family: str = "bert", local: int = 40):
    """A tiny ColBERT saved by sentence-transformers 6 as a MultiVectorEncoder."""
    import torch
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Normalize
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    raw = bert(root, ["[Q]", "[D]"], special=True, family=family, local=local)
    query = {"strategy": strategy, "attend": attend, "length": QUERY_LENGTH} if expansion else None
    ceiling = 2 * QUERY_LENGTH if strategy == "min" else None  # "min": a floor; the ceiling is query_length
    t = Transformer(str(raw), query_length=ceiling if expansion else QUERY_LENGTH, document_length=DOCUMENT_LENGTH,
                    query_expansion=None)
    t.processor = processor(raw, family)
    t.query_expansion = query
    torch.manual_seed(3)
    dense = Dense(32, DIM, bias=False, activation_function=torch.nn.Identity(), module_input_name="token_embeddings")
    modules = [t, dense, MultiVectorMask(skiplist_words=list(skiplist))]
    if normalize:
        modules.append(Normalize(module_input_name="token_embeddings"))
    st = MultiVectorEncoder(modules=modules, device="cpu", prompts={"query": "[Q] ", "document": "[D] "})
    st.save(str(root / "st"))
    return root / "st"


def pylate_checkpoint(root, attend: bool = False, skiplist=None, expansion: bool = True):
    """A tiny ColBERT laid out as PyLate saves one: markers "[Q] " / "[D] " as added tokens, its knobs at the top
    of config_sentence_transformers.json (model_type ColBERT), modules Transformer + pylate Dense."""
    import torch
    from safetensors.torch import save_file

    raw = bert(root, ["[Q] ", "[D] "], special=False)
    processor(raw).save_pretrained(str(raw))
    (raw / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}]))
    (raw / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": DOCUMENT_LENGTH - 1,
                                                               "do_lower_case": False}))
    st = {"model_type": "ColBERT", "query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": QUERY_LENGTH,
          "document_length": DOCUMENT_LENGTH, "attend_to_expansion_tokens": attend, "do_query_expansion": expansion,
          "prompts": {}, "default_prompt_name": None, "similarity_fn_name": "MaxSim",
          "__version__": {"pylate": "1.6.0"}}
    if skiplist is not None:
        st["skiplist_words"] = list(skiplist)
    (raw / "config_sentence_transformers.json").write_text(json.dumps(st))
    (raw / "1_Dense").mkdir()
    (raw / "1_Dense" / "config.json").write_text(json.dumps({
        "in_features": 32, "out_features": DIM, "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity", "use_residual": False}))
    gen = torch.Generator().manual_seed(4)
    save_file({"linear.weight": torch.randn(DIM, 32, generator=gen) * 0.3}, str(raw / "1_Dense" / "model.safetensors"))
    return raw


def reference(path, texts, kind):
    from sentence_transformers import MultiVectorEncoder

    st = MultiVectorEncoder(str(path), device="cpu")
    encode = st.encode_query if kind == "query" else st.encode_document
    return [np.asarray(x, np.float32) for x in encode(texts, convert_to_numpy=True)]


def assert_same_tokens(got, want, min_cos=0.9999):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == np.float32 and g.shape == w.shape, (g.shape, w.shape)
        cos = (g * w).sum(-1) / np.maximum(np.linalg.norm(g, axis=-1) * np.linalg.norm(w, axis=-1), 1e-12)
        assert cos.min() >= min_cos, cos.min()
        np.testing.assert_allclose(np.linalg.norm(g, axis=-1), np.linalg.norm(w, axis=-1), rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def st_model(tmp_path_factory):
    path = st_checkpoint(tmp_path_factory.mktemp("mve"))
    return path, warm_encoder(path, TABLE, dtype="float32")


@pytest.mark.parametrize("kind", ["query", "document"])
def test_multivector_encoder_parity(st_model, kind):
    path, enc = st_model
    texts = QUERIES if kind == "query" else DOCUMENTS
    got = enc.embed_multivector(texts, kind=kind)
    want = reference(path, texts, kind)
    assert_same_tokens(got, want)
    if kind == "query":
        assert {len(g) for g in got} == {QUERY_LENGTH}  # expanded (and the long one cut) to the fixed length
    else:
        assert len(got[-1]) == 3 and len(got[1]) < 8  # "!!": [CLS] [D] [SEP]; punctuation dropped


@pytest.mark.parametrize("options", [
    dict(attend=True), dict(strategy="min"), dict(expansion=False), dict(normalize=False, skiplist=()),
    dict(family="modernbert"), dict(family="modernbert", attend=True),
], ids=["attend", "min", "no-expansion", "no-normalize-no-skiplist", "modernbert", "modernbert-attend"])
def test_multivector_encoder_variants(tmp_path, options):
    """Expansion tokens attended to, a floor-only expansion, none, neither normalisation nor skiplist, and
    ModernBERT (sliding-window layers of 20 positions either side: shorter than the 48-token documents)."""
    path = st_checkpoint(tmp_path, **options)
    enc = warm_encoder(path, TABLE, dtype="float32")
    for kind, texts in (("query", QUERIES), ("document", DOCUMENTS)):
        assert_same_tokens(enc.embed_multivector(texts, kind=kind), reference(path, texts, kind))


def test_truncate_dim_cuts_and_normalises_each_token(tmp_path):
    """A save's `truncate_dim`: each token vector cut to it and L2-normalised, as MultiVectorEncoder's encode does
    (here on a model without a Normalize module of its own)."""
    path = st_checkpoint(tmp_path, normalize=False)
    config = json.loads((path / "config_sentence_transformers.json").read_text())
    (path / "config_sentence_transformers.json").write_text(json.dumps({**config, "truncate_dim": 5}))
    enc = warm_encoder(path, TABLE, dtype="float32")
    assert enc.colbert.dim == enc.token_dim == 5 and enc.colbert.normalize
    for kind, texts in (("query", QUERIES), ("document", DOCUMENTS)):
        assert_same_tokens(enc.embed_multivector(texts, kind=kind), reference(path, texts, kind))


def test_expansion_past_a_sliding_window_is_refused(tmp_path):
    """ModernBERT with local attention 4 positions either side and 16 hidden expansion tokens: the last ones
    would see no key at all (transformers and jaxserve differ there), so the checkpoint is refused at load;
    attended to, the same expansion is served (and matches)."""
    from jaxserve.errors import CheckpointError

    path = st_checkpoint(tmp_path / "hidden", family="modernbert", local=8)
    with pytest.raises(CheckpointError, match="sliding window"):
        warm_encoder(path, TABLE, dtype="float32")
    path = st_checkpoint(tmp_path / "attended", family="modernbert", local=8, attend=True)
    enc = warm_encoder(path, TABLE, dtype="float32")
    assert_same_tokens(enc.embed_multivector(QUERIES, kind="query"), reference(path, QUERIES, "query"))


@pytest.mark.parametrize("options", [dict(), dict(attend=True), dict(skiplist=["!"]), dict(expansion=False)],
                         ids=["default", "attend", "skiplist", "no-expansion"])
def test_pylate_checkpoint_parity(tmp_path, options):
    """PyLate's layout: the marker token inserted after [CLS], its lengths, its default punctuation skiplist."""
    path = pylate_checkpoint(tmp_path, **options)
    enc = warm_encoder(path, TABLE, dtype="float32")
    assert enc.head.kind == "multivector" and enc.colbert.prefix_ids[0] is not None
    for kind, texts in (("query", QUERIES), ("document", DOCUMENTS)):
        got = enc.embed_multivector(texts, kind=kind)
        assert_same_tokens(got, reference(path, texts, kind))
        assert all(enc.multivector_pieces([t], kind).seqs[0][1] == enc.colbert.prefix_ids[KIND[kind]] for t in texts)


KIND = {"query": 0, "document": 1}


def run_pieces(enc, pieces):
    from jaxserve.scheduling.jobs import Job
    from jaxserve.scheduling.pipeline import run_jobs
    from jaxserve.scheduling.planner import pack

    job = Job(pack(pieces.lengths, enc.warm_token_table()), pieces.ids, pieces.offsets, None, enc.token_dim, output="tokens")
    run_jobs(enc.engine, enc.warm_token_table(), [job])
    return [job.token_vectors(p) for p in range(pieces.count)]


def test_hidden_expansion_tokens_are_no_keys(st_model):
    """attend=False: the real tokens' vectors are those of the query without its expansion tokens (they are no
    keys); the expansion tokens' own vectors differ from those of plain mask tokens (which are keys)."""
    from jaxserve.checkpoint.tokenize import from_sequences

    _, enc = st_model
    ids = enc.multivector_pieces(["the model"], "query").seqs[0]
    vocab = enc.model_config.vocab_size
    real = int((ids < vocab).sum())
    assert real == 5 and len(ids) == QUERY_LENGTH  # [CLS] [Q] the model [SEP], then expansion
    expanded, bare, attended = run_pieces(enc, from_sequences(
        [ids, ids[:real], np.where(ids >= vocab, ids - vocab, ids)], np.arange(3), np.ones(3)))
    np.testing.assert_allclose(expanded[:real], bare, atol=1e-5)
    assert np.abs(attended[:real] - bare).max() > 1e-3


def test_packed_rows_match_one_per_row(st_model):
    """Several queries and documents packed in one row give each text's own vectors."""
    path, enc = st_model
    one = warm_encoder(path, fixed([(4, 16), (4, 64)], layout="padded"), dtype="float32")
    for kind, texts in (("query", QUERIES), ("document", DOCUMENTS)):
        packed = enc.embed_multivector(texts, kind=kind)
        assert max(len(d.parts) for d in enc.last_dispatches) >= 1
        for a, b in zip(packed, one.embed_multivector(texts, kind=kind)):
            np.testing.assert_allclose(a, b, atol=2e-5)


def test_maxsim_matches_multivector_encoder_similarity(st_model):
    import torch
    from sentence_transformers import MultiVectorEncoder

    path, enc = st_model
    q = enc.embed_multivector(QUERIES[:2], kind="query")
    d = enc.embed_multivector(DOCUMENTS, kind="document")
    st = MultiVectorEncoder(str(path), device="cpu")
    want = st.similarity([torch.from_numpy(x) for x in q], [torch.from_numpy(x) for x in d]).numpy()
    got = np.stack([multivector.maxsim(x, d) for x in q])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_bad_kind_and_long_inputs(st_model):
    _, enc = st_model
    with pytest.raises(InputError, match="kind"):
        enc.embed_multivector(["x"], kind="passage")
    with pytest.raises(InputError, match="length of 48"):
        enc.embed_multivector(["the query " * 40], kind="document", long="error")
    with pytest.raises(InputError, match="truncate or error"):
        enc.embed_multivector(["x"], long="chunk")
    with pytest.raises(InputError, match="multivector model"):
        enc.embed(["x"])


def st_rank(path, query, texts):
    """MultiVectorEncoder's MaxSim of one query against texts, and the order it ranks them in."""
    import torch
    from sentence_transformers import MultiVectorEncoder

    st = MultiVectorEncoder(str(path), device="cpu")
    q = st.encode_query([query])
    d = st.encode_document(texts)
    scores = st.similarity([torch.as_tensor(x) for x in q], [torch.as_tensor(x) for x in d]).numpy()[0]
    return scores, sorted(range(len(texts)), key=lambda i: -scores[i])


async def test_pylate_embeddings_route(make_server, st_model):
    """PyLate's server route on loopback: per input its own token vectors (no padding), queries and documents
    batched together with other requests."""
    import asyncio

    path, enc = st_model
    client = await make_server(enc)
    queries, documents, default = await asyncio.gather(
        client.post("/v1/embeddings", json={"input": QUERIES, "is_query": True, "model": "any"}),
        client.post("/v1/embeddings", json={"input": DOCUMENTS, "is_query": False}),
        client.post("/embeddings", json={"input": QUERIES[1]}))  # is_query defaults to true, as PyLate's server
    assert queries.status == documents.status == default.status == 200
    for resp, texts, kind in ((queries, QUERIES, "query"), (documents, DOCUMENTS, "document")):
        body = await resp.json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(texts)))
        assert body["usage"]["prompt_tokens"] > 0
        got = [np.asarray(d["embedding"], np.float32) for d in body["data"]]
        assert_same_tokens(got, reference(path, texts, kind))
    one = (await default.json())["data"]
    assert_same_tokens([np.asarray(one[0]["embedding"], np.float32)], reference(path, QUERIES[1:2], "query"))


async def test_rerank_by_maxsim(make_server, st_model):
    """TEI's /rerank on a multi-vector model: MaxSim scores and their order, as MultiVectorEncoder's."""
    path, enc = st_model
    client = await make_server(enc)
    query = "the jax model"
    resp = await client.post("/rerank", json={"query": query, "texts": DOCUMENTS, "return_text": True})
    assert resp.status == 200
    got = await resp.json()
    scores, order = st_rank(path, query, DOCUMENTS)
    assert [g["index"] for g in got] == order
    np.testing.assert_allclose([g["score"] for g in got], scores[order], rtol=1e-4)
    assert [g["text"] for g in got] == [DOCUMENTS[i] for i in order]
    root = await client.post("/", json={"query": query, "texts": DOCUMENTS[:2]})
    assert root.status == 200 and len(await root.json()) == 2
    jina = await client.post("/rerank", json={"query": query, "documents": DOCUMENTS})  # served for cross-encoders
    assert jina.status == 422 and "takes TEI's body, `query` and `texts`" in (await jina.json())["error"]


async def test_info_and_openapi_describe_it(make_server, st_model):
    _, enc = st_model
    client = await make_server(enc)
    info = await (await client.get("/info")).json()
    assert info["kind"] == "multivector" and info["dimensions"] == DIM
    assert info["model_type"] == {"embedding": {"pooling": "multivector"}}
    mv = info["multivector"]
    assert mv["query_expansion"] == {"strategy": "fixed", "length": QUERY_LENGTH, "attend": False}
    assert mv["document_length"] == DOCUMENT_LENGTH and mv["query_prefix"] == "[Q] " and mv["skiplist_ids"]
    spec = await (await client.get("/openapi.json")).json()
    assert "is_query" in spec["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"][
        "schema"]["properties"]


async def test_dense_routes_on_a_multivector_model_and_the_reverse(make_server, st_model, tmp_path):
    """Each side refuses the other's routes with a clear 4xx in TEI's (or OpenAI's) shape, and keeps serving."""
    import tiny
    from conftest import TINY_TABLE

    _, enc = st_model
    client = await make_server(enc)
    for route in ("/embed", "/embed_all", "/similarity", "/predict"):
        body = {"inputs": {"source_sentence": "a", "sentences": ["b"]}} if route == "/similarity" else {"inputs": "x"}
        resp = await client.post(route, json=body)
        assert resp.status == 424, route  # TEI's Backend: the wrong deployment, not bad input
        err = await resp.json()
        assert err["error_type"] == "Backend" and "multi-vector (ColBERT)" in err["error"]
    bad = await client.post("/v1/embeddings", json={"input": ["x"], "encoding_format": "base64"})
    assert bad.status == 400 and "float" in (await bad.json())["error"]["message"]
    bad = await client.post("/v1/embeddings", json={"input": ["x"], "is_query": "yes"})
    assert bad.status == 400
    for field in ({"dimensions": 4}, {"prompt": "query: "}, {"truncate_prompt_tokens": 3}):  # refused, not dropped
        bad = await client.post("/v1/embeddings", json={"input": ["x"], **field})
        assert bad.status == 400 and f"`{next(iter(field))}`" in (await bad.json())["error"]["message"]
    bad = await client.post("/v1/embeddings?explain=1", json={"input": ["x"]})
    assert bad.status == 400 and "explain" in (await bad.json())["error"]["message"]
    assert (await client.post("/v1/embeddings", json={"input": ["x"]})).status == 200
    assert (await client.post("/v1/embeddings", json={"input": ["x"], "truncate_prompt_tokens": -1})).status == 200
    dense = warm_encoder(tiny.write_checkpoint(tmp_path / "dense"), TINY_TABLE)
    dense_client = await make_server(dense)
    resp = await dense_client.post("/rerank", json={"query": "a", "texts": ["b"]})
    assert resp.status == 424  # TEI's Backend: the wrong deployment, not bad input
    assert "needs a sequence-classification or cross-encoder model" in (await resp.json())["error"]


def test_warm_artifact_keeps_every_token_bucket(tmp_path, st_model):
    """A multi-vector model warms its per-token output at every bucket of the table (not only each seqlen's
    smallest, as /embed_all), and a second start loads them from the warm artifact, compiling nothing."""
    from jaxserve.runtime import compiles, startup

    path, _ = st_model
    cache = tmp_path / "cache"
    outs = []
    for _ in range(2):
        enc = Encoder.from_pretrained(str(path), dtype="float32")
        before = compiles.xla_compiles_total()
        started = startup.Startup()
        table = startup.start(enc, TABLE, tokens=True, cache=cache, startup=started)
        built = compiles.xla_compiles_total() - before
        assert [(b.shape, b.slots) for b in enc.engine.tables["tokens"].buckets] == \
            [(b.shape, b.slots) for b in table.buckets]
        outs.append((started.source["source"], built, enc.embed_multivector(QUERIES, kind="query")))
    assert outs[0][0] == "file" and outs[0][1] > 0
    assert outs[1][0] == "artifact" and outs[1][1] == 0
    for a, b in zip(outs[0][2], outs[1][2]):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_a_warmup_without_embed_all_makes_the_artifact_the_server_starts_from(tmp_path, st_model):
    """`startup.outputs` decides a model's outputs for every start: `jaxserve warmup --no-embed-all` (and
    `Encoder.start`) readies a multi-vector model's token outputs as `serve --no-embed-all` does, so the server
    starts from that artifact (it compiled again and saved a second one)."""
    from jaxserve.http.loading import start_engine
    from jaxserve.http.state import ServerConfig
    from jaxserve.runtime import compiles, startup

    path, _ = st_model
    cache, buckets = tmp_path / "cache", tmp_path / "table.json"
    TABLE.save(buckets)
    enc = Encoder.from_pretrained(str(path), dtype="float32")
    enc.start(TABLE, cache=cache)  # as `jaxserve warmup --no-embed-all` passes it: tokens=False
    assert "tokens" in enc.engine.tables
    served = Encoder.from_pretrained(str(path), dtype="float32")
    started, before = startup.Startup(), compiles.xla_compiles_total()
    start_engine(ServerConfig(model=str(path), buckets=str(buckets), embed_all=False, cache_dir=str(cache)), served,
                 started)
    assert started.source["source"] == "artifact" and compiles.xla_compiles_total() == before
    assert len(list((cache / "warm").iterdir())) == 1


def test_jaxserve_embed_and_explain_refuse_a_multivector_model(st_model, tmp_path, capsys):
    """Not silently pooled vectors: `jaxserve embed` says it does not write multi-vector embeddings, and `jaxserve
    explain` that it does not run them (it explained and ran a pooled workload the server never runs)."""
    from jaxserve.cli import main

    path, _ = st_model
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(DOCUMENTS) + "\n")
    assert main(["embed", "--input", str(corpus), "--model", str(path), "--output", str(tmp_path / "v.npy")]) == 2
    assert "multi-vector" in capsys.readouterr().err
    assert main(["explain", str(corpus), "--model", str(path)]) == 2
    assert "jaxserve explain does not run multi-vector" in capsys.readouterr().err


@settings(max_examples=50, deadline=None)
@given(hs.lists(hs.integers(-3, 3), min_size=1, max_size=12), hs.booleans())
def test_negative_segments_are_queries_but_no_keys(segs, causal):
    """The attention rule: for ids >= 0 exactly the old one (same id, key not padding); a token of segment -k
    sees the keys of document k, and no query sees it."""
    import jax.numpy as jnp

    from jaxserve.models.attention import Spec, same_document

    seg = np.asarray([segs], np.int32)
    pos = np.arange(len(segs), dtype=np.int32)[None]
    got = np.asarray(same_document(jnp.asarray(seg), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(pos),
                                   Spec(causal=causal)))[0]
    for i, q in enumerate(segs):
        for j, k in enumerate(segs):
            want = k > 0 and abs(q) == k and (not causal or j <= i)
            assert got[i, j] == want, (segs, i, j)


LONG_DOCUMENTS = [f"{i} {DOCUMENTS[2]}" for i in range(8)]  # each cut at the document length


def largest(texts: list[str]) -> list[str]:
    """The client batch limit of inputs, cycling through `texts`."""
    from jaxserve.http.state import MAX_CLIENT_BATCH

    return [texts[i % len(texts)] for i in range(MAX_CLIENT_BATCH)]


async def test_multivector_embeddings_at_their_largest_keep_the_event_loop_free(make_server, st_model, monkeypatch):
    """PyLate's /v1/embeddings at its largest (the client batch limit of documents, each of the document length):
    no step that gathers, masks or encodes the token vectors runs on the event loop (tests/loopwatch.py), and
    the vectors are the Python API's."""
    import loopwatch
    import orjson

    _, enc = st_model
    texts = largest(LONG_DOCUMENTS)
    want = enc.embed_multivector(LONG_DOCUMENTS, kind="document")
    client = await make_server(enc)
    watcher = loopwatch.watch(monkeypatch)
    resp = await client.post("/v1/embeddings", json={"input": texts, "is_query": False})
    assert resp.status == 200
    assert watcher.grown(len(texts)) == []
    data = orjson.loads(await resp.read())["data"]
    assert [d["index"] for d in data] == list(range(len(texts)))
    for d in data[: len(want)] + data[-1:]:
        np.testing.assert_allclose(np.asarray(d["embedding"], np.float32), want[d["index"] % len(want)], atol=2e-5)


async def test_rerank_at_its_largest_keeps_the_event_loop_free(make_server, st_model, monkeypatch):
    """/rerank by MaxSim at its largest (a query and the client batch limit of texts of the document length): no
    step that gathers, scores or encodes runs on the event loop, and the scores and order are MaxSim's over the
    Python API's vectors."""
    import loopwatch
    import orjson

    _, enc = st_model
    query = "the jax model"
    texts = largest(LONG_DOCUMENTS + DOCUMENTS)
    q = enc.embed_multivector([query], kind="query")[0]
    scores = multivector.maxsim(q, enc.embed_multivector(LONG_DOCUMENTS + DOCUMENTS, kind="document"))
    client = await make_server(enc)
    watcher = loopwatch.watch(monkeypatch)
    resp = await client.post("/rerank", json={"query": query, "texts": texts, "return_text": True})
    assert resp.status == 200
    assert watcher.grown(len(texts)) == []
    got = orjson.loads(await resp.read())
    assert sorted(g["index"] for g in got) == list(range(len(texts)))
    assert all(g["text"] == texts[g["index"]] for g in got)
    np.testing.assert_allclose([g["score"] for g in got], [scores[g["index"] % len(scores)] for g in got], rtol=1e-4)
    assert all(a["score"] >= b["score"] for a, b in itertools.pairwise(got))


def test_maxsim_in_blocks_matches_one_product_per_document(monkeypatch):
    """MaxSim over documents back to back, in blocks that cut anywhere (empty documents and documents longer than
    a block included), equals each document's own product."""
    rng = np.random.default_rng(0)
    query = rng.standard_normal((5, DIM)).astype(np.float32)
    docs = [rng.standard_normal((n, DIM)).astype(np.float32) for n in (3, 0, 1, 17, 0, 4, 9, 2, 0)]
    want = np.asarray([(query @ d.T).max(axis=1).sum() if len(d) else 0.0 for d in docs], np.float32)
    for block in (1, 4, 8, 64):
        monkeypatch.setattr(multivector, "MAXSIM_BLOCK", block)
        np.testing.assert_allclose(multivector.maxsim(query, docs), want, rtol=1e-5)
        np.testing.assert_allclose(multivector.maxsim(query, docs, mean=True), want / len(query), rtol=1e-5)
    assert multivector.maxsim(query, []).shape == (0,)


async def test_a_table_shorter_than_the_documents_truncates_them(make_server, st_model):
    """Seqlens below the document length (48): documents are cut to the longest seqlen (32), in the Python API and
    on the server's routes (before: the kinds' tokenizers kept 48, a long document fit no bucket: ValueError, a
    500 on /v1/embeddings and a 424 on /rerank); queries keep their expansion to 16."""
    from jaxserve.runtime.derivation import TableOptions

    path, _ = st_model
    enc = Encoder.from_pretrained(str(path), dtype="float32")
    enc.warmup(TableOptions(seqlens=(16, 32), max_batch=4, batch_ladder=False))
    assert enc.colbert.lengths == (QUERY_LENGTH, 32)
    long = DOCUMENTS[2]  # 48 tokens and more
    (doc,) = enc.embed_multivector([long], kind="document")
    assert len(doc) <= 32 and len(enc.embed_multivector([long], kind="query")[0]) == QUERY_LENGTH
    client = await make_server(enc)
    resp = await client.post("/v1/embeddings", json={"input": [long], "is_query": False})
    assert resp.status == 200
    np.testing.assert_allclose(np.asarray((await resp.json())["data"][0]["embedding"], np.float32), doc, atol=1e-5)
    assert (await client.post("/rerank", json={"query": "jax", "texts": [long, "x"]})).status == 200


def test_a_query_expansion_past_the_table_is_refused_before_compiling(st_model):
    """Queries padded to 16 tokens cannot be cut to a table of seqlen 8: refused when the table is derived."""
    from jaxserve.runtime import compiles
    from jaxserve.runtime.derivation import TableOptions

    path, _ = st_model
    enc = Encoder.from_pretrained(str(path), dtype="float32")
    before = compiles.xla_compiles_total()
    with pytest.raises(ValueError, match="expands every query to 16 tokens"):
        enc.warmup(TableOptions(seqlens=(8,)))
    assert compiles.xla_compiles_total() == before
