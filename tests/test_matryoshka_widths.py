"""The Matryoshka widths a checkpoint declares (config.json's `matryoshka_dimensions`, as vLLM reads it): read once,
by `EmbeddingConfig`, and enforced alike by OpenAI's `dimensions` (/v1/embeddings, /v1/plan) and Cohere's
`output_dimension` (/v2/embed): a width the checkpoint does not declare is a 400 naming the ones it does; a
checkpoint that declares none may be cut anywhere."""

import dataclasses
import json

import numpy as np
import orjson
import pytest
import tiny
from conftest import TINY_TABLE, cosine_rows, warm_encoder

from jaxserve.checkpoint.config import EmbeddingConfig, read_model_config
from jaxserve.encoder import normalize_rows

TEXTS = ["the first text", "a second, longer text about the model"]


@pytest.mark.parametrize("declared, want", [
    ([16, 8, 32], (8, 16, 32)),
    ([8, True, "16", 8.0, -4, 0, 16], (8, 16)),  # integers only, each once, sorted
    ("8,16", ()),
    (None, ()),
])
def test_the_checkpoint_config_reads_the_declared_widths(tmp_path, declared, want):
    path = tiny.write_checkpoint(tmp_path / "m", **({} if declared is None else {"matryoshka_dimensions": declared}))
    _, cfg = read_model_config(path)
    assert EmbeddingConfig.from_checkpoint(path, cfg).matryoshka_dimensions == want


@pytest.fixture(scope="module")
def declared(tmp_path_factory):
    path = tiny.write_checkpoint(tmp_path_factory.mktemp("matryoshka") / "m", matryoshka_dimensions=[16, 8])
    assert json.loads((path / "config.json").read_text())["matryoshka_dimensions"] == [16, 8]
    enc = warm_encoder(path, TINY_TABLE)
    assert enc.dim == 32 and enc.embedding_config.matryoshka_dimensions == (8, 16)
    return enc


async def post(client, route, body):
    resp = await client.post(route, json=body)
    return resp.status, orjson.loads(await resp.read())


async def test_openai_dimensions_refuses_an_undeclared_width(make_server, declared):
    client = await make_server(declared)
    for route in ("/v1/embeddings", "/v1/plan"):
        status, out = await post(client, route, {"input": TEXTS, "dimensions": 12})
        assert status == 400, (route, out)
        assert out["error"]["message"] == ("`dimensions` 12 is not one of this model's Matryoshka dimensions "
                                           "(8, 16, 32)")
    full = declared.embed(TEXTS, normalize=True)
    for width in (8, 16, 32):
        status, out = await post(client, "/v1/embeddings", {"input": TEXTS, "dimensions": width})
        assert status == 200, out
        got = np.array([d["embedding"] for d in out["data"]], np.float32)
        assert got.shape == (len(TEXTS), width)
        assert cosine_rows(got, normalize_rows(full[:, :width])).min() > 0.99999
    status, _ = await post(client, "/v1/plan", {"input": TEXTS, "dimensions": 16})
    assert status == 200


async def test_cohere_output_dimension_refuses_an_undeclared_width(make_server, declared):
    client = await make_server(declared)
    status, out = await post(client, "/v2/embed", {"texts": TEXTS, "output_dimension": 12})
    assert status == 400 and set(out) == {"id", "message"}
    assert out["message"] == "`output_dimension` 12 is not one of this model's Matryoshka dimensions (8, 16, 32)"
    status, out = await post(client, "/v2/embed", {"texts": TEXTS, "output_dimension": 8})
    assert status == 200 and np.array(out["embeddings"]["float"]).shape == (len(TEXTS), 8)


async def test_a_checkpoint_that_declares_none_is_cut_anywhere(make_server, declared):
    emb = dataclasses.replace(declared.embedding_config, matryoshka_dimensions=())
    client = await make_server(dataclasses.replace(declared, embedding_config=emb))  # the same executables
    status, out = await post(client, "/v1/embeddings", {"input": TEXTS, "dimensions": 12})
    assert status == 200 and len(out["data"][0]["embedding"]) == 12
    status, out = await post(client, "/v2/embed", {"texts": TEXTS, "output_dimension": 12})
    assert status == 200 and np.array(out["embeddings"]["float"]).shape == (len(TEXTS), 12)
    status, out = await post(client, "/v1/embeddings", {"input": TEXTS, "dimensions": 33})
    assert status == 400 and "from 1 to 32" in out["error"]["message"]
