"""The client libraries users point at jaxserve, each against a real server on loopback, with parity.

Clients: openai (sync and async), huggingface_hub's InferenceClient (TEI's `POST /`),
text-embeddings-inference-client 0.1.0, langchain-openai's OpenAIEmbeddings (token ids by
default), llama-index's TextEmbeddingsInference, cohere's ClientV2 (Cohere's v2 API). Most are synchronous, so each server runs on
its own thread's event loop (aiohttp's AppRunner), sharing the in-process `Encoder` the vectors
and scores are checked against. A middleware records what each client actually sent.

Every client call adds a row (client, version, call, works, parity) to a collector; at the end
of the module the rows are written to results/clients.md, the docs' client table.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import threading
from importlib import metadata
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import tiny
from aiohttp import web
from conftest import MINILM_SMALL_TABLE, TINY_TABLE, cosine_rows, warm_encoder

from jaxserve import Encoder
from jaxserve.checkpoint import loader
from jaxserve.encoder import normalize_rows
from jaxserve.http import api
from jaxserve.http.server import ServerConfig, create_app
from jaxserve.integrations.launch import wait_ready

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

RESULTS = Path(__file__).parents[1] / "results" / "clients.md"
MODEL = "all-MiniLM-L6-v2"
LONG = " ".join(f"sentence {i} of a long document about compilers, batching and vectors." for i in range(60))
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "JAX compiles numerical programs with XLA.",
    "Ünïcödé: naïve café, 東京, emoji 🙂 and math ∑x².",
    "short",
    LONG,  # over MiniLM's 256 tokens: truncated, as the in-process default
]
QUERY = "how are documents batched on the device?"
COSINE = 0.99999


# ---- the client table: one row per client call, written as Markdown at the end of the module ----

@dataclasses.dataclass
class Row:
    client: str
    version: str
    call: str
    works: str = "FAILED"  # set to "yes" (or a documented "no: why") when the call's checks pass
    parity: str = "-"


class ClientTable:
    def __init__(self):
        self.rows: list[Row] = []
        self.ran: set[str] = set()  # the tests this process has run

    @contextlib.contextmanager
    def call(self, package: str, call: str, works: str = "yes"):
        """A row for one client call; it says `works` only if the block's checks all pass."""
        row = Row(package, metadata.version(package), call)
        self.rows.append(row)
        yield row
        row.works = works

    def markdown(self) -> str:
        lines = ["| client | version | call | works | parity |", "|---|---|---|---|---|"]
        lines += [f"| {r.client} | {r.version} | {r.call} | {r.works} | {r.parity} |" for r in self.rows]
        return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def client_table():
    return ClientTable()


@pytest.fixture(autouse=True)
def count_run(request, client_table):
    yield
    client_table.ran.add(request.node.originalname)


@pytest.fixture(scope="module", autouse=True)
def write_client_table(request, client_table):
    yield
    if client_table.ran != {name for name in vars(request.module) if name.startswith("test_")}:
        return  # a partial run (-k, a node id, the module split over xdist's workers): the last full table stays
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        "<!-- written by tests/test_clients.py: do not edit by hand -->\n"
        "Each client against a jaxserve on loopback (all-MiniLM-L6-v2, float32, CPU; tiny random checkpoints for "
        "the classifier and the cross-encoder). Parity: against the in-process `Encoder` on the same texts "
        "(min cosine and max absolute difference over the vectors returned, or the max absolute difference of "
        "the scores). Server and reference run the same compiled model, so the figure is what HTTP and the client "
        "add: base64 or JSON floats, the client's own parsing, token ids decoded.\n\n"
        + client_table.markdown())


def cosine_parity(got, want) -> str:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    worst = float(cosine_rows(got, want).min())
    assert worst >= COSINE, worst
    diff = float(np.abs(got - want).max())
    return f"min cosine 1 - {max(1 - worst, 0.0):.0e}, max abs diff {diff:.0e} ({_count(len(got), 'vector')})"


def score_parity(got, want, atol=1e-5) -> str:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    worst = float(np.abs(got - want).max())
    assert worst <= atol, worst
    return f"max abs diff {worst:.0e} ({_count(got.size, 'score')})"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


# ---- servers on their own threads, sharing the in-process encoders ----

