"""SPLADE vs dense MiniLM at the same bucket: XLA's memory per bucket, bytes shipped per sequence, texts/s.

The SPLADE model is MiniLM's shape (6 layers, 384 wide, MiniLM's 30522-token
vocabulary and tokenizer) with a masked-LM head, randomly initialised by
transformers and saved by sentence-transformers' SparseEncoder; its decoder
bias is shifted down so that, like a trained SPLADE model, a text activates a
few hundred vocabulary entries. `--one-block` also compiles the head as a single
vocabulary block (the [B, S, vocab] tensor the blocking avoids) for comparison. Runs under the bench lock.

    python scripts/bench_sparse.py --batch 8 --seqlen 128 --texts 128 --rounds 3 --one-block
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import tempfile
from pathlib import Path

import harness
import numpy as np


def splade_checkpoint(root: Path, bias: float) -> Path:
    import torch
    import transformers
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    from jaxserve.checkpoint.loader import bundled_default

    minilm = bundled_default()
    raw = json.loads((minilm / "config.json").read_text())
    config = transformers.BertConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "transformers_version")})
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config).eval()
    with torch.no_grad():
        model.cls.predictions.bias.fill_(bias)
    hf = root / "hf"
    model.save_pretrained(hf)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (minilm / name).exists():
            shutil.copy(minilm / name, hf / name)
    st = SparseEncoder(modules=[Transformer(str(hf), transformer_task="fill-mask"), SpladePooling("max")], device="cpu")
    st.max_seq_length = 256
    st.save(str(root / "splade"))
    return root / "splade"


def texts(n: int, seqlen: int) -> list[str]:
    words = "the model of a document is the query and jax batch sparse vocabulary weights".split()
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(words, size=seqlen - 2)) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--texts", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bias", type=float, default=-1.5)  # ~180 non-zeros per 128-token text
    ap.add_argument("--one-block", action="store_true")
    args = ap.parse_args()
    with harness.bench_lock():
        measure(args)


def measure(args) -> None:
    from jaxserve import Encoder
    from jaxserve.heads import sparse
    from jaxserve.runtime.buckets import fixed

    table = fixed([(args.batch, args.seqlen), (args.batch, 256)], layout="padded")  # 256: MiniLM's max_seq_length
    root = Path(tempfile.mkdtemp(prefix="bench_sparse_"))
    path = splade_checkpoint(root, args.bias)
    models = {"dense MiniLM": Encoder.from_pretrained(None, buckets=table),
              "SPLADE (MiniLM-shaped)": Encoder.from_pretrained(str(path), buckets=table)}
    if args.one_block:
        sparse.BLOCK = 1 << 30
        models["SPLADE, one vocabulary block"] = Encoder.from_pretrained(str(path), buckets=table)
    docs = texts(args.texts, args.seqlen)
    calls = {name: (enc.embed_sparse if enc.head.kind == "sparse" else enc.embed) for name, enc in models.items()}
    nnz = [len(w) for w in models["SPLADE (MiniLM-shaped)"].embed_sparse(docs)]
    # interleaved, so drift on a shared host hits each alike
    times = harness.rounds({name: harness.timed(functools.partial(call, docs)) for name, call in calls.items()},
                           args.rounds)
    print(f"bucket ({args.batch}, {args.seqlen}) padded; {args.texts} texts of {args.seqlen} tokens; "
          f"{args.rounds} alternating rounds; non-zeros per text: median {int(np.median(nnz))}, max {max(nnz)}")
    print("| model | XLA bytes of the bucket | bytes shipped per sequence | texts/s (median) |")
    print("|---|---|---|---|")
    for name, enc in models.items():
        bucket = enc.warm_table().at(args.seqlen)[0]
        print(f"| {name} | {bucket.compiled_bytes / 2**20:.1f} MiB | {enc.out_dim * 4:,} | "
              f"{args.texts / float(np.median(times[name])):.0f} |")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
