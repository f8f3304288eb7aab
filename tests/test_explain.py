"""The latency math: predictions from bucket timings, the plan endpoint, ?explain=1, and `jaxserve explain`."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import TINY_TABLE, SlowEngine, warm_encoder

from jaxserve.runtime import compiles
from jaxserve.runtime.buckets import Bucket, BucketTable
from jaxserve.scheduling.explain import LiveTimings, explain, format_report, simulate
from jaxserve.scheduling.planner import pack

TIMED = BucketTable(buckets=(Bucket(1, 16, 2, compiled_bytes=100, run_s=0.001), Bucket(4, 16, 2, compiled_bytes=120, run_s=0.003),
                             Bucket(1, 64, 8, compiled_bytes=150, run_s=0.004), Bucket(4, 64, 8, compiled_bytes=300, run_s=0.012)),
                    layout="packed", budget_bytes=1000, device_memory=2000)


def test_predictions_add_up_bucket_times():
    lengths = [10, 12, 60, 5, 40, 33]
    rows = pack(lengths, TIMED)
    e = explain(rows, TIMED, LiveTimings(TIMED), backlog=[(16, 6), (64, 1)], batches_in_flight=1, max_wait_s=0.005)
    batches = simulate(rows, TIMED)
    assert [b["bucket"]["batch"] for b in e["batches"]] == [d.bucket.batch for d in batches]
    assert e["predicted_s"] == pytest.approx(sum(d.bucket.run_s for d in batches))
    alone = [simulate(pack([n], TIMED), TIMED) for n in lengths]
    assert all(len(a) == 1 for a in alone)
    assert e["predicted_sequential_s"] == pytest.approx(sum(a[0].bucket.run_s for a in alone))
    assert sorted(d for b in e["batches"] for d in b["documents"]) == list(range(6))
    assert e["real_tokens"] == sum(lengths) and e["padded_tokens"] == sum(d.bucket.tokens for d in batches)
    assert e["sequential_dispatches"] == len(lengths)
    assert e["one_max_batch"] == {"shape": [4, 64], "dispatches": 2, "padded_tokens": 512, "predicted_s": 0.024}
    assert e["queueing"] == {"rows_ahead": 7, "batches_in_flight": 1, "window_worst_case_s": 0.005,
                             "predicted_wait_ahead_s": pytest.approx(2 * 0.003 + 0.012)}
    for entry in e["batches"]:
        assert entry["memory"]["budget_bytes"] == 1000 and entry["memory"]["compiled_bytes"] in (100, 120, 150, 300)
    report = format_report(e, {"run_s": e["predicted_s"] * 1.1})
    assert "sequential (one call per sequence, 6 dispatches)" in report and "+10.0%" in report


def test_a_dispatch_is_predicted_at_the_batchers_cost_host_time_included():
    """On a fast device the host's time per dispatch is the longer part: each dispatch is predicted at
    max(run time, host time), as the batcher costs it, not at its device time alone."""
    host = 0.005  # longer than the 16-token buckets' runs (1 and 3 ms), shorter than the 64-token ones' (4 and 12 ms)
    table = dataclasses.replace(TIMED, host_dispatch_s=host)
    e = explain(pack([5, 6], table), table, LiveTimings(table), backlog=[(16, 6), (64, 1)])
    assert e["host_dispatch_s"] == host
    [b] = e["batches"]
    assert (b["bucket"]["seqlen"], b["device_s"]) == (16, 0.001)  # device time alone would read 1 ms
    assert b["predicted_s"] == e["predicted_s"] == host
    assert e["predicted_sequential_s"] == pytest.approx(2 * host)
    assert e["one_max_batch"]["predicted_s"] == 0.012  # one [4, 64] dispatch: its run is the longer
    assert e["queueing"]["predicted_wait_ahead_s"] == pytest.approx(2 * host + 0.012)  # two [4, 16] (3 ms), a [4, 64]
    assert "the host's 5.0 ms per dispatch" in format_report(e)


def test_live_timings_refresh_the_estimate():
    t = LiveTimings(TIMED)
    b = TIMED.buckets[0]
    for _ in range(30):
        t.observe(b, 0.002)
    assert t.seconds(b) == pytest.approx(0.002, rel=0.01) and t.live_runs(b) == 30


@pytest.fixture(scope="module")
def tiny_enc(tmp_path_factory):
    import tiny

    path = tiny.write_checkpoint(tmp_path_factory.mktemp("t") / "ckpt")
    return warm_encoder(path, TINY_TABLE)


async def test_plan_endpoint_never_runs_the_model_or_compiles(make_server, tiny_enc):
    watched = dataclasses.replace(tiny_enc, engine=SlowEngine(tiny_enc.engine))
    client = await make_server(watched)
    before = compiles.xla_compiles_total()
    docs = ["the model " * (i % 9) + "x" for i in range(40)]
    resp = await client.post("/v1/plan", json={"input": docs})
    assert resp.status == 200
    e = await resp.json()
    assert watched.engine.steps == 0 and compiles.xla_compiles_total() == before
    assert e["documents"] == 40 and sorted({d for b in e["batches"] for d in b["documents"]}) == list(range(40))
    assert e["dispatches"] == len(e["batches"]) and 0 <= e["padding_ratio"] < 1
    assert e["predicted_s"] > 0 and e["predicted_sequential_s"] > 0 and e["one_max_batch"]["dispatches"] >= 1
    bad = await client.post("/v1/plan", json={"input": []})
    assert bad.status == 400


async def test_a_request_the_queue_could_never_hold_is_a_413_on_the_plan_as_when_run(make_server, tiny_enc):
    """/v1/plan and ?explain=1 refuse what /v1/embeddings refuses as larger than the whole queue (413), where the
    plan answered 200 with the batches of a request that would never run."""
    client = await make_server(tiny_enc, max_queue_tokens=64)
    body = {"input": ["the model " * 6] * 8}  # eight rows of seqlen 16: 128 tokens at their seqlens
    for path in ("/v1/embeddings", "/v1/plan", "/v1/embeddings?explain=1"):
        resp = await client.post(path, json=body)
        assert resp.status == 413 and "the queue holds at most 64" in (await resp.json())["error"]["message"], path
    assert (await client.post("/v1/plan", json={"input": ["the model"]})).status == 200


def test_the_plan_is_the_batchers_for_the_requests_class_and_the_servers_classes():
    """While interactive work is likely, a bulk request's batches are capped (`Classes.bulk_dispatch_s`): the plan
    forms them as the server's batcher will, not as on a batcher that never saw a query."""
    from jaxserve.scheduling.batcher import BULK, INTERACTIVE, Classes

    rows = pack([60, 50, 40, 30], TIMED)  # four rows at seqlen 64
    # a bulk batch at 64 within 5 ms: one row (4 ms), not four (12 ms)
    classes = Classes(bulk_dispatch_s=0.005, bulk_efficiency=0.0)
    shapes = lambda ds: [d.bucket.shape for d in ds]
    assert shapes(simulate(rows, TIMED, BULK, classes, likely=False)) == [(4, 64)]
    assert shapes(simulate(rows, TIMED, BULK, classes, likely=True)) == [(1, 64)] * 4
    assert shapes(simulate(rows, TIMED, INTERACTIVE, classes)) == [(4, 64)]  # a query's own batches: not capped
    e = explain(rows, TIMED, LiveTimings(TIMED), cls=BULK, classes=classes, likely=True)
    assert e["dispatches"] == 4 and e["predicted_s"] == pytest.approx(4 * 0.004)


