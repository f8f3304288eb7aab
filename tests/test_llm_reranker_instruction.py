"""A rerank request's `instruction` (the name Qwen3-Reranker's model card and the hosted APIs that serve it give the
task), in the `<Instruct>` slot of the card's prompt: through `enc.rerank(..., instruction=)`, `/rerank`,
`/v1/rerank` and `/score`, scored as the card's own code scores `format_instruction(instruction, query, doc)`.
A model whose prompt has no such slot refuses one (it would be dropped silently).

The hub-layout Qwen3-Reranker and its pairs are test_llm_reranker's.
"""

import numpy as np
import pytest
import tiny
from conftest import TINY_TABLE, warm_encoder
from test_llm_reranker import CARD, DOCS, MAX_LEN, QUERY, hub_reranker  # noqa: F401  (a fixture)

from jaxserve.checkpoint import llm_reranker
from jaxserve.errors import InputError

INSTRUCTION = "the model of a batch is the query"  # words of the tiny vocabulary


def format_instruction(instruction, query, doc):
    """The model card's, as written there."""
    if instruction is None:
        instruction = "Given a web search query, retrieve relevant passages that answer the query"
    return "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}".format(  # noqa: UP032  (the card's)
        instruction=instruction, query=query, doc=doc)


def card_scores(path, instruction, pairs):
    """The card's scoring: prefix + body truncated to fit + suffix, log-softmax over ("no", "yes") at the last
    token, P(yes) (test_llm_reranker.card_scores with the body built by `format_instruction`)."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager").eval()
    prefix = tok.encode(CARD.prefix, add_special_tokens=False)
    suffix = tok.encode(CARD.suffix, add_special_tokens=False)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    bodies = tok([format_instruction(instruction, q, d) for q, d in pairs], truncation="longest_first",
                 add_special_tokens=False, max_length=MAX_LEN - len(prefix) - len(suffix))["input_ids"]
    out = []
    with torch.no_grad():
        for body in bodies:
            logits = model(input_ids=torch.tensor([prefix + body + suffix])).logits[0, -1]
            out.append(torch.log_softmax(torch.stack([logits[no], logits[yes]]), 0)[1].exp().item())
    return np.array(out)


def sigmoid(x):
    return 1 / (1 + np.exp(-np.asarray(x, np.float64)))


def test_with_instruction_fills_only_a_slot():
    card = llm_reranker.Qwen3RerankerPrompt()
    assert llm_reranker.with_instruction(card, None) is card
    assert llm_reranker.with_instruction(card, "find recipes").body("q", "d") == format_instruction(
        "find recipes", "q", "d")
    assert card.body("q", "d") == format_instruction(None, "q", "d")  # the loaded prompt is unchanged
    for template in (None, llm_reranker.PairTemplate("{{ messages }}")):
        assert llm_reranker.with_instruction(template, None) is template
        with pytest.raises(InputError, match="no.*instruction slot|has none"):
            llm_reranker.with_instruction(template, "find recipes")
    for bad, message in ((5, "must be a string"), ("  ", "must not be empty"), (["x"], "must be a string")):
        with pytest.raises(InputError, match=message):
            llm_reranker.with_instruction(card, bad)


def test_rerank_instruction_matches_the_model_card(hub_reranker):  # noqa: F811
    path, enc = hub_reranker
    pairs = [(QUERY, d) for d in DOCS]
    want = card_scores(path, INSTRUCTION, pairs)
    got = sigmoid(enc.rerank(QUERY, DOCS, instruction=INSTRUCTION))
    np.testing.assert_allclose(got, want, atol=1e-3)
    default = card_scores(path, None, pairs)
    np.testing.assert_allclose(sigmoid(enc.rerank(QUERY, DOCS)), default, atol=1e-3)
    assert np.abs(want - default).max() > 0.01  # the instruction reaches the model
    assert max(len(s) for s in enc.prepare_pairs(pairs, True, instruction=INSTRUCTION).seqs) == MAX_LEN


async def test_routes_pass_the_instruction(hub_reranker, make_server):  # noqa: F811
    _, enc = hub_reranker
    want = sigmoid(enc.rerank(QUERY, DOCS, instruction=INSTRUCTION))
    assert np.abs(want - sigmoid(enc.rerank(QUERY, DOCS))).max() > 0.01
    client = await make_server(enc)
    resp = await client.post("/rerank", json={"query": QUERY, "texts": DOCS, "instruction": INSTRUCTION})
    assert resp.status == 200, await resp.text()
    got = {r["index"]: r["score"] for r in await resp.json()}
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], want, atol=1e-4)
    resp = await client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "instruction": INSTRUCTION})
    assert resp.status == 200, await resp.text()
    got = {r["index"]: r["relevance_score"] for r in (await resp.json())["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], want, atol=1e-4)
    resp = await client.post("/score", json={"text_1": QUERY, "text_2": DOCS, "instruction": INSTRUCTION})
    assert resp.status == 200, await resp.text()
    np.testing.assert_allclose([d["score"] for d in (await resp.json())["data"]], want, atol=1e-4)
    for bad, status, message in ((7, 400, "must be a string"), ("", 400, "must not be empty"),
                                 ("x" * 10**6, 413, "characters")):
        resp = await client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "instruction": bad})
        assert resp.status == status and message in (await resp.json())["error"]["message"]
    resp = await client.post("/rerank", json={"query": QUERY, "texts": DOCS, "instruction": ""})
    assert resp.status == 422 and "must not be empty" in (await resp.json())["error"]  # TEI's code and shape


async def test_a_model_without_an_instruction_slot_refuses_one(make_server, tmp_path):
    enc = warm_encoder(tiny.write_checkpoint(tmp_path / "cross", num_labels=1), TINY_TABLE)
    assert enc.pair_template is None
    with pytest.raises(InputError, match="instruction"):
        enc.rerank(QUERY, DOCS, instruction=INSTRUCTION)
    client = await make_server(enc)
    for path, body in (("/v1/rerank", {"query": QUERY, "documents": DOCS}), ("/score", {"text_1": QUERY,
                                                                                       "text_2": DOCS})):
        resp = await client.post(path, json={**body, "instruction": INSTRUCTION})
        assert resp.status == 400 and "instruction slot" in (await resp.json())["error"]["message"]
        assert (await client.post(path, json=body)).status == 200
    resp = await client.post("/rerank", json={"query": QUERY, "texts": DOCS, "instruction": INSTRUCTION})
    assert resp.status == 422 and "instruction slot" in (await resp.json())["error"]
