"""Text -> token ids, with the checkpoint's own special tokens and truncation.

Documents are encoded without special tokens first, so a long document can be
either truncated or split into windows; each window is then wrapped in the
model's template ([CLS] ... [SEP] for BERT, <s> ... </s> for RoBERTa).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from jaxserve.errors import CheckpointError, InputError, TooLongError

LONG_MODES = ("truncate", "chunk", "error")  # what to do with a document over the model's limit
DEFAULT_CHUNK_OVERLAP = 32  # tokens shared by neighbouring windows in `chunk` mode


@dataclasses.dataclass(frozen=True)
class Pieces:
    """Model sequences cut from documents: one per document, or several windows of a long one."""

    seqs: list[np.ndarray]  # each a model sequence, special tokens included
    doc: np.ndarray  # [P] int: the document each piece belongs to
    weight: np.ndarray  # [P] float: body tokens in the piece, for the token-weighted mean
    types: list[np.ndarray] | None = None  # token type ids per piece (sentence pairs); None: all zeros

    def token_counts(self, num_docs: int) -> np.ndarray:
        """Tokens run through the model per document."""
        return np.bincount(self.doc, weights=[len(s) for s in self.seqs], minlength=num_docs).astype(np.int64)

    def combine(self, vectors: np.ndarray, num_docs: int) -> np.ndarray:
        """[P, D] piece vectors -> [N, D] document vectors (token-weighted mean of a document's pieces)."""
        out = np.zeros((num_docs, vectors.shape[1]), np.float64)
        np.add.at(out, self.doc, vectors * self.weight[:, None])
        total = np.bincount(self.doc, weights=self.weight, minlength=num_docs)
        return (out / np.maximum(total, 1e-12)[:, None]).astype(np.float32)


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

    def pairs(self, pairs: list[tuple[str, str]], truncate: bool = True) -> Pieces:
        """Sentence pairs as one sequence each ([CLS] a [SEP] b [SEP], token types 0 then 1).

        Truncation is the tokenizer's `longest_first`, as transformers and
        sentence-transformers' CrossEncoder do: the longer side loses tokens first.
        """
        pairs = [tuple(p) for p in pairs]
        if not truncate:
            for i, e in enumerate(self.tokenizer.encode_batch(pairs)):
                if len(e.ids) > self.max_length:
                    raise TooLongError(f"input {i} has {len(e.ids)} tokens, over the model's limit of "
                                       f"{self.max_length} (allow truncation)")
        seqs, types = [], []
        for e in self._pair_tokenizer.encode_batch(pairs):
            seqs.append(np.asarray(e.ids, np.int32))
            types.append(np.asarray(e.type_ids, np.int32))
        n = len(seqs)
        return Pieces(seqs, np.arange(n), np.ones(n), types)

    @functools.cached_property
    def _pair_tokenizer(self) -> Tokenizer:
        """A copy of the tokenizer that truncates (the shared one must not: documents are windowed)."""
        tok = Tokenizer.from_str(self.tokenizer.to_str())
        tok.enable_truncation(self.max_length, strategy="longest_first")
        return tok

    def pieces(self, bodies: list[np.ndarray], long: str = "truncate", overlap: int = DEFAULT_CHUNK_OVERLAP) -> Pieces:
        """Documents -> model sequences, a long document truncated, split into windows, or refused."""
        if long not in LONG_MODES:
            raise InputError(f"unknown long-input mode {long!r}; choose from {', '.join(LONG_MODES)}")
        seqs, doc, weight = [], [], []
        w = self.max_body
        for i, body in enumerate(bodies):
            n = len(body)
            if n <= w or long == "truncate":
                starts = [0]
            elif long == "error":
                raise TooLongError(
                    f"input {i} has {n + self.num_special} tokens, over the model's limit of {self.max_length} "
                    "(allow truncation or chunking)"
                )
            else:
                stride = max(1, w - min(overlap, w // 2))
                starts = list(range(0, n - w, stride)) + [n - w]
            for s in starts:
                window = body[s : s + w]
                seqs.append(self.wrap(window))
                doc.append(i)
                weight.append(max(len(window), 1))
        return Pieces(seqs, np.asarray(doc, np.int64), np.asarray(weight, np.float64))


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
