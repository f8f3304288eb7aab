"""The `jaxserve` command line."""

from __future__ import annotations

import argparse
import sys

DEMO_TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "Static shapes let XLA compile every bucket once.",
]


def cmd_demo(args) -> int:
    """Embed a few sentences and print their cosine similarities."""
    from jaxserve import Encoder

    enc = Encoder.from_pretrained(args.model, dtype=args.dtype)
    vecs = enc.embed(DEMO_TEXTS)
    print(f"model {enc.path} ({enc.model_config.model_type}, dim {enc.dim}, pooling {enc.embedding_config.pooling})")
    sims = vecs @ vecs.T
    for i, text in enumerate(DEMO_TEXTS):
        print(" ".join(f"{s:5.2f}" for s in sims[i]), " ", text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="embed a few sentences with a model and print their similarities")
    _model_args(demo)
    demo.set_defaults(func=cmd_demo)
    return parser


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory or hub id (default: bundled all-MiniLM-L6-v2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jaxserve.errors import JaxserveError

    try:
        return args.func(args)
    except JaxserveError as exc:
        print(f"jaxserve: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
