"""jaxserve's multi-vector outputs and MaxSim ranking against PyLate itself (not a test: PyLate cannot share
the test environment).

pylate 1.6.0 pins sentence-transformers 5.3.0 and transformers <= 5.3.0; the tests need sentence-transformers 6.
So this runs in two steps, in two environments:

    # 1. with PyLate importable (e.g. pip install --no-deps --target /tmp/pl pylate==1.6.0 datasets ujson
    #    multiprocess dill xxhash pandas python-dateutil six sentence-transformers==5.3.0 transformers==5.3.0
    #    tokenizers==0.22.2 'huggingface-hub>=1.3,<2'; transformers 5.3 fails at import against a newer
    #    `kernels` package, so /tmp/pl/kernels/__init__.py holds `raise ImportError`; then
    #    PYTHONPATH=/tmp/pl:$PWD):
    python scripts/check_pylate.py make /tmp/pylate-check [--attend]
    # 2. with jaxserve's own environment (PYTHONPATH=$PWD):
    python scripts/check_pylate.py compare /tmp/pylate-check

Step 1 has PyLate build a tiny BERT ColBERT (query_length 16, document_length 48, 8 dimensions) from a
seeded checkpoint written by transformers, save it, encode queries and documents and rank them with
`pylate.rank.rerank`; step 2 loads PyLate's save in jaxserve and checks token counts, the worst token cosine
and the ranking (order, scores to 1e-4).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

QUERIES = ["x", "the model?", "a batch of jax documents, the query " * 3, "hello, world! 42"]
DOCUMENTS = ["x", "the model, of jax.", "a batch of jax documents is the query " * 6, "hello, world! 42", "!!"]


def make(root: Path, attend: bool) -> None:
    import torch
    import transformers
    from pylate import models, rank
    from transformers import PreTrainedTokenizerFast

    import hf_tiny

    config = transformers.BertConfig(vocab_size=len(hf_tiny.vocab("bert")), pad_token_id=0, hidden_size=32,
                                     intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     max_position_embeddings=512)
    raw = hf_tiny.write(root / "hf", "BertModel", config, kind="bert", seed=2, scale=0.3)
    PreTrainedTokenizerFast(tokenizer_file=str(raw / "tokenizer.json"), pad_token="[PAD]", mask_token="[MASK]",
                            unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]").save_pretrained(str(raw))
    torch.manual_seed(0)
    models.ColBERT(str(raw), device="cpu", query_length=16, document_length=48, embedding_size=8,
                   attend_to_expansion_tokens=attend).save(str(root / "pylate"))
    model = models.ColBERT(str(root / "pylate"), device="cpu")
    q = model.encode(QUERIES, is_query=True)
    d = model.encode(DOCUMENTS, is_query=False)
    np.savez(root / "ref.npz", *[np.asarray(x) for x in q], *[np.asarray(x) for x in d])
    ranked = rank.rerank(documents_ids=[list(range(len(DOCUMENTS)))] * len(QUERIES), queries_embeddings=q,
                         documents_embeddings=[d] * len(QUERIES))
    (root / "rank.json").write_text(json.dumps([[(int(x["id"]), float(x["score"])) for x in r] for r in ranked]))


def compare(root: Path) -> None:
    from jaxserve import Encoder
    from jaxserve.heads import multivector
    from jaxserve.runtime.buckets import fixed

    ref = np.load(root / "ref.npz")
    ref = [ref[f"arr_{i}"] for i in range(len(ref.files))]
    q, d = ref[: len(QUERIES)], ref[len(QUERIES):]
    enc = Encoder.from_pretrained(str(root / "pylate"), dtype="float32",
                                  buckets=fixed([(4, 16), (4, 64)], layout="packed"))
    gq, gd = enc.embed_multivector(QUERIES, kind="query"), enc.embed_multivector(DOCUMENTS, kind="document")
    worst = 1.0
    for name, got, want in (("query", gq, q), ("document", gd, d)):
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape, (name, a.shape, b.shape)
            cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
            worst = min(worst, float(cos.min()))
            print(f"{name} {a.shape} min cos {cos.min():.7f}")
    for i, r in enumerate(json.loads((root / "rank.json").read_text())):
        mine = multivector.maxsim(gq[i], gd)
        order = [int(j) for j in np.argsort(-mine, kind="stable")]
        assert order == [x[0] for x in r], (order, r)
        np.testing.assert_allclose([mine[j] for j in order], [x[1] for x in r], rtol=1e-4)
    print(f"token counts equal; worst token cosine {worst:.7f}; pylate.rank.rerank's order and scores (1e-4)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=("make", "compare"))
    p.add_argument("dir", type=Path)
    p.add_argument("--attend", action="store_true", help="attend_to_expansion_tokens")
    a = p.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    make(a.dir, a.attend) if a.step == "make" else compare(a.dir)
