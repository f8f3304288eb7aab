"""The warm artifact: a restart from it compiles nothing and serves the same table; a bad one is never used."""

import hashlib
import json
import logging
import os
import pickle
import stat
import threading
from pathlib import Path

import numpy as np
import pytest

from jaxserve import Encoder
from jaxserve.runtime import artifact, compiles, host, startup
from jaxserve.runtime.buckets import fixed
from jaxserve.runtime.derivation import TableOptions

OPTIONS = TableOptions(seqlens=(16, 64), max_batch=16)
# derived tables of one and two buckets: for tests of what an artifact's key holds, not of what a derivation makes
SMALL, SMALL2 = (TableOptions(seqlens=(64,), max_batch=batch) for batch in (1, 2))
TEXTS = ["the model is jax", "a query", "the " * 40]
# one-bucket tables (the tiny model's length is 64): a start at each compiles one executable
ONE, TWO, THREE, FOUR = (fixed([(batch, 64)]) for batch in (1, 2, 3, 4))


def warm(path, cache, options=OPTIONS, tokens=True):
    enc = Encoder.from_pretrained(str(path))
    started = startup.Startup()
    before = compiles.xla_compiles_total()
    table = startup.start(enc, options, tokens=tokens, cache=cache, startup=started)
    return enc, table, started, compiles.xla_compiles_total() - before


def files(cache):
    return sorted((cache / "warm").glob("*" + artifact.SUFFIX))


