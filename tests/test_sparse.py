"""SPLADE checkpoints as sentence-transformers' SparseEncoder saves them, against its own `encode`.

Tiny masked-LM checkpoints (BERT, DistilBERT) are written by transformers,
wrapped in Transformer(fill-mask) + SpladePooling and saved by
sentence-transformers with max_seq_length 128. Parity: the same non-zero
indices, values within 1e-4 relative.
"""

import json

import hf_tiny
import numpy as np
import pytest
from conftest import warm_encoder

from jaxserve.errors import CheckpointError, InputError
from jaxserve.heads import forwards, sparse
from jaxserve.runtime.buckets import fixed

MAX_LEN = 128
PACKED = fixed([(4, MAX_LEN)], layout="packed")
TEXTS = ["x", "the model", "a batch of jax documents is the query " * 3, "hello, world! 42",
         "the query of the model " * 40]  # past 128 tokens: truncated
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512)
MODELS = {
    "bert": ("BertForMaskedLM", "BertConfig", SMALL),
    "distilbert": ("DistilBertForMaskedLM", "DistilBertConfig",
                   dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=512)),
}


def splade_checkpoint(root, model: str = "bert", strategy: str = "max", activation: str = "relu", bias: float = 0.0):
    """A tiny masked LM saved by sentence-transformers as a SparseEncoder (Transformer fill-mask + SpladePooling).
    `bias`: added to a BERT head's vocabulary bias, so that more of every row's weights are non-zero."""
    import transformers
    from safetensors.numpy import load_file, save_file
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import PreTrainedTokenizerFast

    model_class, config_class, fields = MODELS[model]
    config = getattr(transformers, config_class)(vocab_size=len(hf_tiny.vocab("bert")), pad_token_id=0, **fields)
    raw = hf_tiny.write(root / "hf", model_class, config, kind="bert", seed=2, scale=0.3)
    if bias:
        tensors = load_file(raw / "model.safetensors")
        tensors["cls.predictions.bias"] = tensors["cls.predictions.bias"] + np.float32(bias)
        save_file(tensors, raw / "model.safetensors", metadata={"format": "pt"})
    transformer = Transformer(str(raw), transformer_task="fill-mask")
    transformer.processor = PreTrainedTokenizerFast(tokenizer_file=str(raw / "tokenizer.json"), pad_token="[PAD]")
    st = SparseEncoder(modules=[transformer, SpladePooling(strategy, activation_function=activation)], device="cpu")
    st.max_seq_length = MAX_LEN
    st.save(str(root / "st"))
    return root / "st"


def reference(path, texts):
    from sentence_transformers import SparseEncoder

    st = SparseEncoder(str(path), device="cpu")
    assert st.max_seq_length == MAX_LEN
    return st.encode(texts, convert_to_sparse_tensor=False, convert_to_tensor=False)


def assert_same_sparse(got: list[list[dict]], want) -> None:
    for g, w in zip(got, want, strict=True):
        w = np.asarray(w, np.float32)
        idx = np.flatnonzero(w)
        assert [e["index"] for e in g] == idx.tolist()
        # atol in proportion to the vector's largest weight: float32 sums over the tokens (sum pooling) carry an
        # absolute error of that order, which a small weight beside a large one cannot meet relatively
        np.testing.assert_allclose([e["value"] for e in g], w[idx], rtol=1e-4, atol=1e-6 * max(1.0, np.abs(w).max()))


@pytest.fixture(scope="module")
def splade(tmp_path_factory):
    path = splade_checkpoint(tmp_path_factory.mktemp("splade"))
    return path, warm_encoder(path, PACKED)


def test_matches_sparse_encoder(splade):
    path, enc = splade
    assert enc.head.kind == "sparse" and enc.splade.cap == enc.model_config.vocab_size
    assert enc.embedding_config.max_seq_length == MAX_LEN
    assert enc.prepare(TEXTS)[1].docs.max() > 1  # rows shared by several texts
    got = enc.embed_sparse(TEXTS)
    assert all(0 < len(g) < enc.model_config.vocab_size for g in got)
    assert_same_sparse(got, reference(path, TEXTS))


