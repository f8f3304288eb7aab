"""BGE-M3 whole, without torch: a tiny XLM-R saved by transformers, its two heads saved by `torch.save`, against a
reference written from FlagEmbedding's source.

jaxserve's side runs in a subprocess where torch cannot be imported (a `sys.meta_path` finder refuses it), so the
weights and heads are read by `jaxserve.checkpoint.torch_zip` alone; the reference runs here, in torch. The
subprocess warms the tiny table and saves its warm artifact in this run's cache, which the server test then loads.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import hf_tiny
import numpy as np
import pytest
from conftest import TINY_TABLE, cosine_rows
from hypothesis import given, settings
from hypothesis import strategies as st

HIDDEN, COLBERT_DIM, MAX_LENGTH = 32, 24, 64
TEXTS = [
    "the query is a document 中",  # an unknown character: <unk>, dropped from the sparse output
    "jax jax jax model batch of the model",  # repeated ids: the sparse output keeps each id's largest weight
    "a",
    "document, of the batch; and: the query!",
    " ".join(["model of the batch"] * 30),  # over MAX_LENGTH: truncated
]

NO_TORCH = """
import importlib.abc
import sys


class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"torch is blocked in this process ({name})")
        return None


sys.meta_path.insert(0, NoTorch())
"""

JAXSERVE_SIDE = NO_TORCH + """
import pickle

from jaxserve import Encoder
from jaxserve.runtime.buckets import BucketTable