def start_at(path, cache, table, **kw):
    """A fresh encoder started at a given table through `cache`, and what start-up did."""
    enc = Encoder.from_pretrained(str(path))
    started = startup.Startup()
    startup.start(enc, table, cache=cache, startup=started, **kw)
    return enc, started


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
    warm(path, cache, ONE, tokens=False)
    (good,) = files(cache)
    raw = bytearray(good.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    good.write_bytes(bytes(raw))
    with caplog.at_level(logging.INFO, logger="jaxserve.runtime.startup"):
        _, _, started, built = warm(path, cache, ONE, tokens=False)
    assert built > 0 and "corrupt" in started.source["artifact_skipped"] and "corrupt" in caplog.text
    assert warm(path, cache, ONE, tokens=False)[3] == 0  # the rebuilt artifact replaced it
    good.write_bytes(good.read_bytes()[:1000])
    _, _, started, built = warm(path, cache, ONE, tokens=False)
    assert built > 0 and "corrupt" in started.source["artifact_skipped"]
    good.write_bytes(b"not an artifact\n")
    assert "not a jaxserve warm artifact" in warm(path, cache, ONE, tokens=False)[2].source["artifact_skipped"]


def test_a_header_claiming_a_huge_payload_is_corrupt_and_never_allocated(tiny_checkpoint, tmp_path):
    """The payload's size is checked against the file's before it is read: a corrupt `bytes` field (2**60) made
    the start fail with MemoryError instead of starting cold."""
    path, cache = tiny_checkpoint(), tmp_path / "cache"
    warm(path, cache, ONE, tokens=False)
    (good,) = files(cache)
    raw = good.read_bytes()
    end = raw.index(b"\n", len(artifact.MAGIC))
    header = json.loads(raw[len(artifact.MAGIC):end])
    good.write_bytes(artifact.MAGIC + json.dumps({**header, "bytes": 2**60}).encode() + raw[end:])
    _, _, started, built = warm(path, cache, ONE, tokens=False)
    assert built > 0 and f"its header says {2**60} bytes" in started.source["artifact_skipped"]


def test_a_stale_artifact_is_never_used_and_the_log_says_what_changed(tiny_checkpoint, tmp_path, monkeypatch):
    import jax

    path, cache = tiny_checkpoint(), tmp_path / "cache"
    warm(path, cache, SMALL, tokens=False)
    _, _, started, built = warm(path, cache, SMALL2, tokens=False)
    assert built > 0 and "differs in table" in started.source["artifact_skipped"]
    monkeypatch.setattr(jax, "__version__", "0.0.1")
    _, _, started, built = warm(path, cache, SMALL, tokens=False)
    assert built > 0 and "jax (" in started.source["artifact_skipped"]
    monkeypatch.undo()
    config = json.loads((path / "config.json").read_text())
    config["layer_norm_eps"] = 1e-6  # changes what the model computes
    (path / "config.json").write_text(json.dumps(config))
    _, _, started, built = warm(path, cache, SMALL, tokens=False)
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


def test_a_linked_module_folder_is_in_the_key_and_a_path_leading_outside_is_refused(tiny_checkpoint, tmp_path):
    """The digest hashes what the loader reads, through links: a module folder linked within the checkpoint or
    from outside it (a variant of a model linking the other's folders) by the files it reaches, so relinking it or
    editing its config (another pooling) is a stale artifact, not the old vectors (before, a linked folder was not
    walked: 0 compiles and the old pooling's vectors); a modules.json path that leads out (absolute, `..`) or is
    hidden is refused, as a shard's is."""
    from jaxserve.errors import CheckpointError

    path, cache = tiny_checkpoint(), tmp_path / "cache"
    cls = tiny_checkpoint("cls", pooling="cls")
    (path / "1_Pooling").rename(path / "pool_mean")
    (cls / "1_Pooling").rename(path / "pool_cls")
    (path / "1_Pooling").symlink_to("pool_mean", target_is_directory=True)
    warm(path, cache, SMALL, tokens=False)
    digest = artifact.model_digest(path)
    (path / "1_Pooling").unlink()
    (path / "1_Pooling").symlink_to("pool_cls", target_is_directory=True)
    assert artifact.model_digest(path) != digest
    enc, _, started, built = warm(path, cache, SMALL, tokens=False)
    assert built > 0 and "model (" in started.source["artifact_skipped"] and enc.embedding_config.pooling == "cls"

    (path / "1_Pooling").unlink()
    (path / "pool_cls").rename(tmp_path / "pool_ext")
    (path / "1_Pooling").symlink_to(tmp_path / "pool_ext", target_is_directory=True)
    digest = artifact.model_digest(path)
    assert Encoder.from_pretrained(str(path)).embedding_config.pooling == "cls"
    config = json.loads((tmp_path / "pool_ext" / "config.json").read_text())
    (tmp_path / "pool_ext" / "config.json").write_text(json.dumps(
        {**config, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    assert artifact.model_digest(path) != digest
    (path / "loop").symlink_to(path, target_is_directory=True)  # a link back up: walked once
    assert artifact.model_digest(path)
    modules = json.loads((path / "modules.json").read_text())
    for name in (str(tmp_path / "pool_ext"), "../cls/1_Pooling", ".hidden"):
        (path / "modules.json").write_text(json.dumps([{**m, "path": name} if m["path"] == "1_Pooling" else m
                                                       for m in modules]))
        with pytest.raises(CheckpointError, match="Pooling module names"):
            Encoder.from_pretrained(str(path))


def test_two_writers_at_once_leave_one_whole_artifact(tiny_checkpoint, tmp_path):
    path, cache = tiny_checkpoint(), tmp_path / "cache"
    enc, _, _, _ = warm(path, cache, ONE, tokens=False)
    fields = artifact.key_fields(enc, ONE, ("pooled",))
    threads = [threading.Thread(target=artifact.save, args=(cache / "warm", enc, fields)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [p.name for p in (cache / "warm").iterdir()] == [p.name for p in files(cache)]  # no temporaries left
    assert warm(path, cache, ONE, tokens=False)[3] == 0


def test_a_save_that_died_leaves_no_temporary_file_for_long(tiny_checkpoint, tmp_path):
    """A save killed mid-write leaves its temporary file: the next save of the model deletes it once it is
    `STALE_TEMPORARY_S` old, and leaves a fresh one (another server's save under way) and another model's."""
    path, cache = tiny_checkpoint(), tmp_path / "cache"
    enc, _, _, _ = warm(path, cache, ONE, tokens=False)
    (saved,) = files(cache)
    dead, live, theirs = (cache / "warm" / f"{name}{artifact.SUFFIX}.x{i}.tmp"
                          for i, name in enumerate((saved.stem, saved.stem, "other-" + "0" * 24)))
    for file in (dead, live, theirs):
        file.write_bytes(artifact.MAGIC)
    old = os.stat(saved).st_mtime - artifact.STALE_TEMPORARY_S - 60
    for file in (dead, theirs):
        os.utime(file, (old, old))
    removed = artifact.prune(cache / "warm", enc, protect=saved)
    assert removed == [dead] and live.exists() and theirs.exists() and files(cache) == [saved]


def test_no_cache_reads_and_writes_nothing(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "default"))
    _, _, started, built = warm(tiny_checkpoint(), None, SMALL, tokens=False)
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
    table = first.start(SMALL, cache=cache)
    second = Encoder.from_pretrained(str(path))
    before = compiles.xla_compiles_total()
    assert second.start(SMALL, cache=cache) == table and compiles.xla_compiles_total() == before


def test_encoder_start_uses_the_artifact_jaxserve_warmup_makes_with_token_outputs(tiny_checkpoint, tmp_path):
    """`jaxserve warmup` and `serve` ready /embed_all's token outputs by default: an artifact holding more outputs
    than a start asks for serves it (it compiled again and saved a second artifact)."""
    path, cache = tiny_checkpoint(), tmp_path / "cache"
    _, table, _, _ = warm(path, cache, SMALL, tokens=True)  # as `jaxserve warmup` (--embed-all) makes it
    enc = Encoder.from_pretrained(str(path))
    before = compiles.xla_compiles_total()
    assert enc.start(SMALL, cache=cache) == table
    enc.embed_all(TEXTS)  # its token outputs came with the artifact too
    assert compiles.xla_compiles_total() == before and len(files(cache)) == 1


def test_no_artifact_is_made_from_executables_of_jaxs_persistent_cache(tiny_checkpoint, tmp_path):
    """Those serialize without their kernels on XLA CPU (the artifact's first run would fail): not saved."""
    import jax

    path = tiny_checkpoint()
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))  # what a user might enable
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # every compile stored, however quick
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    try:
        warm(path, None, ONE, tokens=False)  # fills JAX's cache
        enc, _, started, _ = warm(path, tmp_path / "cache", ONE, tokens=False)  # its compiles are cache hits
    finally:
        from jax._src import compilation_cache

        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()
    assert "artifact_not_saved" in started.source and not files(tmp_path / "cache")
    assert enc.embed(TEXTS).shape == (3, 32)


def test_a_stale_artifact_is_judged_by_its_header_alone(tiny_checkpoint, tmp_path):
    """Which fields differ is read from the newest other artifact's JSON header: its payload is neither
    unpickled nor read (here there is none left to read)."""
    path, cache = tiny_checkpoint(), tmp_path / "cache"
    start_at(path, cache, ONE)
    (stale,) = files(cache)
    raw = stale.read_bytes()
    stale.write_bytes(raw[: raw.index(b"\n", len(artifact.MAGIC)) + 1])  # the magic and header lines only
    _, started = start_at(path, cache, TWO)
    assert f"({stale.name}) differs in table (file (" in started.source["artifact_skipped"]
    assert started.source["artifact_saved"]


def test_an_artifact_of_another_format_is_never_loaded_and_pruned_as_the_models_under_keep(tiny_checkpoint,
                                                                                          tmp_path):
    """An artifact of a jaxserve before the header (a checksum line, then the pickle) is not unpickled, even at
    the very path its key would have now. One of another format, older or newer (a rolling upgrade's), counts
    among the model's artifacts under `keep`, the oldest deleted first (all were deleted whatever `keep`); a newer
    one naming another checkpoint is that one's."""
    path, cache = tiny_checkpoint(), tmp_path / "cache"
    enc = Encoder.from_pretrained(str(path))
    target = artifact.path_for(cache / "warm", enc, artifact.key_fields(enc, ONE, ("pooled",)))
    target.parent.mkdir(parents=True)
    body = pickle.dumps({"key": {"format": 3}})
    old = artifact.MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body
    target.write_bytes(old)
    other, newer, theirs = (target.with_name(f"{path.name}-{c * 24}{artifact.SUFFIX}") for c in "012")
    other.write_bytes(old)
    for file, model in ((newer, str(path.resolve())), (theirs, str(tmp_path / "elsewhere" / path.name))):
        header = {"format": artifact.FORMAT + 1, "model_path": model, "key": {}}
        file.write_bytes(artifact.MAGIC + json.dumps(header).encode() + b"\n" + body)
    now = os.stat(target).st_mtime
    for age, file in ((300, other), (200, newer), (100, theirs)):
        os.utime(file, (now - age, now - age))
    _, started = start_at(path, cache, ONE)
    assert "stale (made by another jaxserve version: format before 4" in started.source["artifact_skipped"]
    assert target.read_bytes() != old and "artifacts_pruned" not in started.source  # 3 of this model's: kept
    _, started = start_at(path, cache, TWO)
    assert started.source["artifacts_pruned"] == [other.name]
    assert files(cache) == sorted([target, newer, theirs, Path(started.source["artifact_saved"])])
    assert start_at(path, cache, ONE)[1].source["source"] == "artifact"


@pytest.mark.parametrize("mode, owner, directory, refused", [
    (stat.S_IFREG | 0o644, 1000, False, None),
    (stat.S_IFREG | 0o600, 0, False, None),  # root's (an image built as root, served as another user)
    (stat.S_IFREG | 0o664, 1000, False, "group- or world-writable (mode 0664)"),
    (stat.S_IFREG | 0o646, 1000, False, "group- or world-writable (mode 0646)"),
    (stat.S_IFREG | 0o644, 4242, False, "owned by uid 4242, not by this server's user (uid 1000) or root"),
    (stat.S_IFIFO | 0o644, 1000, False, "not a regular file"),
    (stat.S_IFDIR | 0o755, 1000, False, "not a regular file"),
    (stat.S_IFDIR | 0o755, 1000, True, None),
    (stat.S_IFDIR | 0o775, 1000, True, "group- or world-writable (mode 0775) without the sticky bit"),
    (stat.S_IFDIR | 0o1777, 1000, True, None),  # as /tmp: no one else may replace or rename this user's files
    (stat.S_IFDIR | 0o1777, 4242, True, "owned by uid 4242"),
    (stat.S_IFREG | 0o644, 1000, True, "not a directory"),
])
def test_only_files_no_one_but_the_servers_user_or_root_could_write_are_trusted(mode, owner, directory, refused):
    why = artifact.untrusted(os.stat_result((mode, 0, 0, 1, owner, 0, 0, 0, 0, 0)), 1000, directory)
    assert why is None if refused is None else refused in why


def test_an_artifact_another_user_could_have_written_is_refused_before_it_is_read(tiny_checkpoint, tmp_path,
                                                                                  caplog, monkeypatch):
    """Refused with the reason logged as a warning, then a cold start; the start never fails for it."""
    path, cache = tiny_checkpoint(), tmp_path / "cache"
    start_at(path, cache, ONE)
    (good,) = files(cache)
    assert stat.S_IMODE(good.stat().st_mode) == 0o644 and stat.S_IMODE((cache / "warm").stat().st_mode) == 0o755
    good.chmod(0o664)
    with caplog.at_level(logging.WARNING, logger="jaxserve.runtime.startup"):
        _, started = start_at(path, cache, ONE)
    assert started.source["source"] == "file"
    assert "refused: the file is group- or world-writable (mode 0664)" in started.source["artifact_skipped"]
    assert "refused" in caplog.text
    # the cold start replaced it with its own, which the next start loads
    assert stat.S_IMODE(good.stat().st_mode) == 0o644 and start_at(path, cache, ONE)[1].source["source"] == "artifact"

    if os.geteuid() == 0:
        os.chown(good, 4242, -1)
    else:  # the server runs as someone else: its directory (checked first) and its file are another user's
        monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    _, started = start_at(path, cache, ONE)
    assert started.source["source"] == "file" and "is owned by uid" in started.source["artifact_skipped"]
    monkeypatch.undo()

    (cache / "warm").chmod(0o777)
    _, started = start_at(path, cache, ONE)
    assert "without the sticky bit" in started.source["artifact_skipped"] and "artifact_saved" not in started.source
    (cache / "warm").chmod(0o1777)
    assert start_at(path, cache, ONE)[1].source["source"] == "artifact"


def test_an_artifact_reached_by_a_link_is_refused(tiny_checkpoint, tmp_path):
    """A symbolic or hard link in the cache under an artifact's name is refused, not followed: the file it names
    may be this user's while another wrote its bytes (a download), and an artifact is unpickled. The server's own
    artifacts are written whole under their one name."""
    path, cache = tiny_checkpoint(), tmp_path / "cache"
    start_at(path, cache, ONE)
    (good,) = files(cache)
    elsewhere = tmp_path / "elsewhere.jaxwarm"
    good.rename(elsewhere)
    good.symlink_to(elsewhere)
    _, started = start_at(path, cache, ONE)
    assert started.source["source"] != "artifact" and "a symbolic link" in started.source["artifact_skipped"]
    good.unlink()
    os.link(elsewhere, good)
    _, started = start_at(path, cache, ONE)
    assert started.source["source"] != "artifact" and "2 names (hard links)" in started.source["artifact_skipped"]


def test_a_file_gone_between_listing_and_reading_is_passed_over(tiny_checkpoint, tmp_path):
    """A name listed in the cache with no file behind it any more (a dangling link here) is skipped, whether
    the other artifacts are read for the log or pruned."""
    path, cache = tiny_checkpoint(), tmp_path / "cache"
    start_at(path, cache, ONE)
    (first,) = files(cache)
    gone = cache / "warm" / f"{path.name}-{'f' * 24}{artifact.SUFFIX}"
    gone.symlink_to(tmp_path / "deleted meanwhile")
    enc, started = start_at(path, cache, TWO)
    assert f"({first.name}) differs in table" in started.source["artifact_skipped"]
    assert started.source["artifact_saved"]
    assert artifact.prune(cache / "warm", enc, keep=1, protect=Path(started.source["artifact_saved"])) == [first]


def test_a_load_that_fails_part_way_installs_nothing(tiny_checkpoint, tmp_path, monkeypatch):
    """The executables deserialized before the failure are dropped: the cold start compiles every bucket
    (none is silently taken from the failed load)."""
    from conftest import TINY_TABLE
    from jax.experimental import serialize_executable

    path, cache = tiny_checkpoint(), tmp_path / "cache"
    start_at(path, cache, TINY_TABLE)
    real, calls = serialize_executable.deserialize_and_load, []

    def second_fails(*args, **kw):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("injected: this executable does not load")
        return real(*args, **kw)

    monkeypatch.setattr(serialize_executable, "deserialize_and_load", second_fails)
    monkeypatch.setattr(host, "usable_cores", lambda: 1)  # loaded one at a time, in order
    enc, started = start_at(path, cache, TINY_TABLE)
    assert len(calls) >= 2 and "did not load (RuntimeError: injected" in started.source["artifact_skipped"]
    buckets = enc.engine.table.buckets
    assert len(buckets) == 4 and all(enc.engine.compile_s(b.batch, b.seqlen, b.slots) is not None for b in buckets)
    assert enc.embed(TEXTS).shape == (3, 32)


def test_each_save_keeps_the_models_newest_artifacts(tiny_checkpoint, tmp_path):
    """`keep` per model: this checkpoint directory's, whatever the key; another checkpoint of the same
    directory name keeps its own."""
    path, cache = tiny_checkpoint(), tmp_path / "cache"
    elsewhere = tiny_checkpoint("elsewhere/" + path.name)
    start_at(elsewhere, cache, FOUR, keep=1)
    (theirs,) = files(cache)
    saved = []
    for table in (ONE, TWO, THREE):
        _, started = start_at(path, cache, table, keep=2)
        saved.append(cache / "warm" / os.path.basename(started.source["artifact_saved"]))
    assert started.source["artifacts_pruned"] == [saved[0].name]
    assert files(cache) == sorted([theirs, *saved[1:]])
    assert start_at(path, cache, TWO)[1].source["source"] == "artifact"
    with pytest.raises(ValueError, match="at least 1"):
        start_at(path, cache, ONE, keep=0)


def test_the_flax_version_is_in_the_key(tiny_checkpoint, monkeypatch):
    """flax's nn.Dense, nn.Embed and nn.LayerNorm are traced into every executable."""
    import flax

    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    key = artifact.key_fields(enc, ONE, ("pooled",))
    monkeypatch.setattr(flax, "__version__", "0.0.1")
    assert artifact._differ(key, artifact.key_fields(enc, ONE, ("pooled",))) == [f"flax ({key['flax']} -> 0.0.1)"]


def test_every_flag_that_changes_an_executable_is_in_the_key(tiny_checkpoint, monkeypatch):
    """What XLA reads from the environment, and the JAX flags its trace and compile options read (however they
    were set), change the key; the log names the one that changed."""
    import jax

    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    key = artifact.key_fields(enc, ONE, ("pooled",))
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_latency_hiding_scheduler=true")
    assert artifact.key_fields(enc, ONE, ("pooled",))["env"] != key["env"]
    monkeypatch.delenv("LIBTPU_INIT_ARGS")
    for name, value in (("jax_compiler_enable_remat_pass", False), ("jax_optimization_level", "O1")):
        before = jax.config.values[name]
        jax.config.update(name, value)
        try:
            changed = artifact.key_fields(enc, ONE, ("pooled",))
        finally:
            jax.config.update(name, before)
        assert artifact._differ(key, changed) == [f"jax_flags ({name} ({before} -> {changed['jax_flags'][name]}))"]
    assert artifact.key_fields(enc, ONE, ("pooled",)) == key