def test_a_str_is_one_text_as_sparse_encoder(splade):
    """`embed_sparse("x")` is one text's weights, as SparseEncoder's `encode("x")` is one 1-D vector (before: a
    list per character)."""
    path, enc = splade
    got, want = enc.embed_sparse(TEXTS[2]), reference(path, TEXTS[2])
    assert np.ndim(want) == 1 and all(isinstance(e, dict) for e in got)
    assert_same_sparse([got], [want])


@pytest.mark.parametrize("model, strategy, activation", [("distilbert", "max", "relu"), ("bert", "sum", "log1p_relu")])
def test_other_heads_and_poolings(tmp_path, model, strategy, activation):
    path = splade_checkpoint(tmp_path, model, strategy, activation)
    enc = warm_encoder(path, PACKED)
    assert_same_sparse(enc.embed_sparse(TEXTS), reference(path, TEXTS))


def test_vocabulary_blocks_and_cap(splade, monkeypatch):
    """Blocks that do not divide the vocabulary give the same weights; a cap below every text's non-zeros still
    gives them all (each from its full row).
    Both change the executables, so both are in the warm artifact's key: each warms through the run's artifacts
    and runs an executable of its own block and cap, never the default one's (saved by the `splade` fixture)."""
    from jaxserve.runtime import artifact

    path, enc = splade
    key = lambda e: artifact.key_fields(e, PACKED, ("pooled",))["sparse"]
    monkeypatch.setattr(sparse, "BLOCK", 10)  # 152 entries: 16 blocks, the last one padded
    blocked = warm_encoder(path, PACKED)
    assert key(blocked) == {**key(enc), "block": 10}
    assert_same_sparse(blocked.embed_sparse(TEXTS), reference(path, TEXTS))
    monkeypatch.setenv(sparse.CAP_ENV, "8")
    capped = warm_encoder(path, PACKED)
    assert key(capped) == {**key(enc), "block": 10, "cap": 8}
    got = capped.embed_sparse(TEXTS)
    assert min(len(g) for g in got) > 8
    assert_same_sparse(got, reference(path, TEXTS))
    rows = capped.run(*capped.prepare(TEXTS))
    assert capped.out_dim == 17 and rows.compact.shape[-1] == 17  # the executable's width
    assert len(rows.full) == len(TEXTS)  # every text is over the cap: each from its full row