path, table, texts, out = sys.argv[1:]
texts = json.loads(open(texts).read())
enc = Encoder.from_pretrained(path)
enc.start(BucketTable.load(table), tokens=True)
result = {"embed": enc.embed(texts), "m3": enc.embed_m3(texts), "sparse": enc.embed_sparse(texts),
          "multivector": enc.embed_multivector(texts), "dense_only": enc.embed_m3(texts, return_sparse=False,
          return_colbert_vecs=False), "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}
open(out, "wb").write(pickle.dumps(result))
"""


def write_m3(path: Path) -> Path:
    """A tiny BGE-M3 save laid out as the hub's BAAI/bge-m3: XLM-R by transformers, its weights as
    `pytorch_model.bin` (torch.save of its state dict; no safetensors), its tokenizer, and the heads as
    FlagEmbedding saves them (`torch.save(linear.state_dict(), ...)`; the sparse head in float16, as the hub's)."""
    import torch
    import transformers
    from safetensors.torch import load_file

    cfg = transformers.XLMRobertaConfig(
        vocab_size=len(hf_tiny.vocab("roberta")), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=MAX_LENGTH + 2, type_vocab_size=1, pad_token_id=1,
        bos_token_id=0, eos_token_id=2)
    hf_tiny.write(path, "XLMRobertaModel", cfg, "roberta", seed=7, scale=0.3)
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=hf_tiny.make_tokenizer("roberta"), bos_token="<s>", eos_token="</s>", cls_token="<s>",
        sep_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>", model_max_length=MAX_LENGTH,
    ).save_pretrained(path)
    torch.manual_seed(13)  # a sparse head under which most tokens, not all, have a positive weight
    torch.save(torch.nn.Linear(HIDDEN, COLBERT_DIM).state_dict(), path / "colbert_linear.pt")
    torch.save(torch.nn.Linear(HIDDEN, 1).half().state_dict(), path / "sparse_linear.pt")
    return path


def flag_reference(path: Path, texts: list[str]) -> dict:
    """BGE-M3's three outputs as FlagEmbedding computes them, in torch, written from its source
    (FlagOpen/FlagEmbedding @ 7ed43d6): the heads as `EncoderOnlyEmbedderM3Runner.get_model` builds and loads them
    (finetune/embedder/encoder_only/m3/runner.py), the forward as `EncoderOnlyEmbedderM3ModelForInference.forward`
    (`_dense_embedding` cls, `_sparse_embedding` relu of sparse_linear, `_colbert_embedding` on
    `last_hidden_state[:, 1:]` masked, both normalised: finetune/embedder/encoder_only/m3/modeling.py), and the
    host side as `M3Embedder.encode_single_device`'s `_process_token_weights` and `_process_colbert_vecs`
    (inference/embedder/encoder_only/m3.py). A padded batch, as there."""
    import torch
    import torch.nn.functional as F
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    colbert_linear = torch.nn.Linear(HIDDEN, COLBERT_DIM)
    sparse_linear = torch.nn.Linear(HIDDEN, 1)
    colbert_linear.load_state_dict(torch.load(path / "colbert_linear.pt", map_location="cpu", weights_only=True))
    sparse_linear.load_state_dict(torch.load(path / "sparse_linear.pt", map_location="cpu", weights_only=True))
    inputs = tokenizer(texts, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    with torch.no_grad():
        last = model(**inputs, return_dict=True).last_hidden_state
        dense = F.normalize(last[:, 0], dim=-1)
        token_weights = torch.relu(sparse_linear(last)).squeeze(-1)
        colbert = colbert_linear(last[:, 1:]) * inputs["attention_mask"][:, 1:][:, :, None].float()
        colbert = F.normalize(colbert, dim=-1)

    unused = {tokenizer.convert_tokens_to_ids(tokenizer.special_tokens_map[t])
              for t in ("cls_token", "eos_token", "pad_token", "unk_token") if t in tokenizer.special_tokens_map}

    def process_token_weights(weights, input_ids):
        result = {}
        for w, idx in zip(weights, input_ids):
            if idx not in unused and w > 0 and w > result.get(str(idx), 0):
                result[str(idx)] = w
        return result

    lexical = [process_token_weights(w.numpy(), ids) for w, ids in zip(token_weights, inputs["input_ids"].tolist())]
    colbert_vecs = [c.numpy()[: int(m.sum()) - 1] for c, m in zip(colbert, inputs["attention_mask"])]
    return {"dense_vecs": dense.numpy(), "lexical_weights": lexical, "colbert_vecs": colbert_vecs,
            "unused": unused, "input_ids": inputs["input_ids"]}


@pytest.fixture(scope="module")
def m3_path(tmp_path_factory) -> Path:
    return write_m3(tmp_path_factory.mktemp("m3") / "bge-m3-tiny")


@pytest.fixture(scope="module")
def reference(m3_path) -> dict:
    return flag_reference(m3_path, TEXTS)


@pytest.fixture(scope="module")
def served(m3_path, tmp_path_factory) -> dict:
    """jaxserve's outputs, computed in a process where torch cannot be imported."""
    work = tmp_path_factory.mktemp("m3-run")
    TINY_TABLE.save(work / "table.json")
    (work / "texts.json").write_text(json.dumps(TEXTS))
    script = "import json\nimport sys\n" + JAXSERVE_SIDE
    run = subprocess.run([sys.executable, "-c", script, str(m3_path), str(work / "table.json"),
                          str(work / "texts.json"), str(work / "out.pkl")], check=False, capture_output=True, text=True,
                         cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stderr[-4000:]
    return pickle.loads((work / "out.pkl").read_bytes())


def test_runs_without_torch(served):
    assert served["torch"] == []


def test_dense_matches_flagembedding(served, reference):
    want = reference["dense_vecs"]
    for got in (served["m3"]["dense_vecs"], served["embed"], served["dense_only"]["dense_vecs"]):
        assert got.shape == want.shape
        assert cosine_rows(got, want).min() >= 0.9999
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert served["dense_only"]["lexical_weights"] is None and served["dense_only"]["colbert_vecs"] is None


def test_colbert_vectors_match_flagembedding(served, reference):
    for got_all in (served["m3"]["colbert_vecs"], served["multivector"]):
        assert len(got_all) == len(TEXTS)
        for got, want in zip(got_all, reference["colbert_vecs"]):
            assert got.shape == want.shape == (len(want), COLBERT_DIM)
            assert cosine_rows(got, want).min() >= 0.9999
    assert len(served["multivector"][-1]) == MAX_LENGTH - 1  # the truncated text: every token after CLS


def test_sparse_matches_flagembedding(served, reference):
    for got, want in zip(served["m3"]["lexical_weights"], reference["lexical_weights"]):
        assert list(got) == sorted(got, key=int)  # id order
        assert set(got) == set(want)
        np.testing.assert_allclose([got[k] for k in want], [float(v) for v in want.values()], atol=1e-4)
    # the cases are there: dropped tokens present, repeated ids folded to one weight, zero weights left out
    assert reference["unused"] <= set(reference["input_ids"].flatten().tolist())
    assert all(str(i) not in got for got in served["m3"]["lexical_weights"] for i in reference["unused"])
    ids = [set(row.tolist()) - reference["unused"] for row in reference["input_ids"]]
    assert len(ids[4]) < (reference["input_ids"][4] > 3).sum() and served["m3"]["lexical_weights"][4]
    assert any(len(got) < len(i) for got, i in zip(served["m3"]["lexical_weights"], ids))
    # embed_sparse: the same weights in TEI's shape
    for records, lexical in zip(served["sparse"], served["m3"]["lexical_weights"]):
        assert [(str(r["index"]), r["value"]) for r in records] == list(lexical.items())


async def test_server_returns_all_three_in_one_request(m3_path, served, reference, make_server):
    from jaxserve import Encoder

    enc = Encoder.from_pretrained(str(m3_path))
    enc.start(TINY_TABLE, tokens=True)  # the subprocess's warm artifact, where jaxserve's source has not changed since
    client = await make_server(enc)

    resp = await client.post("/embed_m3", json={"inputs": TEXTS})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert set(body) == {"dense_vecs", "lexical_weights", "colbert_vecs"}
    assert cosine_rows(np.asarray(body["dense_vecs"]), reference["dense_vecs"]).min() >= 0.9999
    for got, want in zip(body["colbert_vecs"], reference["colbert_vecs"]):
        assert cosine_rows(np.asarray(got), want).min() >= 0.9999
    for got, want in zip(body["lexical_weights"], reference["lexical_weights"]):
        assert set(got) == set(want)
        np.testing.assert_allclose([got[k] for k in want], [float(v) for v in want.values()], atol=1e-4)

    resp = await client.post("/embed_m3", json={"inputs": "the query", "return_dense": False,
                                                "return_colbert_vecs": False})
    body = await resp.json()
    assert body["dense_vecs"] is None and body["colbert_vecs"] is None and len(body["lexical_weights"]) == 1

    resp = await client.post("/embed_sparse", json={"inputs": TEXTS})
    assert resp.status == 200
    assert await resp.json() == served["sparse"]
    resp = await client.post("/embed", json={"inputs": TEXTS})
    assert cosine_rows(np.asarray(await resp.json()), reference["dense_vecs"]).min() >= 0.9999

    for payload, route in (({"inputs": "a", "return_dense": False, "return_sparse": False,
                             "return_colbert_vecs": False}, "/embed_m3"),
                           ({"inputs": "a", "return_sparse": "yes"}, "/embed_m3"),
                           ({"inputs": "a", "long": "chunk"}, "/embed_m3"),
                           ({"inputs": "a"}, "/embed_all")):
        resp = await client.post(route, json=payload)
        assert resp.status == 422, (payload, await resp.text())  # TEI's code and shape for a bad request
        assert (await resp.json())["error_type"] == "Validation"


def test_not_a_bge_m3_checkpoint(tiny_checkpoint):
    """The heads' files make a checkpoint BGE-M3; without them embed_m3 says so."""
    from jaxserve import Encoder
    from jaxserve.errors import InputError

    enc = Encoder.from_pretrained(str(tiny_checkpoint()))
    assert enc.m3 is None
    with pytest.raises(InputError, match="not a BGE-M3 model"):
        enc.embed_m3(["a"])


def test_hub_download_fetches_torch_weights_only_without_safetensors(tmp_path, monkeypatch):
    """BAAI/bge-m3 has no safetensors: its pytorch_model.bin comes in a second fetch, with the heads."""
    import huggingface_hub

    from jaxserve.checkpoint import loader

    asked = []

    def snapshot_download(repo_id, allow_patterns):
        asked.append(list(allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert loader.resolve("BAAI/bge-m3") == tmp_path
    assert len(asked) == 2 and "pytorch_model.bin" in asked[1] and "pytorch_model.bin" not in asked[0]
    assert {"colbert_linear.pt", "sparse_linear.pt"} <= set(asked[0])
    (tmp_path / "model.safetensors").write_bytes(b"")
    asked.clear()
    loader.resolve("BAAI/bge-m3")
    assert len(asked) == 1


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_pytorch_model_bin_carrying_a_payload_is_refused_at_load(tiny_checkpoint, tmp_path):
    """Weights from pytorch_model.bin go through the same restricted reader: a pickled call is named, never run."""
    import torch
    from safetensors.numpy import load_file

    from jaxserve import Encoder
    from jaxserve.errors import CheckpointError

    path = tiny_checkpoint()
    state = {k: torch.from_numpy(v) for k, v in load_file(path / "model.safetensors").items()}
    (path / "model.safetensors").unlink()
    torch.save({**state, "extra": _Payload(tmp_path / "ran")}, path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors .*names posix\.system"):
        Encoder.from_pretrained(str(path))
    assert not (tmp_path / "ran").exists()
    torch.save(state, path / "pytorch_model.bin")  # the same weights without it load
    assert Encoder.from_pretrained(str(path)).m3 is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 12), st.sampled_from([-1.0, 0.0, 0.25, 0.5, 0.75, 2.0])),
                         max_size=12), max_size=6))
def test_sparse_folding_is_flagembeddings_loop(sequences):
    """`bge_m3.sparse`, vectorised over every sequence at once, against `_process_token_weights`' loop."""
    from jaxserve.checkpoint.config import DenseLayer
    from jaxserve.heads import bge_m3

    m3 = bge_m3.M3Config(4, DenseLayer("c", 4, 4, True, "identity"), DenseLayer("s", 4, 1, True, "relu"), (0, 2, 3))
    ids = np.array([i for s in sequences for i, _ in s], np.int32)
    weights = np.array([w for s in sequences for _, w in s], np.float32)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in sequences])]).astype(np.int64)
    got = bge_m3.lexical_weights(bge_m3.sparse(m3, ids, offsets, weights))
    want = []
    for seq in sequences:
        result = {}
        for idx, w in seq:
            if idx not in m3.dropped and w > 0 and w > result.get(str(idx), 0):
                result[str(idx)] = w
        want.append(dict(sorted(result.items(), key=lambda kv: int(kv[0]))))
    assert got == want
