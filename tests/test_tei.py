"""TEI's routes as TEI's router answers them: POST / by model kind, /similarity, /embed_all, /decode,
mixed texts and pairs on /predict, left truncation, and TEI's error shape and codes (tiny models, loopback)."""

import json
from pathlib import Path

import numpy as np
import pytest
import tiny
from conftest import TINY_TABLE, cosine_rows, warm_encoder

from jaxserve.http.state import STATE

TEXTS = ["the model", "a batch of jax documents is the query", "x", "hello, world! 42"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = tiny.write_checkpoint(tmp_path_factory.mktemp("tei") / "emb")
    return path, warm_encoder(path, TINY_TABLE)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = tiny.write_checkpoint(tmp_path_factory.mktemp("tei") / "cls", num_labels=3)
    return path, warm_encoder(path, TINY_TABLE)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = tiny.write_checkpoint(tmp_path_factory.mktemp("tei") / "rr", num_labels=1)
    return path, warm_encoder(path, TINY_TABLE)


async def test_root_embeds_or_compares_for_an_embedding_model(make_server, embedder):
    _, enc = embedder
    client = await make_server(enc)
    resp = await client.post("/", json={"inputs": TEXTS})
    assert resp.status == 200
    np.testing.assert_allclose(await resp.json(), enc.embed(TEXTS, normalize=True), atol=1e-5)
    same = await client.post("/invocations", json={"inputs": TEXTS[:1]})
    np.testing.assert_allclose(await same.json(), enc.embed(TEXTS[:1], normalize=True), atol=1e-5)
    sim = await client.post("/", json={"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}})
    vectors = enc.embed(TEXTS, normalize=True)
    np.testing.assert_allclose(await sim.json(), vectors[1:] @ vectors[0], atol=1e-5)
    assert (await client.get("/")).status == 200  # TEI's GET / is its health probe


async def test_similarity_route(make_server, embedder):
    _, enc = embedder
    client = await make_server(enc, max_input_chars=40)
    body = {"inputs": {"source_sentence": "the query", "sentences": TEXTS}, "parameters": {"truncate": True}}
    got = await (await client.post("/similarity", json=body)).json()
    want = cosine_rows(enc.embed(TEXTS), np.broadcast_to(enc.embed(["the query"]), (len(TEXTS), enc.dim)))
    np.testing.assert_allclose(got, want, atol=1e-5)
    for inputs, field in (({"source_sentence": "q" * 41, "sentences": ["a"]}, "`inputs.source_sentence` has 41"),
                          ({"source_sentence": "q", "sentences": ["a", "b" * 41]}, "`inputs.sentences[1]` has 41")):
        resp = await client.post("/similarity", json={"inputs": inputs, "parameters": {"truncate": False}})
        assert resp.status == 422 and field in (await resp.json())["error"]  # TEI: 413s are Validation


async def test_embed_all_returns_every_tokens_hidden_state(make_server, embedder):
    path, enc = embedder
    client = await make_server(enc)
    resp = await client.post("/embed_all", json={"inputs": TEXTS})
    assert resp.status == 200
    got = await resp.json()
    cfg = json.loads((path / "config.json").read_text())
    tensors = tiny.random_tensors(cfg)
    for tokens, ids in zip(got, enc.tokenizer.encode(TEXTS)):
        np.testing.assert_allclose(tokens, tiny.reference_hidden(tensors, cfg, ids), atol=2e-5)
    single = await (await client.post("/embed_all", json={"inputs": "the model"})).json()
    assert np.asarray(single).shape == (1, 4, 32)


async def test_decode_and_tokenize_round_trip(make_server, embedder):
    _, enc = embedder
    client = await make_server(enc)
    ids = [[int(t) for t in seq] for seq in enc.tokenizer.encode(TEXTS)]
    got = await (await client.post("/decode", json={"ids": ids})).json()
    tok = enc.tokenizer.tokenizer
    assert got == [tok.decode(i, skip_special_tokens=True) for i in ids] and "the model" in got[0]
    kept = await (await client.post("/decode", json={"ids": ids[0], "skip_special_tokens": False})).json()
    assert kept == [tok.decode(ids[0], skip_special_tokens=False)]
    tokens = await (await client.post("/tokenize", json={"inputs": TEXTS[0]})).json()
    assert [t["id"] for t in tokens[0]] == ids[0]


async def test_vllms_tokenize_and_detokenize_shapes(make_server, embedder):
    """vLLM's /tokenize (`prompt`, no `inputs`: TEI's /tokenize answered 422 missing `inputs`) gives the ids, their
    count, the model's length and (`return_token_strs`) the tokenizer's strings; /detokenize (404 before) their text,
    special tokens kept, as vLLM decodes them. TEI's bodies stay TEI's, its `prompt` extension included."""
    _, enc = embedder
    client = await make_server(enc)
    tok = enc.tokenizer.tokenizer
    want = tok.encode(TEXTS[0])
    got = await (await client.post("/tokenize", json={"model": "m", "prompt": TEXTS[0]})).json()
    assert got == {"count": len(want.ids), "max_model_len": enc.tokenizer.max_length, "tokens": want.ids,
                   "token_strs": None}
    bare = await (await client.post("/tokenize", json={"prompt": TEXTS[0], "add_special_tokens": False,
                                                       "return_token_strs": True})).json()
    assert bare["tokens"] == want.ids[1:-1] and bare["token_strs"] == want.tokens[1:-1]
    tei = await (await client.post("/tokenize", json={"inputs": TEXTS[0], "prompt": "query: "})).json()
    assert [t["id"] for t in tei[0]] == tok.encode("query: " + TEXTS[0]).ids  # TEI's body with its prompt extension
    text = await (await client.post("/detokenize", json={"model": "m", "tokens": want.ids})).json()
    assert text == {"prompt": tok.decode(want.ids, skip_special_tokens=False)} and "[CLS]" in text["prompt"]
    for path, body, status, field in (("/tokenize", {"prompt": 5}, 422, "prompt"),
                                      ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
                                      ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
                                      ("/detokenize", {"tokens": []}, 400, "tokens")):
        resp = await client.post(path, json=body)
        message = json.dumps(await resp.json())
        assert resp.status == status and f"`{field}`" in message, (path, body, message)


async def test_tokenize_answers_byte_offsets_as_tei(make_server, embedder):
    """TEI's /tokenize gives UTF-8 byte offsets (Rust's tokenizers); they were character offsets, the same in ASCII
    only."""
    _, enc = embedder
    client = await make_server(enc)
    for text in ("café x", "caf\U0001F600 x"):
        (tokens,) = await (await client.post("/tokenize", json={"inputs": text})).json()
        raw = text.encode()
        words = [t for t in tokens if not t["special"]]
        assert [raw[t["start"]:t["stop"]].decode() for t in words] == [t["text"] for t in words]
        assert words[-1] == {**words[-1], "text": "x", "start": len(raw) - 1, "stop": len(raw)}


async def test_left_truncation_keeps_the_end(make_server, embedder):
    _, enc = embedder
    client = await make_server(enc)
    long = "x " * 100 + "the model"
    left = await (await client.post("/embed", json={"inputs": [long], "truncation_direction": "Left"})).json()
    right = await (await client.post("/embed", json={"inputs": [long], "truncation_direction": "right"})).json()
    (ids,) = enc.tokenizer.documents([long], direction="left").seqs
    assert ids[-2] == enc.tokenizer.encode(["model"])[0][1]  # the end survives
    assert not np.allclose(left, right, atol=1e-3)


async def test_root_predicts_for_a_classifier_and_mixes_texts_and_pairs(make_server, classifier):
    _, enc = classifier
    client = await make_server(enc)
    mixed = [["ab"], ["a premise", "a hypothesis"], ["the model"]]
    want = enc.classify(["ab", ("a premise", "a hypothesis"), "the model"])
    got = await (await client.post("/", json={"inputs": mixed, "raw_scores": True})).json()
    for preds, logits in zip(got, want):
        assert max(p["score"] for p in preds) == pytest.approx(logits.max(), abs=1e-4)
    # "ab" is one text: not the pair ("a", "b")
    np.testing.assert_allclose(enc.classify(["ab"]), want[:1], atol=1e-6)
    assert not np.allclose(enc.classify([("a", "b")]), want[:1], atol=1e-3)
    # as TEI, a list of exactly two texts is one pair, answered unwrapped
    pair = await (await client.post("/predict", json={"inputs": ["a premise", "a hypothesis"], "raw_scores": True})).json()
    assert max(p["score"] for p in pair) == pytest.approx(want[1].max(), abs=1e-4)
    resp = await client.post("/predict", json={"inputs": [["a premise", "a hypothesis"], ["ab"]]})
    tokens = enc.tokenizer.pairs([("a premise", "a hypothesis"), "ab"]).tokens
    assert_tei_headers(resp, len("a premise") + len("a hypothesis") + 2, tokens)
    # a list that starts with a text is one input, as TEI reads it: three texts, or a text then a pair, are refused
    for flat in (["ab", "a premise", "a hypothesis"], ["ab", ["a premise", "a hypothesis"]]):
        bad = await client.post("/", json={"inputs": flat})
        assert bad.status == 422 and "one input" in (await bad.json())["error"], flat
    # and a list of one text is that text, answered unwrapped (TEI's PredictInput::Single)
    one = await (await client.post("/predict", json={"inputs": ["ab"], "raw_scores": True})).json()
    assert [p["label"] for p in one] == [p["label"] for p in got[0]]
    assert one[0]["score"] == pytest.approx(got[0][0]["score"], abs=1e-4)
    # huggingface_hub's `function_to_apply`: applied (test_clients.py), a value it does not name refused
    bad = await client.post("/predict", json={"inputs": "ab", "parameters": {"function_to_apply": "tanh"}})
    assert bad.status == 422 and "function_to_apply" in (await bad.json())["error"]
    # an empty text, or a pair of two, is TEI's 400 Empty; a pair with one side empty is scored, as TEI's Dual
    for empty in ("", [["ab"], [""]], [["", ""]]):
        bad = await client.post("/predict", json={"inputs": empty})
        assert bad.status == 400 and (await bad.json())["error_type"] == "Empty", empty
    assert (await client.post("/predict", json={"inputs": [["", "a hypothesis"]]})).status == 200
    # a classifier has no prompts: /tokenize refuses one rather than drop it
    bad = await client.post("/tokenize", json={"inputs": ["ab"], "prompt": "query: "})
    assert bad.status == 422 and "prompt" in (await bad.json())["error"]


async def test_root_reranks_for_a_cross_encoder(make_server, reranker):
    _, enc = reranker
    client = await make_server(enc)
    texts = ["the model is a document", "x", "jax"]
    got = await (await client.post("/", json={"query": "the query", "texts": texts, "raw_scores": True})).json()
    want = enc.rerank("the query", texts)
    assert [g["index"] for g in got] == list(np.argsort(-want))
    info = await (await client.get("/info")).json()
    assert info["model_type"] == {"reranker": {"id2label": {"0": "label_a"}, "label2id": {"label_a": 0}}}
    resp = await client.post("/rerank", json={"query": "the query", "texts": texts})
    want = enc.tokenizer.pairs([("the query", t) for t in texts])
    assert_tei_headers(resp, sum(len("the query") + len(t) for t in texts), want.tokens)


def assert_tei_headers(resp, characters: int, tokens: int) -> None:
    """TEI's response metadata (`router/src/lib.rs`): what TEI's clients read for billing and dashboards."""
    h = resp.headers
    assert resp.status == 200 and h["x-compute-type"] == "cpu"
    assert (int(h["x-compute-characters"]), int(h["x-compute-tokens"])) == (characters, tokens)
    times = {k: int(h[f"x-{k}-time"]) for k in ("compute", "total", "tokenization", "queue", "inference")}
    assert all(t >= 0 for t in times.values()) and times["total"] == times["compute"] >= times["inference"], times


async def test_vertex_runs_each_instance_as_the_root_route_and_the_openapi_document_is_where_tei_has_it(
        make_server, embedder):
    """TEI's `POST /vertex` (404 before): `instances`, each run as `POST /` runs it, answered in order under
    `predictions`; an instance refused fails the request in TEI's shape."""
    _, enc = embedder
    client = await make_server(enc)
    sim = {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}}
    resp = await client.post("/vertex", json={"instances": [{"inputs": TEXTS[:2]}, sim, {"inputs": TEXTS[2]}]})
    assert resp.status == 200, await resp.text()
    embedded, similar, one = (await resp.json())["predictions"]
    vectors = enc.embed(TEXTS, normalize=True)
    np.testing.assert_allclose(embedded, vectors[:2], atol=1e-5)
    np.testing.assert_allclose(similar, vectors[1:] @ vectors[0], atol=1e-5)
    np.testing.assert_allclose(one, vectors[2:3], atol=1e-5)
    for body, status, kind in (({"instances": [{"inputs": ["ok"]}, {"inputs": []}]}, 400, "Empty"),
                               ({"instances": []}, 400, "Empty"), ({"instances": 3}, 422, "Validation")):
        bad = await client.post("/vertex", json=body)
        assert bad.status == status and (await bad.json())["error_type"] == kind, body
    # each instance a request of its own to --max-concurrent-requests, as each takes a permit of TEI's
    few = await make_server(enc, max_concurrent=2)
    assert (await few.post("/vertex", json={"instances": [{"inputs": "a"}] * 2})).status == 200
    over = await few.post("/vertex", json={"instances": [{"inputs": "a"}] * 3})
    assert over.status == 429 and (await over.json())["error_type"] == "Overloaded"
    assert few.app[STATE].active == 0
    spec = await client.get("/api-doc/openapi.json")
    assert spec.status == 200 and "/v1/embeddings" in (await spec.json())["paths"]


async def test_tei_routes_send_teis_metadata_headers(make_server, embedder):
    """x-compute-tokens and the rest, as TEI sends them on /embed, /embed_all, /similarity (none came before)."""
    _, enc = embedder
    client = await make_server(enc)
    tokens = enc.tokenizer.documents(TEXTS).tokens
    for route, body in (("/embed", {"inputs": TEXTS}), ("/embed_all", {"inputs": TEXTS})):
        assert_tei_headers(await client.post(route, json=body), sum(map(len, TEXTS)), tokens)
    sim = {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}}
    assert_tei_headers(await client.post("/similarity", json=sim), sum(map(len, TEXTS)), tokens)
    ids = enc.tokenizer.documents(["the model"])
    resp = await client.post("/embed", json={"inputs": [ids.ids.tolist()]})  # token ids count as characters, as TEI
    assert_tei_headers(resp, ids.tokens, ids.tokens)


async def test_info_has_the_fields_tei_clients_read(make_server, embedder):
    _, enc = embedder
    client = await make_server(enc, max_client_batch=64, max_queue_tokens=8192)
    info = await (await client.get("/info")).json()
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    for key in ("model_id", "model_sha", "model_dtype", "max_concurrent_requests", "max_input_length",
                "max_batch_tokens", "max_batch_requests", "max_client_batch_size", "auto_truncate",
                "tokenization_workers", "version"):
        assert key in info, key
    assert info["max_client_batch_size"] == 64 and info["auto_truncate"] and info["max_input_length"] == 64


@pytest.mark.parametrize("route, body, status, kind", [
    ("/embed", {"inputs": []}, 400, "Empty"),
    ("/embed", {"inputs": ["ok"], "truncate": False, "long": "nope"}, 422, "Validation"),
    ("/embed", {"inputs": ["the " * 100], "truncate": False}, 422, "Validation"),
    ("/embed_all", {"inputs": ["x"], "long": "chunk"}, 422, "Validation"),
    ("/embed_all", {"inputs": ["x"], "normalize": False}, 422, "Validation"),  # per-token states: refused,
    ("/embed_all", {"inputs": ["x"], "dimensions": 4}, 422, "Validation"),  # not dropped
    ("/", {"inputs": 5}, 422, "Validation"),
    # TEI's sentences are a Vec<String>: a string is refused, not read as a list without the source
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": "a"}}, 422, "Validation"),
])
async def test_tei_errors_have_teis_shape_and_codes(make_server, embedder, route, body, status, kind):
    _, enc = embedder
    client = await make_server(enc)
    resp = await client.post(route, json=body)
    assert resp.status == status
    err = await resp.json()
    assert set(err) == {"error", "error_type"} and err["error_type"] == kind and isinstance(err["error"], str)
    assert (await client.post("/embed", json={"inputs": "ok"})).status == 200


async def test_openai_token_ids_are_read_as_openais_tokenizer_unless_told_otherwise(make_server, embedder):
    """LangChain's default sends tiktoken ids: read as the model's vocabulary they would embed other text."""
    import tiktoken

    _, enc = embedder
    cl100k = tiktoken.get_encoding("cl100k_base")
    ids = [cl100k.encode(t) for t in TEXTS]
    client = await make_server(enc)
    got = await (await client.post("/v1/embeddings", json={"input": ids, "encoding_format": "float"})).json()
    np.testing.assert_allclose([d["embedding"] for d in got["data"]], enc.embed(TEXTS, normalize=True), atol=1e-5)
    model_ids = await make_server(enc, token_ids="model")
    own = [[int(t) for t in s] for s in enc.tokenizer.encode(TEXTS)]  # the model's own sequences, as vLLM reads them
    got = await (await model_ids.post("/v1/embeddings", json={"input": own, "encoding_format": "float"})).json()
    np.testing.assert_allclose([d["embedding"] for d in got["data"]], enc.embed(TEXTS, normalize=True), atol=1e-5)
    assert got["usage"]["prompt_tokens"] == sum(map(len, own))  # the ids sent, no special token added
    refused = await model_ids.post("/v1/embeddings", json={"input": [[1, 10**5]]})
    assert refused.status == 400 and "outside the vocabulary" in (await refused.json())["error"]["message"]


async def test_token_ids_run_as_given_as_teis_embed_runs_them(make_server, embedder):
    """Ids from /tokenize (with their [CLS] ... [SEP]) embed as their text: they were wrapped in a second [CLS] ...
    [SEP]. Bodies alone run without special tokens, as TEI runs them. A list over the model's limit is cut at the
    `truncation_direction` end (`truncate`), else refused; with a prompt, the ids are read as their text (special
    tokens dropped) and the prompt put in front, as TEI does."""
    _, enc = embedder
    client = await make_server(enc)
    tokens = await (await client.post("/tokenize", json={"inputs": TEXTS})).json()
    ids = [[t["id"] for t in seq] for seq in tokens]
    got = await (await client.post("/embed", json={"inputs": ids})).json()
    np.testing.assert_allclose(got, enc.embed(TEXTS, normalize=True), atol=1e-5)
    (body,) = await (await client.post("/embed", json={"inputs": [ids[1][1:-1]]})).json()
    assert not np.allclose(body, got[1], atol=1e-3)  # no [CLS] or [SEP] added
    limit = enc.tokenizer.max_length
    long = (ids[1] * limit)[: limit + 5]
    for direction, kept in (("Right", long[:limit]), ("Left", long[-limit:])):
        cut = await client.post("/embed", json={"inputs": [long], "truncation_direction": direction})
        want = await (await client.post("/embed", json={"inputs": [kept]})).json()
        np.testing.assert_allclose(await cut.json(), want, atol=1e-5)
    refused = await client.post("/embed", json={"inputs": [long], "truncate": False})
    assert refused.status == 422 and f"limit of {limit}" in (await refused.json())["error"]
    prompted = await (await client.post("/embed", json={"inputs": [ids[0][1:-1]], "prompt": "the query "})).json()
    np.testing.assert_allclose(prompted, enc.embed(TEXTS[:1], prompt="the query "), atol=1e-5)


async def test_a_batch_mixes_texts_and_token_ids_as_teis_input_does(make_server, embedder):
    """TEI's `Input::Batch` holds texts and token-id lists mixed (each a `String` or `Ids`); it was refused. Each
    input is answered in the order sent, as it is alone: a text with its special tokens, ids as given, long inputs
    chunked into windows of their own; TEI's headers count them all."""
    _, enc = embedder
    client = await make_server(enc)
    tokens = await (await client.post("/tokenize", json={"inputs": TEXTS[:2]})).json()
    ids = [[t["id"] for t in seq] for seq in tokens]
    mixed = [ids[0], TEXTS[2], ids[1], TEXTS[3]]
    resp = await client.post("/embed", json={"inputs": mixed})
    assert resp.status == 200, await resp.text()
    np.testing.assert_allclose(await resp.json(), enc.embed([TEXTS[i] for i in (0, 2, 1, 3)], normalize=True),
                               atol=1e-5)
    texts_alone = enc.tokenizer.documents([TEXTS[2], TEXTS[3]])
    assert_tei_headers(resp, len(ids[0]) + len(TEXTS[2]) + len(ids[1]) + len(TEXTS[3]),
                       texts_alone.tokens + len(ids[0]) + len(ids[1]))
    long = "the batch of jax documents " * 40  # past the tiny model's limit: several windows
    chunked = {"inputs": [long, ids[0], long], "long": "chunk"}
    got = await (await client.post("/embed", json=chunked)).json()
    alone = await (await client.post("/embed", json={"inputs": [long], "long": "chunk"})).json()
    np.testing.assert_allclose(got, [alone[0], enc.embed(TEXTS[:1], normalize=True)[0], alone[0]], atol=1e-5)
    both = await client.post("/v1/embeddings", json={"input": [TEXTS[0], [1, 2]], "model": "m"})
    assert both.status == 200 and len((await both.json())["data"]) == 2  # tiktoken's ids, decoded to text
    for bad, where in (([ids[0], 5], "inputs[1]"), (["ok", []], "inputs[1]"), (["", ids[0]], "inputs[0]")):
        resp = await client.post("/embed", json={"inputs": bad})
        assert resp.status in (400, 422) and where in (await resp.json())["error"], bad


async def test_openai_token_ids_never_make_the_server_fetch_an_encoding(make_server, embedder, monkeypatch, tmp_path):
    """A client-chosen `model` selects tiktoken's encoding; one not on the host is a 400, never a fetch on the
    tokenizer thread (was: tiktoken's loader asked for its URL, with no timeout). A model tiktoken does not know
    reads as cl100k_base, as LangChain encodes it."""
    import os
    import shutil

    import tiktoken
    from tiktoken import load, registry

    _, enc = embedder
    cache = Path(os.environ["TIKTOKEN_CACHE_DIR"])
    for f in cache.iterdir():  # cl100k_base only, as conftest left it, and nothing loaded in this process
        shutil.copy(f, tmp_path)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(registry, "ENCODINGS", {})
    asked = []

    def read_file(path):
        asked.append(path)
        if "://" in path:
            raise OSError("no network in this test")
        with open(path, "rb") as f:
            return f.read()

    monkeypatch.setattr(load, "read_file", read_file)
    ids = [tiktoken.get_encoding("cl100k_base").encode(t) for t in TEXTS]
    asked.clear()
    client = await make_server(enc)
    for model in ["gpt-4o", "gpt2", "text-davinci-003", "o1-anything"]:  # o200k_base, gpt2, p50k_base, o200k_base
        resp = await client.post("/v1/embeddings", json={"input": ids, "model": model})
        assert [a for a in asked if "://" in a] == [], model
        message = (await resp.json())["error"]["message"]
        assert resp.status == 400 and "not on this server" in message and "never fetches" in message, message
    for model in [None, "text-embedding-3-small", "some-org/any-model"]:  # cl100k_base: served
        resp = await client.post("/v1/embeddings", json={"input": ids, "model": model, "encoding_format": "float"})
        assert resp.status == 200, await resp.text()
        np.testing.assert_allclose([d["embedding"] for d in (await resp.json())["data"]],
                                   enc.embed(TEXTS, normalize=True), atol=1e-5)
    assert [a for a in asked if "://" in a] == []


async def test_a_text_past_max_input_chars_is_cut_on_every_scoring_route(make_server, reranker, classifier):
    """Where a request truncates, a text past --max-input-chars is cut to it on the scoring routes too (TEI's
    /rerank, vLLM's /v1/rerank, /score and /classify, Cohere's /v2/rerank): they answered 413."""
    long = "the model is a document " * 3  # 72 characters
    client = await make_server(reranker[1], max_input_chars=40)
    for path, body, score in (
            ("/rerank", lambda t: {"query": "the query", "texts": [t]}, lambda out: out[0]["score"]),
            ("/v1/rerank", lambda t: {"query": "the query", "documents": [t]},
             lambda out: out["results"][0]["relevance_score"]),
            ("/score", lambda t: {"text_1": "the query", "text_2": [t]}, lambda out: out["data"][0]["score"]),
            ("/v2/rerank", lambda t: {"query": "the query", "documents": [t]},
             lambda out: out["results"][0]["relevance_score"])):
        got, cut = [await client.post(path, json=body(t)) for t in (long, long[:40])]
        assert got.status == cut.status == 200, (path, await got.text())
        assert score(await got.json()) == pytest.approx(score(await cut.json()), abs=1e-6), path
    refusing = await make_server(reranker[1], max_input_chars=40, long="error")  # (--long error: no truncation)
    refused = await refusing.post("/v1/rerank", json={"query": "q", "documents": [long]})
    assert refused.status == 413 and "has 72 characters; at most 40" in await refused.text()
    client = await make_server(classifier[1], max_input_chars=40)
    got, cut = [await client.post("/classify", json={"input": [t]}) for t in (long, long[:40])]
    assert got.status == 200 and (await got.json())["data"] == (await cut.json())["data"]


async def test_models_lists_the_served_model_as_openai_vllm_and_infinity_do(make_server, embedder):
    """`GET /v1/models` (404 before), which the openai SDK's `models.list()`, LiteLLM and chat front-ends read to
    find the served model; `/v1/models/{name}` takes a name with its organisation's slash; behind the API key."""
    _, enc = embedder
    client = await make_server(enc, model_name="org/tiny-model", api_key="s3cret")
    assert (await client.get("/v1/models")).status == 401
    key = {"Authorization": "Bearer s3cret"}
    listed = await (await client.get("/v1/models", headers=key)).json()
    (card,) = listed["data"]
    assert listed["object"] == "list" and card["id"] == card["root"] == "org/tiny-model"
    assert card["object"] == "model" and card["max_model_len"] == enc.tokenizer.max_length
    assert (await (await client.get("/models", headers=key)).json())["data"][0]["id"] == "org/tiny-model"  # Infinity's
    assert (await (await client.get("/v1/models/org/tiny-model", headers=key)).json())["id"] == "org/tiny-model"
    missing = await client.get("/v1/models/org/other", headers=key)
    assert missing.status == 404 and "does not exist" in (await missing.json())["error"]["message"]
    client.app[STATE].ready = False  # as while warming up: a model listed is one that can be used
    try:
        assert (await client.get("/v1/models", headers=key)).status == 503
    finally:
        client.app[STATE].ready = True
