"""A given bucket table against the live pool: refused at warmup, naming what fails and what fits."""

import logging

import pytest
from conftest import TINY_TABLE

from jaxserve import Encoder
from jaxserve.runtime import device
from jaxserve.runtime.buckets import Bucket, TableTooLarge, batch_fitter, check_fits
from jaxserve.runtime.engine import compiled_bytes

GB = 10**9


def test_check_names_each_bucket_over_the_budget_and_the_batch_that_fits():
    # weights 1 GB, 0.5 GB per row at seqlen 512: a budget of 20 GB holds 38 rows, rounded to 8 -> 32
    table = [Bucket(64, 512, compiled_bytes=33 * GB), Bucket(16, 512, compiled_bytes=9 * GB),
             Bucket(4096, 16, compiled_bytes=5 * GB), Bucket(256, 4096, compiled_bytes=61 * GB)]
    with pytest.raises(TableTooLarge) as err:
        check_fits(table, 20 * GB, 1 * GB, batch_fitter(8, 1), "0.9 x a pool")
    msg = str(err.value)
    assert "2 bucket(s) need more than the budget of 20000000000 bytes (0.9 x a pool)" in msg
    assert "batch 64 x seqlen 512 needs 33000000000" in msg and "batch 256 x seqlen 4096 needs 61000000000" in msg
    assert "seqlen 512: batch 32" in msg and "seqlen 4096: batch 80" in msg  # (20 - 1) / (60 / 256) = 81 -> 80
    assert "seqlen 16" not in msg


def test_check_passes_a_table_within_the_budget_and_says_when_nothing_fits():
    check_fits([Bucket(8, 64, compiled_bytes=GB)], GB, GB // 2, batch_fitter(1, 1))
    with pytest.raises(TableTooLarge, match="seqlen 64: none"):
        check_fits([Bucket(8, 64, compiled_bytes=3 * GB)], GB, 2 * GB, batch_fitter(1, 1))


def test_table_file_over_the_live_pool_is_refused_at_warmup(tiny_checkpoint, monkeypatch, tmp_path):
    """The pool injected between two buckets' compiled figures: the larger is named, the warmup refused."""
    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    small = compiled_bytes(enc.engine.compile(1, 64, TINY_TABLE.at(64)[0].slots))
    large = compiled_bytes(enc.engine.compile(4, 64, TINY_TABLE.at(64)[0].slots))
    pool = int((small + large) / 2 / device.DEFAULT_HEADROOM)
    monkeypatch.setattr(device, "_memory_limit", lambda dev: pool)
    path = tmp_path / "table.json"
    TINY_TABLE.save(path)
    with pytest.raises(TableTooLarge, match=rf"batch 4 x seqlen 64 needs {large}.*seqlen 64: batch [123]\b"):
        Encoder.from_pretrained(str(tiny_checkpoint("again")), buckets=path)
    monkeypatch.setattr(device, "_memory_limit", lambda dev: 10 * large)
    assert Encoder.from_pretrained(str(tiny_checkpoint("again")), buckets=path).warm_table().max_seqlen == 64


def test_a_table_file_made_for_another_device_shows_this_pool(tiny_checkpoint, monkeypatch, tmp_path, caplog):
    """The memory figures a served table shows (/info, ?explain=1, /v1/plan) are the pool it is held to, not the
    device it was derived for (before: an H200 table served here said 141 GB)."""
    import dataclasses

    pool = 3 * GB
    monkeypatch.setattr(device, "_memory_limit", lambda dev: pool)
    path = tmp_path / "table.json"
    dataclasses.replace(TINY_TABLE, device="NVIDIA H200", device_memory=141 * GB, budget_bytes=127 * GB,
                        weights_bytes=1).save(path)
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        enc = Encoder.from_pretrained(str(tiny_checkpoint()), buckets=path)
    table = enc.warm_table()
    here = device.describe()
    assert (table.device, table.device_memory) == (here.kind, pool) != ("NVIDIA H200", 141 * GB)
    assert table.budget_bytes == device.budget_bytes(pool, device.DEFAULT_HEADROOM)
    assert table.weights_bytes == enc.engine.weights_bytes > 1
    assert any("derived for NVIDIA H200" in r.getMessage() for r in caplog.records)


def test_device_memory_above_the_live_pool_warns(monkeypatch, caplog):
    monkeypatch.setattr(device, "_memory_limit", lambda dev: 8 * GB)
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        assert device.describe(4 * GB).memory_bytes == 4 * GB
        assert not caplog.records
        assert device.describe(16 * GB).memory_bytes == 16 * GB
    (record,) = caplog.records
    assert "16000000000 bytes given, above this device's pool of 8000000000 bytes" in record.getMessage()


def test_a_climb_for_device_memory_above_the_live_pool_refuses_a_bucket_over_it_before_running_it(
        tiny_checkpoint, monkeypatch):
    """`--device-memory` above the live pool derives with that budget, and each candidate is checked against the
    live pool before it runs: one over it is refused as a given table's is (before: a bucket of 100x the pool
    was compiled, timed and served). Without the option the climb stays within the pool, and nothing is refused."""
    from jaxserve.runtime import warm
    from jaxserve.runtime.derivation import TableOptions

    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    slots = TINY_TABLE.at(64)[0].slots
    small = compiled_bytes(enc.engine.compile(1, 64, slots))
    large = compiled_bytes(enc.engine.compile(4, 64, slots))
    monkeypatch.setattr(device, "_memory_limit", lambda dev: int((small + large) / 2 / device.DEFAULT_HEADROOM))
    ran = []
    time_bucket = warm.time_bucket
    monkeypatch.setattr(warm, "time_bucket", lambda engine, bucket, output: ran.append(bucket.batch) or
                        time_bucket(engine, bucket, output))
    options = {"seqlens": (64,), "max_batch": 4, "max_batch_tokens": 10**6, "knee": False}
    with pytest.raises(TableTooLarge, match=rf"batch 4 x seqlen 64 needs {large}.*--device-memory"):
        enc.warmup(TableOptions(device_memory=100 * large, **options))
    assert ran == [1]
    assert enc.warmup(TableOptions(**options)).at(64)[-1].compiled_bytes <= device.budget_bytes(device.pool_bytes())