@pytest.fixture(scope="module")
def dense_splade(tmp_path_factory):
    """A SparseEncoder with random weights whose rows are dense (about 70% of the vocabulary non-zero; the held-out
    checkpoint of issue 38 had 22143 per text), served at a cap that its texts' non-zeros straddle: the rows at or
    under it ship compact, the others come from their full rows, side by side in the same batches."""
    path = splade_checkpoint(tmp_path_factory.mktemp("dense"), bias=1.0)
    want = reference(path, TEXTS)
    nonzeros = sorted(int(np.count_nonzero(w)) for w in want)
    cap = nonzeros[1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(sparse.CAP_ENV, str(cap))
        enc = warm_encoder(path, PACKED)
    assert enc.splade.cap == cap and nonzeros[-1] > cap and nonzeros[0] > enc.model_config.vocab_size // 2
    return path, enc, want


def test_dense_rows_match_sparse_encoder(dense_splade):
    """Every non-zero of every text, as SparseEncoder.encode gives them, the rows over the cap included (these
    were an InputError naming JAXSERVE_SPARSE_CAP)."""
    _, enc, want = dense_splade
    over = [int(np.count_nonzero(w)) > enc.splade.cap for w in want]
    assert any(over) and not all(over)
    assert enc.prepare(TEXTS)[1].docs.max() > 1  # rows over and under the cap share device rows
    assert_same_sparse(enc.embed_sparse(TEXTS), want)
    rows = enc.run(*enc.prepare(TEXTS))
    assert len(rows.full) == sum(over)  # only those rows' full weights were kept


def test_rows_over_the_cap_read_from_their_full_rows(monkeypatch):
    """A batch's sequences over the cap are the ones whose full rows are kept (`needed`, `keep`), by sequence;
    `decode` and `json_rows` read those there (JSON in blocks of JSON_BLOCK weights) and the others from the compact
    rows. Compact rows over the cap without their full rows are a caller's error, never a request's."""
    import orjson

    cfg = sparse.SparseConfig(6, cap=2)
    weights = np.zeros((1, 2, 6), np.float32)  # [B, k, V]
    weights[0, 0, [1, 4]] = [0.5, 2.0]
    weights[0, 1, [0, 2, 5]] = [1.5, 0.25, 3.0]
    compact = np.array([[[2, 0.5, 2.0, 1, 4], [3, 1.5, 0.25, 0, 2]]], np.float32)  # as the device ships them
    assert cfg.needed(compact).tolist() == [[False, True]]
    rows = sparse.SparseRows(compact[0], {1: cfg.keep(weights[0, 1])})
    want = [[{"index": 1, "value": 0.5}, {"index": 4, "value": 2.0}],
            [{"index": 0, "value": 1.5}, {"index": 2, "value": 0.25}, {"index": 5, "value": 3.0}]]
    assert sparse.decode(rows, cfg) == want
    monkeypatch.setattr(sparse, "JSON_BLOCK", 2)
    assert [orjson.loads(r) for r in sparse.json_rows(rows, cfg)] == want
    assert not cfg.needed(compact[:, :1]).any()  # as shipped
    with pytest.raises(ValueError, match="without their full rows"):
        sparse.decode(compact[0], cfg)


def test_max_active_dims_keeps_each_rows_largest_weights():
    """`max_active_dims`: a row's k largest weights, in index order, from compact rows and full ones alike; a row
    of k or fewer as it is."""
    import orjson

    cfg = sparse.SparseConfig(8, cap=3, max_active=2)
    compact = np.array([[3, 0.5, 2.0, 1.0, 1, 4, 6], [2, 1.5, 0.25, 0, 0, 7, 0], [4, 0, 0, 0, 0, 0, 0]], np.float32)
    full = {2: (np.array([0, 2, 3, 5]), np.array([0.75, 3.0, 0.125, 1.25], np.float32))}
    want = [[{"index": 4, "value": 2.0}, {"index": 6, "value": 1.0}],
            [{"index": 0, "value": 1.5}, {"index": 7, "value": 0.25}],
            [{"index": 2, "value": 3.0}, {"index": 5, "value": 1.25}]]
    assert sparse.decode(sparse.SparseRows(compact, full), cfg) == want
    assert [orjson.loads(r) for r in sparse.json_rows(sparse.SparseRows(compact, full), cfg)] == want
    assert compact[0, 0] == 3  # the device's rows are left as they came
    with pytest.raises(CheckpointError, match="max_active_dims 0"):
        sparse.SparseConfig.from_module({}, 8, max_active_dims=0)


async def test_max_active_dims_matches_sparse_encoder(make_server, dense_splade, tmp_path, monkeypatch):
    """A save's max_active_dims (config_sentence_transformers.json): each text's largest weights only, as
    SparseEncoder.encode keeps them, in process and over /embed_sparse; texts under the cap and over it."""
    import shutil

    path, enc, _ = dense_splade
    shutil.copytree(path, tmp_path / "mad")
    config = json.loads((tmp_path / "mad" / "config_sentence_transformers.json").read_text())
    (tmp_path / "mad" / "config_sentence_transformers.json").write_text(json.dumps({**config, "max_active_dims": 5}))
    monkeypatch.setenv(sparse.CAP_ENV, str(enc.splade.cap))
    mad = warm_encoder(tmp_path / "mad", PACKED)
    want = reference(tmp_path / "mad", TEXTS)
    assert [int(np.count_nonzero(w)) for w in want] == [5] * len(TEXTS)
    assert_same_sparse(mad.embed_sparse(TEXTS), want)
    client = await make_server(mad)
    assert_same_sparse(await (await client.post("/embed_sparse", json={"inputs": TEXTS})).json(), want)


def test_dense_routes_refuse(splade):
    _, enc = splade
    with pytest.raises(InputError, match="sparse model"):
        enc.embed(TEXTS)
    with pytest.raises(InputError, match="chunk"):
        enc.embed_sparse(TEXTS, long="chunk")


def test_compact_unit():
    """The device's compaction: count, values and indices in index order, the rest zeros."""
    import jax.numpy as jnp

    w = np.zeros((1, 2, 6), np.float32)
    w[0, 0, [1, 4]] = [0.5, 2.0]
    out = np.asarray(forwards.compact(jnp.asarray(w), cap=3))
    assert out.shape == (1, 2, 7)
    np.testing.assert_array_equal(out[0, 0], [2, 0.5, 2.0, 0, 1, 4, 0])
    np.testing.assert_array_equal(out[0, 1], np.zeros(7))
    cfg = sparse.SparseConfig(6, cap=3)
    assert sparse.decode(out[0], cfg) == [[{"index": 1, "value": 0.5}, {"index": 4, "value": 2.0}], []]


async def test_embed_sparse_route(make_server, splade):
    """TEI's /embed_sparse on loopback: SparseEncoder's weights, one list per input, batched with others."""
    import asyncio

    path, enc = splade
    client = await make_server(enc)
    single, many = await asyncio.gather(client.post("/embed_sparse", json={"inputs": TEXTS[1]}),
                                        client.post("/embed_sparse", json={"inputs": TEXTS, "truncate": True}))
    assert single.status == 200 and many.status == 200
    want = reference(path, TEXTS)
    assert_same_sparse(await many.json(), want)
    assert_same_sparse(await single.json(), want[1:2])
    for field in ({"dimensions": 4}, {"normalize": False}):  # nothing to cut or scale: refused, not dropped
        bad = await client.post("/embed_sparse", json={"inputs": TEXTS[1], **field})
        assert bad.status == 422 and f"`{next(iter(field))}`" in (await bad.json())["error"]
    root = await client.post("/", json={"inputs": TEXTS[:2]})  # TEI's root: the model kind's route
    assert_same_sparse(await root.json(), want[:2])
    info = await (await client.get("/info")).json()
    assert info["model_type"] == {"embedding": {"pooling": "splade"}} and info["kind"] == "sparse"
    assert info["dimensions"] == enc.model_config.vocab_size and info["sparse"]["pooling_strategy"] == "max"
    spec = await (await client.get("/openapi.json")).json()
    assert "/embed_sparse" in spec["paths"]


async def test_dense_routes_on_a_sparse_model_and_the_reverse(make_server, splade, tmp_path):
    """Each side refuses the other's route in TEI's error shape (422 Validation, as TEI codes a bad request) or
    OpenAI's (400), and keeps serving."""
    import tiny
    from conftest import TINY_TABLE

    _, enc = splade
    client = await make_server(enc)
    resp = await client.post("/embed", json={"inputs": TEXTS})
    assert resp.status == 424  # TEI's Backend: the wrong deployment, not bad input
    body = await resp.json()
    assert body["error_type"] == "Backend" and "sparse (SPLADE)" in body["error"]
    assert (await client.post("/v1/embeddings", json={"input": TEXTS})).status == 400
    chunk = await client.post("/embed_sparse", json={"inputs": TEXTS, "long": "chunk"})
    assert chunk.status == 422 and "chunk" in (await chunk.json())["error"]
    assert (await client.post("/embed_sparse", json={"inputs": TEXTS[:1]})).status == 200
    dense = warm_encoder(tiny.write_checkpoint(tmp_path / "dense"), TINY_TABLE)
    dense_client = await make_server(dense)
    resp = await dense_client.post("/embed_sparse", json={"inputs": TEXTS})
    assert resp.status == 424
    body = await resp.json()
    assert body["error_type"] == "Backend" and "needs a sparse (SPLADE) embedding model" in body["error"]


def test_jaxserve_embed_writes_sparse_jsonl(splade, tmp_path, capsys):
    """`jaxserve embed` with a SPLADE model: one JSON line per document, in input order."""
    import json

    from jaxserve.cli import main

    path, _ = splade
    table = tmp_path / "t.json"
    PACKED.save(table)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "weights.jsonl"
    args = ["embed", "--input", str(corpus), "--model", str(path), "--buckets", str(table), "--chunk", "2"]
    assert main(args + ["--output", str(out)]) == 0
    assert_same_sparse([json.loads(line) for line in out.read_text().splitlines()], reference(path, TEXTS))
    assert main(args + ["--output", str(tmp_path / "weights.npy")]) == 2
    assert "--output must end in .jsonl" in capsys.readouterr().err


async def test_embed_sparse_at_its_largest_keeps_the_event_loop_free(make_server, splade, monkeypatch):
    """/embed_sparse at its largest (the client batch limit of inputs, each cut at the model's length): no step
    that decodes or encodes its weights runs on the event loop (tests/loopwatch.py records which thread runs
    each), and the weights are the Python API's."""
    import loopwatch
    import orjson

    from jaxserve.http.state import MAX_CLIENT_BATCH

    _, enc = splade
    texts = [f"{i} {TEXTS[-1]}" for i in range(MAX_CLIENT_BATCH)]
    want = enc.embed_sparse(texts[:3] + texts[-1:])
    client = await make_server(enc)
    watcher = loopwatch.watch(monkeypatch)
    resp = await client.post("/embed_sparse", json={"inputs": texts})
    assert resp.status == 200
    assert watcher.grown(MAX_CLIENT_BATCH) == []
    got = orjson.loads(await resp.read())
    assert len(got) == MAX_CLIENT_BATCH
    for g, w in zip(got[:3] + got[-1:], want, strict=True):
        assert [e["index"] for e in g] == [e["index"] for e in w]
        np.testing.assert_allclose([e["value"] for e in g], [e["value"] for e in w], rtol=1e-5)


async def test_embed_sparse_over_the_cap_serves_every_weight(make_server, dense_splade, monkeypatch):
    """/embed_sparse on a model whose rows are dense: every non-zero of every input, rows over the cap and under it
    in one request (over the cap was the request's 422), none of it read on the event loop (tests/loopwatch.py),
    and TEI's root alike."""
    import loopwatch

    path, enc, want = dense_splade
    client = await make_server(enc)
    resp = await client.post("/embed_sparse", json={"inputs": TEXTS})
    assert resp.status == 200
    assert_same_sparse(await resp.json(), want)
    root = await client.post("/", json={"inputs": TEXTS[:2]})
    assert root.status == 200
    assert_same_sparse(await root.json(), want[:2])
    many = [f"{i} {TEXTS[2]}" for i in range(64)]
    watcher = loopwatch.watch(monkeypatch)
    resp = await client.post("/embed_sparse", json={"inputs": many})
    assert resp.status == 200 and watcher.grown(len(many)) == []
    got = await resp.json()
    assert max(len(g) for g in got) > enc.splade.cap
    assert_same_sparse(got, reference(path, many))


def test_jaxserve_embed_writes_dense_rows(dense_splade, tmp_path, monkeypatch):
    """`jaxserve embed`'s .jsonl of a model whose rows are dense: every non-zero, over the cap or not."""
    import json

    from jaxserve.cli import main

    path, enc, want = dense_splade
    monkeypatch.setenv(sparse.CAP_ENV, str(enc.splade.cap))  # the served cap: its warm artifact, no compile
    table = tmp_path / "t.json"
    PACKED.save(table)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "weights.jsonl"
    assert main(["embed", "--input", str(corpus), "--model", str(path), "--buckets", str(table), "--chunk", "2",
                 "--output", str(out)]) == 0
    assert_same_sparse([json.loads(line) for line in out.read_text().splitlines()], want)


async def test_embed_sparse_runs_each_sequence_once(make_server, dense_splade, monkeypatch):
    """/embed_sparse with sequences over the cap is one pass: every sequence reaches the device once, and its full
    row comes back with its batch (the server ran those sequences a second time, outside the batcher, to read
    theirs). Counted at the engine's launches; the weights are still SparseEncoder.encode's."""
    import threading

    _, enc, want = dense_splade
    launched, lock = [], threading.Lock()
    launch = enc.engine.launch

    def counting(prepared, **kw):
        with lock:  # sequences per batch: each row's highest segment id
            launched.append(int(np.asarray(prepared.inputs[1]).max(axis=1).sum()))
        return launch(prepared, **kw)

    from jaxserve.runtime import device

    monkeypatch.setattr(enc.engine, "launch", counting)
    assert sum(int(np.count_nonzero(w)) > enc.splade.cap for w in want) >= 2
    for streams in (1, 2):  # one device thread launching (an accelerator's), or each running its batch (a CPU's)
        client = await make_server(enc, streams=streams)
        launched.clear()
        resp = await client.post("/embed_sparse", json={"inputs": TEXTS})
        assert resp.status == 200
        assert_same_sparse(await resp.json(), want)
        assert sum(launched) == len(TEXTS), streams  # before: len(TEXTS) + the sequences over the cap
        monkeypatch.setattr(device, "streams", lambda: streams)
        launched.clear()
        assert_same_sparse(enc.embed_sparse(TEXTS), want)  # the Python API: one pass alike
        assert sum(launched) == len(TEXTS)
