"""LLM rerankers: a tiny Qwen3ForCausalLM saved by sentence-transformers 6 as a CrossEncoder with a LogitScore module,
scored as `CrossEncoder.predict` scores it, through `enc.rerank` and the HTTP routes.

Two saves: one whose Transformer module takes chat messages (each pair rendered through a chat template with
`query` and `document` roles), one without a template (the tokenizer's own pair). The tokenizer is the tiny
WordPiece one with "yes" and "no" added. Then the hub's Qwen3-Reranker layout (a plain Qwen3ForCausalLM with a
tied LM head), against its model card's own scoring code.
"""

import functools
import json

import hf_tiny
import numpy as np
import pytest
from conftest import warm_encoder
from safetensors.numpy import load_file

from jaxserve.checkpoint import llm_reranker
from jaxserve.errors import CheckpointError, InputError
from jaxserve.runtime.buckets import fixed

MAX_LEN = 64
TABLE = fixed([(4, 64)], layout="packed")
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n")
QUERY = "the query of jax"
DOCS = ["a document of jax", "the model is a batch", "x", "jax " * 12, "the document is the model of a query",
        "hello, world! 42 " * 20]  # the last one over the model's length: truncated, its template suffix kept


def write_cross_encoder(root, chat: bool):
    """Save a tiny Qwen3 causal LM through sentence-transformers 6's CrossEncoder (Transformer + LogitScore)."""
    import torch
    import transformers
    from sentence_transformers import CrossEncoder
    from transformers import PreTrainedTokenizerFast

    base, out = root / "base", root / "st"
    tok = hf_tiny.make_tokenizer("decoder")
    tok.add_tokens(["yes", "no"])
    cfg = transformers.Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    hf_tiny.write(base, "Qwen3ForCausalLM", cfg, kind="decoder", seed=3, scale=0.3)
    tok.save(str(base / "tokenizer.json"))
    kw = {"chat_template": TEMPLATE} if chat else {}
    PreTrainedTokenizerFast(tokenizer_file=str(base / "tokenizer.json"), pad_token="<|im_end|>",
                            model_max_length=MAX_LEN, **kw).save_pretrained(base)
    model = CrossEncoder(str(base), device="cpu")
    model.save(str(out))
    model.activation_fn = torch.nn.Identity()
    return out, model


@pytest.fixture(scope="module", params=["chat", "plain"])
def reranker(request, tmp_path_factory):
    path, model = write_cross_encoder(tmp_path_factory.mktemp(request.param), request.param == "chat")
    return request.param, path, model, warm_encoder(path, TABLE)


def test_save_is_what_the_reader_expects(reranker):
    kind, path, model, enc = reranker
    modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((path / "modules.json").read_text())]
    assert modules == ["Transformer", "LogitScore"]
    assert enc.head.kind == "classifier" and enc.head.labels == ("score",)
    assert enc.head.logit_score == llm_reranker.LogitScore(model[1].true_token_id, model[1].false_token_id)
    assert (enc.pair_template is not None) == (kind == "chat")


def test_rerank_matches_cross_encoder_predict(reranker):
    """Scores within 1e-3 of `CrossEncoder.predict` (its logits: the Identity activation), and the same order."""
    _, _, model, enc = reranker
    want = model.predict([(QUERY, d) for d in DOCS])
    got = enc.rerank(QUERY, DOCS)
    np.testing.assert_allclose(got, want, atol=1e-3)
    assert list(np.argsort(-got)) == list(np.argsort(-want))
    assert np.ptp(want) > 0.1  # the documents score apart: the order compared is a real one


def test_template_pairs_are_sentence_transformers_ids(reranker):
    """The sequences fed to the model are sentence-transformers' own (left padding removed), long pair included."""
    _, _, model, enc = reranker
    feats = model[0].preprocess([(QUERY, d) for d in DOCS])
    pieces = enc.prepare_pairs([(QUERY, d) for d in DOCS], truncate=True)
    for row, mask, seq in zip(feats["input_ids"].numpy(), feats["attention_mask"].numpy(), pieces.seqs):
        np.testing.assert_array_equal(row[mask.astype(bool)], seq)
    assert max(len(s) for s in pieces.seqs) == MAX_LEN


