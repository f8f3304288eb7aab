"""The warm artifact: a restart from it compiles nothing and serves the same table; a bad one is never used."""

import json
import logging
import threading

import numpy as np
import pytest

from jaxserve import Encoder
from jaxserve.runtime import artifact, compiles, startup
from jaxserve.runtime.derivation import TableOptions

OPTIONS = TableOptions(seqlens=(16, 64), max_batch=16)
TEXTS = ["the model is jax", "a query", "the " * 40]


def warm(path, cache, options=OPTIONS, tokens=True):
    enc = Encoder.from_pretrained(str(path))
    started = startup.Startup()
    before = compiles.xla_compiles_total()
    table = startup.start(enc, options, tokens=tokens, cache=cache, startup=started)
    return enc, table, started, compiles.xla_compiles_total() - before


def files(cache):
    return sorted((cache / "warm").glob("*" + artifact.SUFFIX))


def test_a_second_start_loads_the_artifact_compiles_nothing_and_serves_the_same_table(tiny_checkpoint, tmp_path):
    path, cache = tiny_checkpoint(), tmp_path / "cache"
    first, table, started, built = warm(path, cache)
    assert built > 0 and started.source["source"] == "derived" and len(files(cache)) == 1
    assert started.phases["compile"] > 0 and started.phases["timing"] > 0
    second, table2, started2, built2 = warm(path, cache)
    assert built2 == 0  # no tracing, lowering or compiling
    assert started2.source["source"] == "artifact" and set(started2.phases) == {"deserialize"}
    assert table2 == table and second.engine.tables["tokens"] == first.engine.tables["tokens"]  # timings included
    before = compiles.xla_compiles_total()
    np.testing.assert_allclose(second.embed(TEXTS), first.embed(TEXTS), atol=1e-6)
    for a, b in zip(second.embed_all(TEXTS), first.embed_all(TEXTS)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert compiles.xla_compiles_total() == before


def test_a_corrupt_or_truncated_artifact_is_skipped_with_its_reason_and_replaced(tiny_checkpoint, tmp_path, caplog):
    path, cache = tiny_checkpoint(), tmp_path / "cache"
    warm(path, cache, tokens=False)
    (good,) = files(cache)
    raw = bytearray(good.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    good.write_bytes(bytes(raw))
    with caplog.at_level(logging.INFO, logger="jaxserve.runtime.startup"):
        _, _, started, built = warm(path, cache, tokens=False)
    assert built > 0 and "corrupt" in started.source["artifact_skipped"] and "corrupt" in caplog.text
    assert warm(path, cache, tokens=False)[3] == 0  # the rebuilt artifact replaced it
    good.write_bytes(good.read_bytes()[:1000])
    _, _, started, built = warm(path, cache, tokens=False)
    assert built > 0 and "corrupt" in started.source["artifact_skipped"]
    good.write_bytes(b"not an artifact\n")
    assert "not a jaxserve warm artifact" in warm(path, cache, tokens=False)[2].source["artifact_skipped"]


def test_a_stale_artifact_is_never_used_and_the_log_says_what_changed(tiny_checkpoint, tmp_path, monkeypatch):
    import jax

    path, cache = tiny_checkpoint(), tmp_path / "cache"
    warm(path, cache, tokens=False)
    _, _, started, built = warm(path, cache, TableOptions(seqlens=(16, 64), max_batch=4), tokens=False)
    assert built > 0 and "differs in table" in started.source["artifact_skipped"]
    monkeypatch.setattr(jax, "__version__", "0.0.1")
    _, _, started, built = warm(path, cache, tokens=False)
    assert built > 0 and "jax (" in started.source["artifact_skipped"]
    monkeypatch.undo()
    config = json.loads((path / "config.json").read_text())
    config["layer_norm_eps"] = 1e-6  # changes what the model computes
    (path / "config.json").write_text(json.dumps(config))
    _, _, started, built = warm(path, cache, tokens=False)
    assert built > 0 and "model (" in started.source["artifact_skipped"]


def test_model_digest_follows_configs_and_weight_shapes_not_weight_values(tiny_checkpoint):
    from safetensors.numpy import load_file, save_file

    path = tiny_checkpoint()
    (weights,) = path.glob("*.safetensors")
    digest = artifact.model_digest(path)
    tensors = load_file(weights)
    save_file({k: v + 1 for k, v in tensors.items()}, weights)  # new values, same names, dtypes and shapes
    assert artifact.model_digest(path) == digest
    name = next(iter(tensors))
    save_file({**tensors, name: np.zeros((3, 3), tensors[name].dtype)}, weights)
    assert artifact.model_digest(path) != digest
    (path / "tokenizer.json").write_text((path / "tokenizer.json").read_text().replace("[UNK]", "[UNK]", 1) + " ")
    save_file(tensors, weights)
    assert artifact.model_digest(path) != digest  # any small file, whole


def test_two_writers_at_once_leave_one_whole_artifact(tiny_checkpoint, tmp_path):
    path, cache = tiny_checkpoint(), tmp_path / "cache"
    enc, _, _, _ = warm(path, cache, tokens=False)
    fields = artifact.key_fields(enc, OPTIONS, ("pooled",))
    threads = [threading.Thread(target=artifact.save, args=(cache / "warm", enc, fields)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [p.name for p in (cache / "warm").iterdir()] == [p.name for p in files(cache)]  # no temporaries left
    assert warm(path, cache, tokens=False)[3] == 0


def test_no_cache_reads_and_writes_nothing(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "default"))
    _, _, started, built = warm(tiny_checkpoint(), None, tokens=False)
    assert built > 0 and started.source == {"source": "derived"} and not (tmp_path / "default").exists()


def test_an_artifact_of_a_table_file_is_keyed_by_the_tables_content(tiny_checkpoint, tmp_path):
    from conftest import TINY_TABLE

    path, cache = tiny_checkpoint(), tmp_path / "cache"
    enc = Encoder.from_pretrained(str(path))
    startup.start(enc, TINY_TABLE, cache=cache)
    started = startup.Startup()
    enc2 = Encoder.from_pretrained(str(path))
    table = startup.start(enc2, TINY_TABLE, cache=cache, startup=started)
    assert started.source["source"] == "artifact" and [b.shape for b in table.buckets] == [b.shape for b in TINY_TABLE.buckets]
    with pytest.raises(artifact.Skipped, match="differs in table"):
        artifact.load(cache / "warm", enc2, artifact.key_fields(enc2, TINY_TABLE.__class__(
            TINY_TABLE.buckets[:2], layout="packed"), ("pooled",)))


def test_encoder_start_uses_the_artifact_the_server_would(tiny_checkpoint, tmp_path):
    path, cache = tiny_checkpoint(), tmp_path / "cache"
    first = Encoder.from_pretrained(str(path))
    table = first.start(OPTIONS, cache=cache)
    second = Encoder.from_pretrained(str(path))
    before = compiles.xla_compiles_total()
    assert second.start(OPTIONS, cache=cache) == table and compiles.xla_compiles_total() == before


def test_no_artifact_is_made_from_executables_of_jaxs_persistent_cache(tiny_checkpoint, tmp_path):
    """Those serialize without their kernels on XLA CPU (the artifact's first run would fail): not saved."""
    import jax

    path = tiny_checkpoint()
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))  # what a user might enable
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # every compile stored, however quick
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    try:
        warm(path, None, tokens=False)  # fills JAX's cache
        enc, _, started, _ = warm(path, tmp_path / "cache", tokens=False)  # its compiles are cache hits
    finally:
        from jax._src import compilation_cache

        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()
    assert "artifact_not_saved" in started.source and not files(tmp_path / "cache")
    assert enc.embed(TEXTS).shape == (3, 32)