async def test_explain_on_an_embeddings_request(make_server, tiny_enc):
    client = await make_server(tiny_enc)
    docs = ["the model", "a batch of jax documents"]
    plain = await (await client.post("/v1/embeddings", json={"input": docs})).json()
    assert "explain" not in plain
    for kw in ({"params": {"explain": "1"}}, {"headers": {"X-Jaxserve-Explain": "1"}}):
        body = await (await client.post("/v1/embeddings", json={"input": docs}, **kw)).json()
        np.testing.assert_allclose([d["embedding"] for d in body["data"]], [d["embedding"] for d in plain["data"]],
                                   atol=1e-6)
        m = body["explain"]["measured"]
        assert set(m) == {"tokenize_s", "plan_s", "queue_s", "service_s", "encode_s", "total_s"}
        assert m["total_s"] >= m["service_s"] > 0
        dispatched = body["explain"]["dispatched"]
        assert body["explain"]["predicted_s"] > 0 and dispatched
        assert all(d["device_s"] > 0 and d["reason"] in ("idle", "full", "window", "interactive") for d in dispatched)
        assert sum(d["rows_of_this_request"] for d in dispatched) == sum(b["rows_used"] for b in body["explain"]["batches"])


async def test_predicted_and_measured_totals_on_minilm(make_server, minilm_warm, minilm_reference):
    """The 100-document request: prediction from bucket timings vs the measured device time."""
    import test_server

    client = await make_server(minilm_warm)
    docs = test_server.mixed_documents(100, minilm_reference[0])
    await client.post("/v1/embeddings", json={"input": docs})  # live timings refresh the warmup figures
    predicted = (await (await client.post("/v1/plan", json={"input": docs})).json())["predicted_s"]
    body = await (await client.post("/v1/embeddings?explain=1", json={"input": docs})).json()
    measured = body["explain"]["measured"]["service_s"]  # submitted -> all rows done (batches may overlap)
    # how close they are is scripts/bench_latency.py's figure (a busy machine moves it); here, that both exist
    # and cover the same batches
    assert predicted > 0 and measured > 0
    planned = sum(b["rows_used"] for b in body["explain"]["batches"])
    assert sum(d["rows_of_this_request"] for d in body["explain"]["dispatched"]) == planned