def test_no_vocabulary_wide_output(reranker):
    """The head is one output on the last token's state: no value of the classify forward has a vocabulary-sized
    axis (the input embedding table is only gathered from)."""
    import jax

    from jaxserve.heads.forwards import classify_forward

    _, _, _, enc = reranker
    vocab = enc.model_config.vocab_size
    assert enc.params["head"]["score"]["kernel"].shape == (32, 1) and enc.out_dim == 1
    forward = functools.partial(classify_forward, enc.module, enc.family.head(enc.model_config, 1), "lasttoken", 4)
    batch = {k: np.zeros((2, 64), np.int32) for k in ("token_ids", "segment_ids", "positions", "type_ids")}
    shapes = [v.aval.shape for v in _values(jax.make_jaxpr(forward)(enc.params, batch).jaxpr)]
    assert shapes and not [s for s in shapes if vocab in s]


def _values(jaxpr):
    """Every value an equation of `jaxpr` (and of the jaxprs inside it) produces."""
    for eqn in jaxpr.eqns:
        yield from eqn.outvars
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _values(inner)


def test_single_texts_and_long_pairs_refused(reranker):
    kind, _, _, enc = reranker
    if kind == "chat":
        with pytest.raises(InputError, match="pairs"):
            enc.classify(["just a text"])
    with pytest.raises(InputError, match="limit"):
        enc.rerank(QUERY, DOCS[-1:], truncate=False)


def test_logit_score_config_refusals(tmp_path):
    with pytest.raises(CheckpointError, match="causal_logits"):
        llm_reranker.LogitScore.from_module({"true_token_id": 1, "module_input_name": "hidden"})
    with pytest.raises(CheckpointError, match="true_token_id"):
        llm_reranker.LogitScore.from_module({"false_token_id": 1})
    assert llm_reranker.LogitScore.from_module({"true_token_id": 5}).token_ids == (5,)


