"""Text -> token ids, with the checkpoint's own special tokens and truncation.

Documents are encoded without special tokens first, so a long document can be
either truncated or split into windows; each window is then wrapped in the
model's template ([CLS] ... [SEP] for BERT, <s> ... </s> for RoBERTa).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from jaxserve.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    tokenizer: Tokenizer
    prefix: tuple[int, ...]  # special ids before a document, e.g. (CLS,)
    suffix: tuple[int, ...]  # special ids after it, e.g. (SEP,)
    max_length: int  # model limit, special tokens included

    @classmethod
    def from_dir(cls, path: Path, max_length: int) -> "TextTokenizer":
        file = path / "tokenizer.json"
        if file.exists():
            tok = Tokenizer.from_file(str(file))
        else:
            tok = _from_transformers(path)
        tok.no_padding()
        tok.no_truncation()
        prefix, suffix = _special_template(tok)
        return cls(tok, prefix, suffix, max_length)

    @property
    def num_special(self) -> int:
        return len(self.prefix) + len(self.suffix)

    @property
    def max_body(self) -> int:
        """Most document tokens that fit in one sequence beside the special tokens."""
        return self.max_length - self.num_special

    def encode_bodies(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text, without special tokens and untruncated."""
        return [np.asarray(e.ids, dtype=np.int32) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def wrap(self, body: np.ndarray) -> np.ndarray:
        """Body ids -> one model sequence, truncated to fit."""
        body = body[: self.max_body]
        return np.concatenate([np.asarray(self.prefix, np.int32), body, np.asarray(self.suffix, np.int32)])

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Each text as one truncated model sequence (what sentence-transformers feeds its model)."""
        return [self.wrap(b) for b in self.encode_bodies(texts)]


def _special_template(tok: Tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Find the special ids the post-processor puts around a single sequence."""
    probe = "hello world"
    bare = tok.encode(probe, add_special_tokens=False).ids
    full = tok.encode(probe, add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return tuple(full[:start]), tuple(full[start + len(bare) :])
    raise CheckpointError("cannot locate the document inside the tokenizer's special-token template")


def _from_transformers(path: Path) -> Tokenizer:
    """Checkpoints without tokenizer.json: let transformers build the fast tokenizer."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path)).backend_tokenizer
    except Exception as exc:
        found = ", ".join(sorted(p.name for p in path.iterdir()))
        raise CheckpointError(f"{path} has no usable tokenizer (no tokenizer.json; found: {found}): {exc}") from exc