class ThreadServer:
    """A jaxserve app on 127.0.0.1 (a free port) served by its own thread's event loop; `seen` keeps
    (method, path, JSON body) of every request, to check what a client sends."""

    def __init__(self, encoder: Encoder, **config):
        self.seen: list[tuple[str, str, object]] = []
        self.runner: web.AppRunner | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-clients-server", daemon=True)
        self.thread.start()
        try:
            self.url = asyncio.run_coroutine_threadsafe(self._start(encoder, config), self.loop).result(180)
        except BaseException:
            self.close()
            raise

    async def _start(self, encoder, config) -> str:
        app = create_app(ServerConfig(use_cache=False, embed_all=False, **config), encoder)

        @web.middleware
        async def record(request, handler):
            raw = await request.read()  # cached: the handler reads it again
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw
            self.seen.append((request.method, request.path, body))
            return await handler(request)

        app.middlewares.append(record)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, url, timeout_s=120)
        return url

    def last(self, method: str = "POST") -> tuple[str, object]:
        """(path, body) of the latest request with `method`."""
        return next((path, body) for m, path, body in reversed(self.seen) if m == method)

    def close(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture(scope="module")
def minilm_prompts(tmp_path_factory):
    """The bundled all-MiniLM-L6-v2 with one prompt added ({"query": "query: "}): its files linked, not copied."""
    src = loader.bundled_default()
    path = tmp_path_factory.mktemp("clients") / "minilm"
    path.mkdir()
    for item in src.iterdir():
        if item.name != "config_sentence_transformers.json":
            (path / item.name).symlink_to(item)
    (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": "query: "}}))
    return warm_encoder(path, MINILM_SMALL_TABLE)


@pytest.fixture(scope="module")
def embedder(minilm_prompts):
    server = ThreadServer(minilm_prompts, model_name=MODEL, max_client_batch=32)
    yield server, minilm_prompts
    server.close()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    enc = Encoder.from_pretrained(str(tiny.write_checkpoint(tmp_path_factory.mktemp("clients") / "cls", num_labels=3)),
                                  buckets=TINY_TABLE)
    server = ThreadServer(enc, model_name="tiny-classifier")
    yield server, enc
    server.close()


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    enc = Encoder.from_pretrained(str(tiny.write_checkpoint(tmp_path_factory.mktemp("clients") / "rr", num_labels=1)),
                                  buckets=TINY_TABLE)
    server = ThreadServer(enc, model_name="tiny-cross-encoder")
    yield server, enc
    server.close()


def embed(enc: Encoder, texts, **kw) -> np.ndarray:
    return enc.embed(list(texts), normalize=True, **kw)


# ---- 1. openai ----

def test_openai_sync(embedder, client_table):
    import openai

    server, enc = embedder
    want = embed(enc, TEXTS)
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    with client_table.call("openai", "`OpenAI().embeddings.create` (default: base64)") as row:
        resp = oai.embeddings.create(model=MODEL, input=TEXTS)
        assert server.last() == ("/v1/embeddings", {"model": MODEL, "input": TEXTS, "encoding_format": "base64"})
        assert [d.index for d in resp.data] == list(range(len(TEXTS)))
        assert resp.model == MODEL and resp.usage.prompt_tokens > 256
        row.parity = cosine_parity([d.embedding for d in resp.data], want)
    with client_table.call("openai", "`embeddings.create(encoding_format=\"float\")`") as row:
        resp = oai.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
        row.parity = cosine_parity([d.embedding for d in resp.data], want)
    with client_table.call("openai", "`embeddings.create(dimensions=128)`") as row:
        resp = oai.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=128)
        v = np.array(resp.data[0].embedding)
        assert v.shape == (128,) and np.linalg.norm(v) == pytest.approx(1.0, abs=1e-5)
        row.parity = cosine_parity(v[None], normalize_rows(want[:1, :128]))
    with client_table.call("openai", "`embeddings.create(encoding_format=\"ubinary\")` (outside its type hints)") as row:
        resp = oai.embeddings.create(model=MODEL, input=TEXTS, encoding_format="ubinary")
        np.testing.assert_array_equal([d.embedding for d in resp.data], api.quantize(want, "ubinary"))
        row.parity = "exact (packed sign bits, as integers)"
    with client_table.call("openai", "error: 33 inputs, over `--max-client-batch 32`") as row:
        with pytest.raises(openai.APIStatusError) as err:
            oai.embeddings.create(model=MODEL, input=["x"] * 33)
        assert err.value.status_code == 413 and "at most 32" in err.value.message
        row.parity = "413, the server's message"
    with client_table.call("openai", "`models.list()`, `models.retrieve(name)`") as row:
        (card,) = oai.models.list().data
        assert (card.id, card.object, card.to_dict()["max_model_len"]) == (MODEL, "model", enc.tokenizer.max_length)
        assert oai.models.retrieve(MODEL).id == MODEL
        with pytest.raises(openai.NotFoundError):
            oai.models.retrieve("another/model")
        row.parity = "the served model (404 for another)"


async def test_openai_async(embedder, client_table):
    import openai

    server, enc = embedder
    want = embed(enc, TEXTS)
    oai = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused")
    with client_table.call("openai", "`AsyncOpenAI().embeddings.create` (base64), 3 concurrent") as row:
        resps = await asyncio.gather(*(oai.embeddings.create(model=MODEL, input=TEXTS[i:]) for i in range(3)))
        got = [d.embedding for r in resps for d in r.data]
        row.parity = cosine_parity(got, np.concatenate([want[i:] for i in range(3)]))
    with client_table.call("openai", "`AsyncOpenAI` `dimensions=64, encoding_format=\"float\"`") as row:
        resp = await oai.embeddings.create(model=MODEL, input=TEXTS, dimensions=64, encoding_format="float")
        got = np.array([d.embedding for d in resp.data])
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        row.parity = cosine_parity(got, normalize_rows(want[:, :64]))
    await oai.close()


# ---- 2. huggingface_hub InferenceClient: TEI's POST / ----

@pytest.fixture
def hf_online(monkeypatch):
    """huggingface_hub's offline mode (HF_HUB_OFFLINE=1, set by conftest) blocks every request of its session,
    a loopback server's included; these tests reach only 127.0.0.1."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def test_huggingface_hub_feature_extraction(hf_online, embedder, client_table):
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError

    server, enc = embedder
    hf = InferenceClient(model=server.url)
    with client_table.call("huggingface_hub", "`InferenceClient.feature_extraction(texts)`") as row:
        got = hf.feature_extraction(TEXTS)
        assert server.last() == ("/", {"inputs": TEXTS})  # the parameters go at the body's top level
        assert got.dtype == np.float32 and got.shape == (len(TEXTS), enc.dim)
        row.parity = cosine_parity(got, embed(enc, TEXTS))
    with client_table.call("huggingface_hub", "`feature_extraction(text, normalize=False)`") as row:
        got = hf.feature_extraction(TEXTS[1], normalize=False)
        assert server.last()[1] == {"inputs": TEXTS[1], "normalize": False} and got.shape == (1, enc.dim)
        raw = enc.embed(TEXTS[1:2], normalize=False)
        assert abs(np.linalg.norm(got) - 1) > 0.1
        np.testing.assert_allclose(got, raw, rtol=1e-4, atol=1e-5)
        row.parity = cosine_parity(got, raw) + ", not normalised"
    with client_table.call("huggingface_hub", "`feature_extraction(prompt_name=\"query\")`") as row:
        got = hf.feature_extraction(TEXTS[:2], prompt_name="query")
        want = embed(enc, TEXTS[:2], prompt_name="query")
        np.testing.assert_allclose(want, embed(enc, ["query: " + t for t in TEXTS[:2]]), atol=1e-6)
        row.parity = cosine_parity(got, want)
    left = "`feature_extraction(truncate=True, truncation_direction=\"left\")`"
    with client_table.call("huggingface_hub", left) as row:
        got = hf.feature_extraction(LONG, truncate=True, truncation_direction="left")
        pieces = enc.tokenizer.documents([LONG], "truncate", direction="left")
        want = normalize_rows(pieces.combine(enc.run(pieces), 1))
        assert cosine_rows(got, embed(enc, [LONG]))[0] < 0.99  # the other end of the document
        row.parity = cosine_parity(got, want)
    with client_table.call("huggingface_hub", "`feature_extraction(dimensions=96)`") as row:
        got = hf.feature_extraction(TEXTS, dimensions=96)
        row.parity = cosine_parity(got, normalize_rows(embed(enc, TEXTS)[:, :96]))
    with client_table.call("huggingface_hub", "error: `feature_extraction(long, truncate=False)`") as row:
        with pytest.raises(HfHubHTTPError) as err:
            hf.feature_extraction(LONG, truncate=False)
        assert err.value.response.status_code == 422
        assert err.value.response.json()["error_type"] == "Validation" and "tokens" in str(err.value)
        row.parity = "422 `Validation`, the server's message in the exception"


def test_huggingface_hub_sentence_similarity(hf_online, embedder, client_table):
    from huggingface_hub import InferenceClient

    server, enc = embedder
    hf = InferenceClient(model=server.url)
    with client_table.call("huggingface_hub", "`InferenceClient.sentence_similarity(query, texts)`") as row:
        got = hf.sentence_similarity(QUERY, other_sentences=TEXTS)
        assert server.last() == ("/", {"inputs": {"source_sentence": QUERY, "sentences": TEXTS}, "parameters": {}})
        vectors = embed(enc, [QUERY] + TEXTS)
        row.parity = score_parity(got, vectors[1:] @ vectors[0])


def test_huggingface_hub_text_classification(hf_online, classifier, client_table):
    from huggingface_hub import InferenceClient

    server, enc = classifier
    hf = InferenceClient(model=server.url)
    text = "the model is a document"
    probs = api.scores(enc.classify([text]), raw=False)[0]
    best = int(probs.argmax())
    # TEI answers one text with a flat [{label, score}, ...] (best first); huggingface_hub keeps element [0] of
    # the list it parses (written for the HF API's [[...]]), so the client returns the best label alone.
    with client_table.call("huggingface_hub", "`InferenceClient.text_classification(text)` (classifier)",
                           works="yes: returns the best label only (TEI's flat list, the client's `[0]`)") as row:
        got = hf.text_classification(text)
        assert server.last() == ("/", {"inputs": text, "parameters": {}})
        assert got.label == enc.head.labels[best]
        row.parity = score_parity([got.score], [probs[best]])
    with client_table.call("huggingface_hub", "`text_classification(text, top_k=2)` (classifier)",
                           works="yes: best label only, as above") as row:
        got = hf.text_classification(text, top_k=2)
        assert server.last()[1] == {"inputs": text, "parameters": {"top_k": 2}}
        assert got.label == enc.head.labels[best]
        row.parity = score_parity([got.score], [probs[best]])
    logits = enc.classify([text])[0]
    with client_table.call("huggingface_hub", "`text_classification(text, function_to_apply=...)` (classifier)",
                           works="yes: `none` the logits, `sigmoid` each logit's; best label only, as above") as row:
        got = hf.text_classification(text, function_to_apply="none")
        assert server.last()[1] == {"inputs": text, "parameters": {"function_to_apply": "none"}}
        assert got.score == pytest.approx(float(logits[best]), abs=1e-4)
        sig = hf.text_classification(text, function_to_apply="sigmoid")
        assert sig.score == pytest.approx(float(1 / (1 + np.exp(-logits[best]))), abs=1e-4)
        row.parity = score_parity([got.score, sig.score], [logits[best], 1 / (1 + np.exp(-logits[best]))], atol=1e-4)


def test_huggingface_hub_against_a_cross_encoder(hf_online, cross_encoder, client_table):
    """TEI's POST / of a reranker is /rerank ({query, texts}); huggingface_hub has no rerank call, and its
    text_classification body ({inputs}) is refused there, as TEI refuses it."""
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError

    server, enc = cross_encoder
    with client_table.call("huggingface_hub", "`text_classification(text)` (cross-encoder)",
                           works="no, as TEI: POST / is /rerank; the client has no rerank call") as row:
        with pytest.raises(HfHubHTTPError) as err:
            InferenceClient(model=server.url).text_classification("the query")
        assert err.value.response.status_code == 422 and "query" in err.value.response.json()["error"]
        row.parity = "422 `Validation` naming `query`"
    # what the route does serve, for the record: the cross-encoder's scores
    texts = ["a document", "jax"]
    got = json.loads(_post(server.url + "/", {"query": "the query", "texts": texts, "raw_scores": True}))
    np.testing.assert_allclose([g["score"] for g in sorted(got, key=lambda g: g["index"])],
                               enc.rerank("the query", texts), atol=1e-5)


def _post(url: str, body) -> bytes:
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read()


# ---- 3. text-embeddings-inference-client 0.1.0 ----

def test_tei_client(embedder, client_table):
    from text_embeddings_inference_client import Client, errors
    from text_embeddings_inference_client.api.text_embeddings_inference import embed as tei_embed
    from text_embeddings_inference_client.api.text_embeddings_inference import get_model_info, openai_embed
    from text_embeddings_inference_client.models import EmbedRequest, ErrorResponse, ErrorType, OpenAICompatRequest

    server, enc = embedder
    pkg = "text-embeddings-inference-client"
    # the client's ErrorType: jaxserve's TEI routes answer 413/422/424/429 (the statuses it parses) only with these
    assert {e.value for e in ErrorType} == {"Backend", "Overloaded", "Tokenizer", "Unhealthy", "Validation"}
    with Client(base_url=server.url, timeout=60) as client:
        with client_table.call(pkg, "`embed.sync(EmbedRequest(inputs, truncate=True))`") as row:
            got = tei_embed.sync(client=client, json_body=EmbedRequest(inputs=TEXTS, truncate=True))
            assert server.last() == ("/embed", {"inputs": TEXTS, "truncate": True})
            row.parity = cosine_parity(got, embed(enc, TEXTS))
        with client_table.call(pkg, "error: `embed.sync_detailed` over-length input, `truncate=False`") as row:
            resp = tei_embed.sync_detailed(client=client, json_body=EmbedRequest(inputs=[LONG], truncate=False))
            assert resp.status_code == 422 and isinstance(resp.parsed, ErrorResponse)  # was KeyError: 'error_type'
            assert resp.parsed.error_type is ErrorType.VALIDATION and "tokens" in resp.parsed.error
            row.parity = "422 `ErrorResponse(error_type=VALIDATION)`"
        with client_table.call(pkg, "error: `embed.sync` 33 inputs, over `--max-client-batch 32`") as row:
            parsed = tei_embed.sync(client=client, json_body=EmbedRequest(inputs=["x"] * 33))
            assert isinstance(parsed, ErrorResponse) and parsed.error_type is ErrorType.VALIDATION
            assert "at most 32" in parsed.error
            row.parity = "422 `ErrorResponse(error_type=VALIDATION)`"
        with client_table.call(pkg, "error: `embed.sync_detailed(inputs=[])`",
                               works="yes: 400 `Empty` is outside the client's statuses, parsed as None") as row:
            resp = tei_embed.sync_detailed(client=client, json_body=EmbedRequest(inputs=[]))
            assert resp.status_code == 400 and resp.parsed is None
            assert json.loads(resp.content) == {"error": "`inputs` must not be empty", "error_type": "Empty"}
            row.parity = "400, parsed None"
        with client_table.call(pkg, "`get_model_info.sync_detailed()`") as row:
            resp = get_model_info.sync_detailed(client=client)
            info = json.loads(resp.content)
            assert resp.status_code == 200 and info["model_id"] == MODEL
            assert info["model_type"] == {"embedding": {"pooling": "mean"}} and info["max_client_batch_size"] == 32
            row.parity = "200, TEI's fields"
        with client_table.call(pkg, "`openai_embed.sync_detailed(...)`",
                               works="no: posts `/openai` (TEI 0.2's route; TEI and jaxserve serve `/v1/embeddings`)"
                               ) as row:
            resp = openai_embed.sync_detailed(client=client, json_body=OpenAICompatRequest(input_=TEXTS[:1]))
            assert resp.status_code == 404 and resp.parsed is None
            row.parity = "404, parsed None"
    with Client(base_url=server.url, raise_on_unexpected_status=True) as strict:
        with pytest.raises(errors.UnexpectedStatus) as err:
            tei_embed.sync(client=strict, json_body=EmbedRequest(inputs=[]))
        assert err.value.status_code == 400


# ---- 4. langchain-openai OpenAIEmbeddings ----

def _capturing_http_client(bodies: list):
    import httpx

    return httpx.Client(event_hooks={"request": [lambda request: bodies.append(json.loads(request.content))]})


def test_langchain_openai_sends_tiktoken_ids_by_default(embedder, client_table):
    import tiktoken
    from langchain_openai import OpenAIEmbeddings

    server, enc = embedder
    bodies: list = []
    lc = OpenAIEmbeddings(base_url=server.url + "/v1", api_key="x", model=MODEL,
                          http_client=_capturing_http_client(bodies))
    cl100k = tiktoken.get_encoding("cl100k_base")
    docs = TEXTS + [""]  # an empty text: LangChain asks for the embedding of input "" on its own
    with client_table.call("langchain-openai", "`OpenAIEmbeddings(model=...).embed_documents` (tiktoken ids)") as row:
        got = lc.embed_documents(docs)
        assert bodies[0]["input"] == [cl100k.encode_ordinary(t) for t in TEXTS]  # token ids on the wire ...
        assert bodies[1]["input"] == ""  # ... then the empty text
        row.parity = cosine_parity(got, embed(enc, docs))  # ... read as tiktoken's, not the model's vocabulary
    with client_table.call("langchain-openai", "`embed_query` (tiktoken ids)") as row:
        got = lc.embed_query(QUERY)
        assert bodies[-1]["input"] == [cl100k.encode_ordinary(QUERY)]
        row.parity = cosine_parity([got], embed(enc, [QUERY]))


def test_langchain_openai_with_text(embedder, client_table):
    from langchain_openai import OpenAIEmbeddings

    server, enc = embedder
    bodies: list = []
    lc = OpenAIEmbeddings(base_url=server.url + "/v1", api_key="x", model=MODEL, check_embedding_ctx_length=False,
                          http_client=_capturing_http_client(bodies))
    with client_table.call("langchain-openai", "`embed_documents`, `check_embedding_ctx_length=False` (text)") as row:
        got = lc.embed_documents(TEXTS)
        assert bodies[0]["input"] == TEXTS
        row.parity = cosine_parity(got, embed(enc, TEXTS))
    with client_table.call("langchain-openai", "`embed_query`, `check_embedding_ctx_length=False` (text)") as row:
        got = lc.embed_query(QUERY)
        assert bodies[-1]["input"] == [QUERY]
        row.parity = cosine_parity([got], embed(enc, [QUERY]))


async def test_langchain_openai_async(embedder, client_table):
    from langchain_openai import OpenAIEmbeddings

    server, enc = embedder
    lc = OpenAIEmbeddings(base_url=server.url + "/v1", api_key="x", model=MODEL)
    with client_table.call("langchain-openai", "`aembed_documents` / `aembed_query` (tiktoken ids)") as row:
        docs, query = await asyncio.gather(lc.aembed_documents(TEXTS), lc.aembed_query(QUERY))
        row.parity = cosine_parity(docs + [query], embed(enc, TEXTS + [QUERY]))


# ---- 5. llama-index TextEmbeddingsInference ----

def test_llama_index_sync(embedder, client_table):
    from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

    server, enc = embedder
    pkg = "llama-index-embeddings-text-embeddings-inference"
    li = TextEmbeddingsInference(base_url=server.url, model_name=MODEL)
    with client_table.call(pkg, "`TextEmbeddingsInference.get_text_embedding`") as row:
        got = li.get_text_embedding(TEXTS[0])
        assert server.last() == ("/embed", {"inputs": [TEXTS[0]], "truncate": True})
        row.parity = cosine_parity([got], embed(enc, TEXTS[:1]))
    with client_table.call(pkg, "`get_text_embedding_batch`") as row:
        got = li.get_text_embedding_batch(TEXTS)
        row.parity = cosine_parity(got, embed(enc, TEXTS))
    with client_table.call(pkg, "`get_query_embedding`") as row:
        got = li.get_query_embedding(QUERY)
        row.parity = cosine_parity([got], embed(enc, [QUERY]))


async def test_llama_index_async(embedder, client_table):
    from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

    server, enc = embedder
    pkg = "llama-index-embeddings-text-embeddings-inference"
    li = TextEmbeddingsInference(base_url=server.url, model_name=MODEL, query_instruction="query:")
    with client_table.call(pkg, "`aget_text_embedding` / `aget_text_embedding_batch`") as row:
        one, batch = await asyncio.gather(li.aget_text_embedding(TEXTS[1]), li.aget_text_embedding_batch(TEXTS))
        row.parity = cosine_parity([one] + batch, embed(enc, TEXTS[1:2] + TEXTS))
    with client_table.call(pkg, "`aget_query_embedding` (`query_instruction=\"query:\"`)") as row:
        got = await li.aget_query_embedding(QUERY)
        assert server.last()[1]["inputs"] == ["query: " + QUERY]
        row.parity = cosine_parity([got], embed(enc, ["query: " + QUERY]))


# ---- 6. cohere: ClientV2, Cohere's v2 API (/v2/embed, /v2/rerank); Client, v1's (/v1/embed, /v1/rerank) ----

COHERE_TYPES = ["float", "int8", "uint8", "binary", "ubinary", "base64"]


def test_cohere_embed(embedder, client_table):
    import cohere

    server, enc = embedder
    co = cohere.ClientV2(api_key="unused", base_url=server.url)
    want = embed(enc, TEXTS, prompt_name="query")  # input_type search_query: the checkpoint's "query" prompt
    with client_table.call("cohere", "`ClientV2().embed(input_type=\"search_query\", embedding_types=[all six])`") as row:
        resp = co.embed(model=MODEL, texts=TEXTS, input_type="search_query", embedding_types=COHERE_TYPES)
        assert server.last() == ("/v2/embed", {"model": MODEL, "texts": TEXTS, "input_type": "search_query",
                                               "embedding_types": COHERE_TYPES})
        e = resp.embeddings
        got = np.array(e.float_, np.float32)
        for kind in ("binary", "ubinary"):  # exact against the in-process vectors
            np.testing.assert_array_equal(getattr(e, kind), api.quantize(want, kind))
        for kind in ("int8", "uint8"):  # exact from the float vectors of the same response
            np.testing.assert_array_equal(getattr(e, kind), api.quantize(got, kind))
        np.testing.assert_array_equal([np.frombuffer(base64.b64decode(s), "<f4") for s in e.base64], got)
        assert resp.texts == TEXTS and resp.meta.billed_units.input_tokens > 256
        row.parity = cosine_parity(got, want) + "; binary, ubinary exact; int8, uint8, base64 exact from float"
    with client_table.call("cohere", "`embed(input_type=\"search_document\", output_dimension=128)`") as row:
        resp = co.embed(model=MODEL, texts=TEXTS, input_type="search_document", output_dimension=128,
                        embedding_types=["float", "ubinary"])
        cut = normalize_rows(embed(enc, TEXTS)[:, :128])  # no "document" prompt in the checkpoint: none
        np.testing.assert_array_equal(resp.embeddings.ubinary, api.quantize(cut, "ubinary"))
        row.parity = cosine_parity(resp.embeddings.float_, cut) + "; ubinary exact"
    with client_table.call("cohere", "`embed(truncate=\"START\")` (an over-length text)") as row:
        resp = co.embed(model=MODEL, texts=[LONG], input_type="search_document", truncate="START")
        pieces = enc.tokenizer.documents([LONG], "truncate", direction="left")
        row.parity = cosine_parity(resp.embeddings.float_, normalize_rows(pieces.combine(enc.run(pieces), 1)))
    with client_table.call("cohere", "error: `embed(truncate=\"NONE\")` over-length, `output_dimension=1000`") as row:
        with pytest.raises(cohere.BadRequestError) as err:
            co.embed(model=MODEL, texts=[LONG], input_type="search_document", truncate="NONE")
        assert set(err.value.body) == {"id", "message"} and "tokens" in err.value.body["message"]
        with pytest.raises(cohere.BadRequestError) as err:
            co.embed(model=MODEL, texts=TEXTS, input_type="search_query", output_dimension=1000)
        assert "from 1 to 384" in err.value.body["message"]
        row.parity = "400 `BadRequestError`, Cohere's `{id, message}`"
    with client_table.call("cohere", "error: 33 texts, over `--max-client-batch 32`") as row:
        with pytest.raises(cohere.core.api_error.ApiError) as err:
            co.embed(model=MODEL, texts=["x"] * 33, input_type="search_query")
        assert err.value.status_code == 413 and "at most 32" in err.value.body["message"]
        row.parity = "413 `ApiError`, the server's message"


def test_cohere_v1_client(embedder, cross_encoder, client_table):
    """Cohere's v1 `Client`, which langchain-cohere's CohereEmbeddings and llama-index's CohereEmbedding call."""
    import cohere

    server, enc = embedder
    co = cohere.Client(api_key="unused", base_url=server.url)
    with client_table.call("cohere", "`Client().embed(input_type=\"search_document\", embedding_types=[\"float\"])` "
                           "(v1, as langchain-cohere calls it)") as row:
        resp = co.embed(model=MODEL, texts=TEXTS, input_type="search_document", embedding_types=["float"])
        assert server.last()[0] == "/v1/embed" and resp.response_type == "embeddings_by_type"
        want = embed(enc, TEXTS)  # no "document" prompt in the checkpoint: none
        row.parity = cosine_parity(resp.embeddings.float_, want)
    with client_table.call("cohere", "`Client().embed(input_type=\"search_query\")` (v1 floats)") as row:
        resp = co.embed(model=MODEL, texts=TEXTS, input_type="search_query")
        assert resp.response_type == "embeddings_floats" and resp.meta.api_version.version == "1"
        row.parity = cosine_parity(resp.embeddings, embed(enc, TEXTS, prompt_name="query"))
    with client_table.call("cohere", "error: v1 `embed(truncate=\"NONE\")` over-length") as row:
        with pytest.raises(cohere.BadRequestError) as err:
            co.embed(model=MODEL, texts=[LONG], input_type="search_document", truncate="NONE")
        assert set(err.value.body) == {"id", "message"} and "tokens" in err.value.body["message"]
        row.parity = "400 `BadRequestError`, Cohere's `{id, message}`"
    server, enc = cross_encoder
    texts = ["a document", "jax", "the query of the model", "batch"]
    with client_table.call("cohere", "`Client().rerank(query, documents, top_n=2)` (v1: vLLM's /v1/rerank)") as row:
        resp = cohere.Client(api_key="unused", base_url=server.url).rerank(
            model="tiny-cross-encoder", query="the query", documents=texts, top_n=2)
        assert server.last()[0] == "/v1/rerank"
        scores = 1 / (1 + np.exp(-enc.rerank("the query", texts).astype(np.float64)))
        best = np.argsort(-scores, kind="stable")[:2]
        assert [r.index for r in resp.results] == best.tolist()
        row.parity = score_parity([r.relevance_score for r in resp.results], scores[best])


async def test_cohere_async_embed(embedder, client_table):
    import cohere

    server, enc = embedder
    co = cohere.AsyncClientV2(api_key="unused", base_url=server.url)
    with client_table.call("cohere", "`AsyncClientV2().embed(embedding_types=[\"ubinary\", \"int8\"])`, 3 concurrent"
                           ) as row:
        resps = await asyncio.gather(*(co.embed(model=MODEL, texts=TEXTS[i:], input_type="clustering",
                                                embedding_types=["ubinary", "int8"]) for i in range(3)))
        want = embed(enc, TEXTS)
        for i, r in enumerate(resps):
            np.testing.assert_array_equal(r.embeddings.ubinary, api.quantize(want[i:], "ubinary"))
            assert np.abs(np.array(r.embeddings.int8) - api.quantize(want[i:], "int8")).max() <= 1
        row.parity = "ubinary exact, int8 within 1 of the in-process vectors' (12 vectors)"


def test_cohere_rerank(embedder, cross_encoder, client_table):
    import cohere

    server, enc = cross_encoder
    texts = ["a document", "jax", "the query of the model", "batch"]
    co = cohere.ClientV2(api_key="unused", base_url=server.url)
    with client_table.call("cohere", "`ClientV2().rerank(query, documents, top_n=2)` (cross-encoder)") as row:
        resp = co.rerank(model="tiny-cross-encoder", query="the query", documents=texts, top_n=2)
        assert server.last() == ("/v2/rerank", {"model": "tiny-cross-encoder", "query": "the query",
                                                "documents": texts, "top_n": 2})
        scores = 1 / (1 + np.exp(-enc.rerank("the query", texts).astype(np.float64)))
        best = np.argsort(-scores, kind="stable")[:2]
        assert [r.index for r in resp.results] == best.tolist()
        row.parity = score_parity([r.relevance_score for r in resp.results], scores[best])
    server, enc = embedder
    co = cohere.ClientV2(api_key="unused", base_url=server.url)
    with client_table.call("cohere", "`rerank(query, documents)` (embedding model: cosine)") as row:
        resp = co.rerank(model=MODEL, query=QUERY, documents=TEXTS)
        cosine = embed(enc, TEXTS) @ embed(enc, [QUERY], prompt_name="query")[0]
        assert [r.index for r in resp.results] == np.argsort(-cosine, kind="stable").tolist()
        row.parity = score_parity([r.relevance_score for r in sorted(resp.results, key=lambda r: r.index)], cosine)