async def test_served_rerank_routes(reranker, make_server):
    """/rerank (TEI: sigmoid, raw_scores: logits), /v1/rerank and /score give predict's scores."""
    _, _, model, enc = reranker
    want = model.predict([(QUERY, d) for d in DOCS])
    client = await make_server(enc)
    resp = await client.post("/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True})
    assert resp.status == 200, await resp.text()
    got = {r["index"]: r["score"] for r in await resp.json()}
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], want, atol=1e-3)
    resp = await client.post("/rerank", json={"query": QUERY, "texts": DOCS})
    ranked = await resp.json()
    np.testing.assert_allclose([r["score"] for r in ranked], np.sort(1 / (1 + np.exp(-want)))[::-1], atol=1e-3)
    assert [r["index"] for r in ranked] == list(np.argsort(-want))
    probs = 1 / (1 + np.exp(-want))
    resp = await client.post("/v1/rerank", json={"model": "m", "query": QUERY, "documents": DOCS, "top_n": 3})
    assert resp.status == 200, await resp.text()
    out = await resp.json()
    assert [r["index"] for r in out["results"]] == list(np.argsort(-want))[:3]
    np.testing.assert_allclose([r["relevance_score"] for r in out["results"]], np.sort(probs)[::-1][:3], atol=1e-3)
    assert out["results"][0]["document"] == {"text": DOCS[out["results"][0]["index"]]}
    assert out["usage"]["total_tokens"] > 0
    # vLLM serves Jina's shape on /rerank too, and Infinity's clients send it there: a body with `documents` and no
    # `texts` is answered as /v1/rerank answers it (TEI's 422 "missing `texts`" before); a TEI body stays TEI's
    jina = await client.post("/rerank", json={"model": "m", "query": QUERY, "documents": DOCS, "top_n": 3})
    assert jina.status == 200 and (await jina.json())["results"] == out["results"]
    bad = await client.post("/rerank", json={"query": QUERY, "documents": DOCS, "top_n": -1})
    assert bad.status == 422 and "top_n" in (await bad.json())["error"]  # TEI's route: TEI's error shape
    for path in ("/score", "/v1/score"):
        resp = await client.post(path, json={"model": "m", "text_1": QUERY, "text_2": DOCS})
        assert resp.status == 200, await resp.text()
        data = (await resp.json())["data"]
        assert [d["index"] for d in data] == list(range(len(DOCS))) and data[0]["object"] == "score"
        np.testing.assert_allclose([d["score"] for d in data], probs, atol=1e-3)
    resp = await client.post("/score", json={"text_1": [QUERY] * 2, "text_2": DOCS[:2]})  # pairwise
    np.testing.assert_allclose([d["score"] for d in (await resp.json())["data"]], probs[:2], atol=1e-3)
    resp = await client.post("/v2/rerank", json={"model": "m", "query": QUERY, "documents": DOCS})  # Cohere's
    assert resp.status == 200, await resp.text()
    got = {r["index"]: r["relevance_score"] for r in (await resp.json())["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], probs, atol=1e-3)


@pytest.mark.parametrize("path, body, message", [
    ("/v1/rerank", {"documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q"}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": False}, "top_n"),  # was read as 0: all
    ("/v1/rerank", {"query": "q", "documents": ["a"], "return_documents": "yes"}, "return_documents"),
    ("/score", {"text_1": "q"}, "text_2"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
    ("/score", {"text_1": "q", "text_2": [1]}, "text_2"),
])
async def test_rerank_routes_refuse_bad_bodies(reranker, make_server, path, body, message):
    client = await make_server(reranker[3])
    resp = await client.post(path, json=body)
    assert resp.status == 400
    assert message in (await resp.json())["error"]["message"]


async def test_a_chat_template_reranker_refuses_vllms_cut_to_n_tokens(reranker, make_server):
    """vLLM cuts a score template's whole rendered prompt at `truncate_prompt_tokens`, the template's end included;
    a chat template here is cut at the model's length only, keeping its end: N is a 400 naming the field, -1
    served. Without a template, pairs are the tokenizer's and cut `longest_first` at N."""
    kind, _, _, enc = reranker
    client = await make_server(enc)
    for path, body in (("/v1/rerank", {"query": "q", "documents": ["a"]}),
                       ("/score", {"text_1": "q", "text_2": ["a"]})):
        assert (await client.post(path, json={**body, "truncate_prompt_tokens": -1})).status == 200
        resp = await client.post(path, json={**body, "truncate_prompt_tokens": 8})
        if kind == "chat":
            assert resp.status == 400 and "`truncate_prompt_tokens` 8" in (await resp.json())["error"]["message"]
        else:
            assert resp.status == 200


async def test_rerank_routes_need_a_cross_encoder(make_server, minilm_warm):
    client = await make_server(minilm_warm)
    for path, body in (("/v1/rerank", {"query": "q", "documents": ["a"]}), ("/score", {"text_1": "a", "text_2": "b"})):
        resp = await client.post(path, json=body)
        assert resp.status == 400 and "cross-encoder" in (await resp.json())["error"]["message"]


# ---- the hub's Qwen3-Reranker layout: a plain Qwen3ForCausalLM, its model card's prompt ----

CARD = llm_reranker.Qwen3RerankerPrompt()


def card_scores(path, pairs, max_length):
    """Qwen3-Reranker's model card code: prefix + truncated "<Instruct>/<Query>/<Document>" body + suffix,
    log-softmax over ("no", "yes") at the last token, P(yes). Qwen's tokenizer adds no special tokens of its own;
    the tiny one's post-processor does, so the body is tokenized without them here."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager").eval()
    prefix = tok.encode(CARD.prefix, add_special_tokens=False)
    suffix = tok.encode(CARD.suffix, add_special_tokens=False)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    bodies = tok([CARD.body(q, d) for q, d in pairs], truncation="longest_first", add_special_tokens=False,
                 max_length=max_length - len(prefix) - len(suffix))["input_ids"]
    out = []
    with torch.no_grad():
        for body in bodies:
            logits = model(input_ids=torch.tensor([prefix + body + suffix])).logits[0, -1]
            out.append(torch.log_softmax(torch.stack([logits[no], logits[yes]]), 0)[1].exp().item())
    return np.array(out)


@pytest.fixture(scope="module")
def hub_reranker(tmp_path_factory):
    import transformers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("hub") / "Qwen3-Reranker-tiny"
    tok = hf_tiny.make_tokenizer("decoder")
    tok.add_tokens(["yes", "no"])
    # the card's fixed texts as single tokens of the tiny vocabulary, so that a pair fits its short length
    tok.add_special_tokens([CARD.prefix, CARD.suffix, f"<Instruct>: {CARD.instruction}", "<Query>:", "<Document>:"])
    cfg = transformers.Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=128, tie_word_embeddings=True)
    hf_tiny.write(path, "Qwen3ForCausalLM", cfg, kind="decoder", seed=5, scale=0.3)
    tok.save(str(path / "tokenizer.json"))
    PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), model_max_length=MAX_LEN).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))  # the tiny tokenizer itself, as save_pretrained rewrote it
    return path, warm_encoder(path, TABLE)


def test_hub_qwen3_reranker_matches_its_model_card(hub_reranker):
    """P(yes) as the card computes it == the sigmoid of jaxserve's log-odds (tied LM head: the embedding rows)."""
    path, enc = hub_reranker
    assert isinstance(enc.pair_template, llm_reranker.Qwen3RerankerPrompt)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")  # tied: the embedding rows score
    want = card_scores(path, [(QUERY, d) for d in DOCS], MAX_LEN)
    got = 1 / (1 + np.exp(-enc.rerank(QUERY, DOCS)))
    np.testing.assert_allclose(got, want, atol=1e-3)
    assert list(np.argsort(-got)) == list(np.argsort(-want)) and np.ptp(want) > 0.05
    assert max(len(s) for s in enc.prepare_pairs([(QUERY, d) for d in DOCS], True).seqs) == MAX_LEN


def test_hub_layout_needs_its_name(hub_reranker, tmp_path):
    """A plain causal LM not named Qwen3-Reranker* stays an embedder (nothing in its files tells them apart)."""
    path, _ = hub_reranker
    assert llm_reranker.is_qwen3_reranker(path, None)
    assert llm_reranker.is_qwen3_reranker(path, "Qwen/Qwen3-Reranker-0.6B")
    assert not llm_reranker.is_qwen3_reranker(path, "Qwen/Qwen3-0.6B")
    assert not llm_reranker.is_qwen3_reranker(tmp_path, "Qwen/Qwen3-Reranker-0.6B")  # no config.json


def test_the_warm_artifacts_key_tells_the_reranker_from_the_embedder_of_the_same_files(hub_reranker, tmp_path,
                                                                                        monkeypatch):
    """The hub's snapshot of Qwen/Qwen3-Reranker-* is a reranker by that name and an embedder by its snapshot
    path (nothing in its files tells them apart): one's executables must never be loaded for the other."""
    import shutil

    from jaxserve import Encoder
    from jaxserve.checkpoint import loader
    from jaxserve.runtime import artifact

    path, _ = hub_reranker
    snap = shutil.copytree(path, tmp_path / "0123abcd")  # a snapshot directory is named by its commit
    monkeypatch.setattr(loader, "_download", lambda repo_id: snap)
    by_name, by_path = Encoder.from_pretrained("Qwen/Qwen3-Reranker-tiny"), Encoder.from_pretrained(str(snap))
    assert by_name.path == by_path.path and by_name.head.kind == "classifier" and by_path.head.kind == "embedding"
    keys = [artifact.key_fields(e, TABLE, ("pooled",)) for e in (by_name, by_path)]
    assert keys[0]["head"] != keys[1]["head"] and artifact.digest(keys[0]) != artifact.digest(keys[1])
