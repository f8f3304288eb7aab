"""The loader's errors: each names what it found."""

import json
import os

import jax
import numpy as np
import pytest
from conftest import TINY_TABLE, warm_encoder
from safetensors.numpy import load_file, save_file

from jaxserve import Encoder
from jaxserve.errors import CheckpointError
from jaxserve.http.server import AppState, ServerConfig
from jaxserve.runtime.buckets import fixed


def test_missing_weights(tiny_checkpoint):
    path = tiny_checkpoint()
    os.remove(path / "model.safetensors")
    (path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors \(found: .*pytorch_model\.bin"):
        warm_encoder(path, TINY_TABLE)


@pytest.mark.parametrize("name", ["/etc/hostname", "../outside.safetensors"])
def test_an_index_naming_a_file_outside_the_checkpoint_is_refused(tiny_checkpoint, name):
    """A shard index (or modules.json) is the checkpoint's word on its own files: a name leading out of its
    directory is refused, not read as weights (a hub repository would read the server's local files)."""
    path = tiny_checkpoint()
    os.replace(path / "model.safetensors", path / "shard.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "shard.safetensors",
                                                                                  "b": name}}))
    with pytest.raises(CheckpointError, match="outside the checkpoint's directory"):
        Encoder.from_pretrained(str(path))


def test_shards_linked_to_blobs_outside_the_snapshot_load(tiny_checkpoint, tmp_path):
    """A hub snapshot links each file to its blob (`snapshots/<rev>/x -> ../../blobs/<hash>`): a shard the index
    names is the snapshot's own file, wherever its link leads."""
    path = tiny_checkpoint()
    expected = Encoder.from_pretrained(str(path)).embed(["the model is jax"])
    (tmp_path / "blobs").mkdir()
    os.replace(path / "model.safetensors", tmp_path / "blobs" / "0123abcd")
    (path / "shard.safetensors").symlink_to(os.path.relpath(tmp_path / "blobs" / "0123abcd", path))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "shard.safetensors"}}))
    np.testing.assert_allclose(Encoder.from_pretrained(str(path)).embed(["the model is jax"]), expected, atol=1e-6)


def test_missing_config(tiny_checkpoint):
    path = tiny_checkpoint()
    os.remove(path / "config.json")
    with pytest.raises(CheckpointError, match=r"no config\.json \(found: .*model\.safetensors"):
        warm_encoder(path, TINY_TABLE)


def test_unknown_architecture(tiny_checkpoint):
    path = tiny_checkpoint(model_type="bert", architectures=["GPT2LMHeadModel"])
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"unsupported model_type 'gpt2'.*GPT2LMHeadModel"):
        warm_encoder(path, TINY_TABLE)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.pop("hidden_size"), "lacks integer field.*hidden_size"),
        (lambda c: c.update(num_attention_heads=5), "not divisible"),
        (lambda c: c.update(hidden_act="mystery"), "unsupported hidden_act 'mystery'"),
        (lambda c: c.update(position_embedding_type="rotary"), "position_embedding_type 'rotary'"),
    ],
)
def test_bad_config(tiny_checkpoint, edit, message):
    path = tiny_checkpoint()
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        warm_encoder(path, TINY_TABLE)


def test_config_not_json(tiny_checkpoint):
    path = tiny_checkpoint()
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"cannot read .*config\.json"):
        warm_encoder(path, TINY_TABLE)


def test_config_disagrees_with_weights(tiny_checkpoint):
    path = tiny_checkpoint()
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"intermediate\.dense\.weight: shape \(32, 64\) does not fit"):
        warm_encoder(path, TINY_TABLE)


