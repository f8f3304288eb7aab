"""Attention per bucket with a fallback: a bucket whose kernel fails to trace or compile is served by the
next implementation, with the reason recorded (engine, table, /info, warm artifact); `--attention` is plumbed."""

import logging

import numpy as np
import pytest

from jaxserve import Encoder, cli
from jaxserve.models.attention import Plan, xla_impl
from jaxserve.runtime import artifact, startup
from jaxserve.runtime.derivation import TableOptions

# head_dim 16 (the smallest the Pallas kernel takes); seqlen 128 is two of its 64-row tiles
CONFIG = dict(hidden_size=64, num_attention_heads=4, intermediate_size=64, max_position_embeddings=130)
OPTIONS = TableOptions(seqlens=(16, 64, 128), max_batch=2, batch_ladder=False, knee=False)
TEXTS = ["the model is jax", "a query", "the " * 40, "batch " * 100]


def failing_at(make_forward, impl: str, seqlen: int):
    """make_forward, except that `impl` at `seqlen` fails when traced (as a Triton error would)."""
    def make(slots, s, output, implementation):
        forward = make_forward(slots, s, output, implementation)
        if implementation == impl and s == seqlen:
            def broken(params, batch):
                raise RuntimeError(f"injected: {impl} does not compile at seqlen {s}\nsecond line")
            return broken
        return forward
    return make


@pytest.fixture
def model(tiny_checkpoint):
    return str(tiny_checkpoint(**CONFIG))


def test_a_bucket_whose_kernel_fails_is_served_by_the_next_with_the_reason(model, monkeypatch, caplog):
    """Forced pallas: seqlen 16 has no tile (static reason), 64 fails to compile (injected), 128 runs the
    kernel (Pallas' interpreter on CPU). Every bucket is served, and the vectors equal the xla path's."""
    enc = Encoder.from_pretrained(model, attention="pallas")
    monkeypatch.setattr(enc.engine, "_make_forward", failing_at(enc.engine._make_forward, "pallas", 64))
    with caplog.at_level(logging.WARNING, logger="jaxserve.runtime.engine"):
        table = enc.warmup(OPTIONS)
    by_seqlen = {b.seqlen: b for b in table.buckets}
    assert {s: b.attention for s, b in by_seqlen.items()} == {16: "dense", 64: "dense", 128: "pallas"}
    assert by_seqlen[16].attention_fallback.startswith("pallas: no tile of 128/64 rows divides seqlen 16")
    assert by_seqlen[64].attention_fallback == "pallas: RuntimeError: injected: pallas does not compile at seqlen 64"
    assert by_seqlen[128].attention_fallback == ""
    b = by_seqlen[64]
    assert enc.engine.attention_of(b.batch, b.seqlen, b.slots).implementation == "dense"
    assert "attention pallas failed to compile, trying dense" in caplog.text and "injected" in caplog.text
    reference = Encoder.from_pretrained(model, attention="xla")
    np.testing.assert_allclose(enc.embed(TEXTS), reference.embed(TEXTS), atol=2e-5)
    assert {b.attention for b in reference.warmup(OPTIONS).buckets} == {"dense"}


def test_a_bucket_out_of_memory_is_not_served_by_a_slower_kernel(model, monkeypatch):
    """Out of device memory (XLA's RESOURCE_EXHAUSTED) is the bucket's failure, not the kernel's: raised as it is,
    not hidden behind the next implementation (which the warm artifact would then keep for good)."""
    enc = Encoder.from_pretrained(model, attention="pallas")
    make_forward = enc.engine._make_forward

    def out_of_memory(slots, s, output, implementation):
        forward = make_forward(slots, s, output, implementation)
        if implementation == "pallas" and s == 128:
            def exhausted(params, batch):
                raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 81.92GiB")
            return exhausted
        return forward

    monkeypatch.setattr(enc.engine, "_make_forward", out_of_memory)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        enc.warmup(OPTIONS)


def test_cudnn_traced_on_a_cpu_falls_back_with_jaxs_own_error(model, monkeypatch):
    """No injection: cuDNN's kernel traced on a CPU backend raises in jax itself; the bucket still compiles."""
    enc = Encoder.from_pretrained(model, attention="cudnn")
    monkeypatch.setattr(enc.engine, "_plan", lambda seqlen: Plan(("cudnn", xla_impl(seqlen))))
    (bucket,) = enc.warmup(TableOptions(seqlens=(64,), max_batch=2, batch_ladder=False, knee=False)).buckets
    assert bucket.attention == "dense" and bucket.attention_fallback.startswith("cudnn: RuntimeError: cuDNN")
    (static,) = Encoder.from_pretrained(model, attention="cudnn").warmup(
        TableOptions(seqlens=(64,), max_batch=2, batch_ladder=False, knee=False)).buckets
    assert static.attention == "dense" and static.attention_fallback == "cudnn: needs a CUDA GPU (this is cpu)"