def test_explain_command_prints_the_report(tmp_path):
    import tiny

    path = tiny.write_checkpoint(tmp_path / "ckpt")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": "the model " * (i % 7)}) for i in range(30)) + "\n")
    table = tmp_path / "t.json"
    TINY_TABLE.save(table)
    out = subprocess.run([sys.executable, "-m", "jaxserve.cli", "explain", str(docs), "--model", str(path),
                          "--buckets", str(table), "--run"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "30 documents" in out.stdout and "predicted: jaxserve" in out.stdout and "measured: run_s" in out.stdout


def test_explain_command_puts_the_checkpoints_default_prompt_in_front_as_the_server_does(tmp_path, capsys):
    """`jaxserve explain` tokenizes as serve, Encoder.embed and jaxserve embed do: the checkpoint's default prompt in
    front of each document (or --prompt-name / --prompt), where it counted the documents alone; an unknown prompt
    name is refused before anything compiles."""
    import tiny

    from jaxserve import cli
    from jaxserve.checkpoint.tokenize import TextTokenizer

    path = tiny.write_checkpoint(tmp_path / "ckpt", max_seq_length=32)
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query the model of jax: "}, "default_prompt_name": "query"}))
    docs = tmp_path / "docs.txt"
    texts = [f"the model {'jax ' * (i % 5)}" for i in range(12)]
    docs.write_text("\n".join(texts) + "\n")
    table = tmp_path / "t.json"
    TINY_TABLE.save(table)
    tok = TextTokenizer.from_dir(path, 32)
    before = compiles.xla_compiles_total()
    assert cli.main(["explain", str(docs), "--model", str(path), "--buckets", str(table), "--prompt-name", "nope"]) == 2
    assert "unknown prompt_name 'nope'" in capsys.readouterr().err and compiles.xla_compiles_total() == before
    for extra, prompt in (([], "query the model of jax: "), (["--prompt", "jax: "], "jax: ")):
        assert cli.main(["explain", str(docs), "--model", str(path), "--buckets", str(table), *extra]) == 0
        want = int(tok.documents(texts, prompt=prompt).lengths.sum())
        assert f"tokens: {want:,} real" in capsys.readouterr().out


async def test_token_output_runs_are_timed_apart_from_pooled_ones(make_server, tiny_enc):
    """/embed_all's batches run other executables than the pooled ones of the same shape: their times refresh
    the token outputs' predictions only (before, one LiveTimings per shape skewed /v1/plan's)."""
    from jaxserve.http.state import STATE

    client = await make_server(tiny_enc)  # embed_all on: token outputs compiled for TEI's /embed_all
    timings = client.app[STATE].service.timings
    runs = lambda lane: sum(timings[lane].live_runs(b) for b in TINY_TABLE.buckets)
    assert (runs("pooled"), runs("tokens")) == (0, 0)
    assert (await client.post("/embed_all", json={"inputs": ["the model", "a batch"]})).status == 200
    assert runs("pooled") == 0 and runs("tokens") >= 1
    tokens = runs("tokens")
    assert (await client.post("/embed", json={"inputs": ["the model", "a batch"]})).status == 200
    assert runs("pooled") >= 1 and runs("tokens") == tokens