def test_missing_and_unknown_tensors_are_named(tiny_checkpoint):
    path = tiny_checkpoint()
    tensors = load_file(path / "model.safetensors")
    del tensors["encoder.layer.1.output.dense.bias"]
    tensors["encoder.layer.1.adapter.weight"] = np.zeros(3, np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        warm_encoder(path, TINY_TABLE)
    assert "missing encoder.layer.1.output.dense.bias" in str(err.value)
    assert "unknown tensors encoder.layer.1.adapter.weight" in str(err.value)


def test_prefixed_task_checkpoint_loads(tiny_checkpoint):
    """`bert.`-prefixed tensors (as in *ForSequenceClassification checkpoints) load the same encoder."""
    path = tiny_checkpoint()
    plain = warm_encoder(path, TINY_TABLE).embed(["the model"])
    tensors = load_file(path / "model.safetensors")
    prefixed = {f"bert.{k}": v for k, v in tensors.items()}
    prefixed["classifier.weight"] = np.zeros((2, 32), np.float32)
    save_file(prefixed, str(path / "model.safetensors"))
    np.testing.assert_allclose(warm_encoder(path, TINY_TABLE).embed(["the model"]), plain, atol=1e-6)


@pytest.mark.parametrize("pooling, message", [
    ({"pooling_mode": "median"}, "unsupported pooling config"),
    ({}, "unsupported pooling config"),
    ({"pooling_mode_mean_tokens": True, "include_prompt": False}, "include_prompt: false"),
])
def test_unsupported_pooling(tiny_checkpoint, pooling, message):
    path = tiny_checkpoint()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(CheckpointError, match=message):
        warm_encoder(path, TINY_TABLE)


def test_unknown_module_and_dense_activation_are_clear_errors(tiny_checkpoint):
    path = tiny_checkpoint()
    modules = json.loads((path / "modules.json").read_text())
    (path / "modules.json").write_text(json.dumps(modules + [{"idx": 9, "name": "9", "path": "9_X",
                                                               "type": "sentence_transformers.models.LayerNorm"}]))
    with pytest.raises(CheckpointError, match="LayerNorm.*cannot run"):
        warm_encoder(path, TINY_TABLE)
    (path / "modules.json").write_text(json.dumps(modules[:2] + [{"idx": 2, "name": "2", "path": "2_Dense",
                                                                  "type": "sentence_transformers.models.Dense"}]))
    (path / "2_Dense").mkdir()
    (path / "2_Dense" / "config.json").write_text(json.dumps({"in_features": 32, "out_features": 8,
                                                               "activation_function": "my.Activation"}))
    with pytest.raises(CheckpointError, match="my.Activation"):
        warm_encoder(path, TINY_TABLE)


def test_not_a_directory(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        Encoder.from_pretrained(str(tmp_path / "file.txt"))


def test_hub_id_offline_gives_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match=r"could not fetch 'BAAI/bge-small-en-v1\.5' from the Hugging Face Hub"):
        Encoder.from_pretrained("BAAI/bge-small-en-v1.5")


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        Encoder.from_pretrained(None, dtype="int8")


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Encoder.from_pretrained(str(tmp_path / "nope"))


def test_unnamed_model_comes_from_jaxserve_model_env(tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint()
    monkeypatch.setenv("JAXSERVE_MODEL", str(path))
    enc = warm_encoder(None, TINY_TABLE)
    assert enc.path == path and enc.model_config.hidden_size == 32
    assert AppState(ServerConfig(), None).model_name == str(path)  # what responses report as `model`
    monkeypatch.setenv("JAXSERVE_MODEL", str(path / "nope"))
    with pytest.raises(CheckpointError, match="does not exist"):
        Encoder.from_pretrained(None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bfloat16_checkpoint_loads(tiny_checkpoint, dtype):
    """A checkpoint stored in bfloat16 (as Qwen3-Embedding ships) embeds as the float32 checkpoint of the
    same values does: safetensors.numpy reads BF16 once ml_dtypes is imported (jax imports it)."""
    import ml_dtypes

    path = tiny_checkpoint(pooling="mean")
    as_bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(path / "model.safetensors").items()}
    save_file(as_bf16, str(path / "model.safetensors"))
    raw = (path / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    reference = tiny_checkpoint("f32", pooling="mean")
    save_file({k: v.astype(np.float32) for k, v in as_bf16.items()}, str(reference / "model.safetensors"))

    # one shape per seqlen, one sequence per row: the same batches for both whatever their buckets' timings (on a
    # packed table the timed packing width and batch sizes could differ between the two under a loaded host, and
    # bfloat16 sums in another order differ by ~1e-3)
    table = fixed([(4, 16), (4, 64)])
    got = Encoder.from_pretrained(str(path), dtype=dtype, buckets=table)
    want = Encoder.from_pretrained(str(reference), dtype=dtype, buckets=table)
    texts = ["the model", "a batch of jax documents", "x"]
    # the same values, but two compiles: float32 matmuls may differ in the last bit (bf16 rounding moves them ~1e-3)
    np.testing.assert_allclose(got.embed(texts), want.embed(texts), rtol=1e-6, atol=1e-7)
    assert {str(x.dtype) for x in jax.tree.leaves(got.params)} == {dtype}