def test_the_warm_artifact_keeps_each_buckets_implementation_and_the_choice_keys_it(model, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    options = TableOptions(seqlens=(16, 64), max_batch=2, batch_ladder=False, knee=False)
    first = Encoder.from_pretrained(model, attention="pallas")
    monkeypatch.setattr(first.engine, "_make_forward", failing_at(first.engine._make_forward, "pallas", 64))
    table = startup.start(first, options, cache=cache)
    assert [b.attention for b in table.buckets] == ["dense", "dense"] and all(b.attention_fallback for b in table.buckets)

    second = Encoder.from_pretrained(model, attention="pallas")
    started = startup.Startup()
    loaded = startup.start(second, options, cache=cache, startup=started)
    assert started.source["source"] == "artifact" and loaded == table
    for b in table.buckets:
        assert second.engine.attention_of(b.batch, b.seqlen, b.slots) == first.engine.attention_of(b.batch, b.seqlen,
                                                                                                    b.slots)
    other = Encoder.from_pretrained(model, attention="blockwise")
    started = startup.Startup()
    assert {b.attention for b in startup.start(other, options, cache=cache, startup=started).buckets} == {"blockwise"}
    assert "differs in attention (pallas -> blockwise)" in started.source["artifact_skipped"]
    assert artifact.key_fields(other, options, ("pooled",))["attention"] == "blockwise"


async def test_info_lists_each_buckets_implementation(model, make_server):
    enc = Encoder.from_pretrained(model, attention="blockwise")
    enc.warmup(TableOptions(seqlens=(16, 64), max_batch=2, batch_ladder=False, knee=False))
    client = await make_server(enc, embed_all=False)
    body = await (await client.get("/info")).json()
    assert [b["attention"] for b in body["buckets"]["buckets"]] == ["blockwise", "blockwise"]
    assert body["attention"] == {"choice": "blockwise", "implementations": {"blockwise": 2}, "fallbacks": 0}


def test_attention_flag_reaches_the_encoder(model, capsys):
    args = ["warmup", "--model", model, "--no-cache", "--no-embed-all", "--seqlens", "16,64", "--max-batch", "2",
            "--batch-ladder", "off", "--throughput-knee", "off"]
    assert cli.main([*args, "--attention", "blockwise"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()[:2] in ("16", "64")]
    assert len(lines) == 2 and all(line.endswith(" blockwise") for line in lines)
    assert cli.main([*args, "--attention", "cudnn"]) == 0
    assert "dense (fell back: cudnn: needs a CUDA GPU (this is cpu))" in capsys.readouterr().out
    parser = cli.build_parser()
    for command in ("serve", "embed --input x --output y.npy", "buckets", "explain f", "demo"):
        assert parser.parse_args([*command.split(), "--attention", "xla"]).attention == "xla"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--attention", "flash"])
    with pytest.raises(ValueError, match="attention must be one of"):
        Encoder.from_pretrained(model, attention="flash")


def test_bench_attention_dry_run_records_every_case(tmp_path):
    """The GPU attention stage's CPU dry run: Pallas interpreted, cuDNN recorded unavailable (no crash), xla
    timed; each case's times are the median of >= 5 launches, errors measured against float32 dense."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "attention.json"
    root = Path(__file__).parent.parent
    proc = subprocess.run([sys.executable, str(root / "scripts/bench_attention.py"), "--dry-run", "--head-dims", "256",
                           "--seqlens", "64,96", "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr
    raw = json.loads(out.read_text())
    assert raw["dry_run"] and raw["platform"] == "cpu" and [c["seqlen"] for c in raw["cases"]] == [64, 96]
    at64, at96 = (c["results"] for c in raw["cases"])
    assert at64["pallas"]["tile"] == 64 and at64["pallas"]["ms"] > 0 and at64["pallas"]["max_abs_err"] < 3e-2
    assert at64["xla"]["implementation"] == "dense" and len(at64["xla"]["times_ms"]) >= 5
    assert at64["cudnn"]["ms"] is None and at64["cudnn"]["error"].startswith("unavailable: needs a CUDA GPU")
    assert at96["pallas"]["ms"] is None and at96["pallas"]["error"].startswith("unfit: no tile")
    assert "256     64" in proc.stdout and "best" in proc.stdout


def test_a_bucket_records_what_its_layers_ran():
    """A fused kernel takes only the layers it can express: a bucket with a windowed layer runs
    `pallas+dense`; one whose every layer is windowed runs dense, and says why pallas took none."""
    import jax.numpy as jnp

    from jaxserve.models.attention import FULL, Kernel, Masks, Spec, attend
    from jaxserve.runtime.engine import Engine

    def make(specs):
        def make_forward(slots, seqlen, output, implementation):
            def forward(params, batch):
                x = batch["token_ids"].astype(jnp.float32)[..., None, None] * params["w"]  # [B, S, 2, 16]
                masks = Masks(batch["segment_ids"], batch["positions"], slots > 1, Kernel(implementation, slots))
                return sum(attend(x, x, x, masks, spec) for spec in specs).sum(axis=(2, 3))
            return forward
        return make_forward

    params = {"w": jnp.ones((2, 16), jnp.float32)}
    plan = lambda seqlen: Plan(("pallas", xla_impl(seqlen)))  # noqa: E731
    mixed = Engine(make((FULL, Spec(window=4))), params, plan=plan)
    mixed.compile(1, 64, 2)
    assert mixed.attention_of(1, 64, 2) == ("pallas+dense", ())
    windowed = Engine(make((Spec(window=4),)), params, plan=plan)
    windowed.compile(1, 64, 2)
    assert windowed.attention_of(1, 64, 2) == (
        "dense", ("pallas: takes none of this model's layers (a score bias or a window it cannot express)",))
