"""BGE-M3: one XLM-R forward, three outputs, as FlagEmbedding's `BGEM3FlagModel` computes them.

A BGE-M3 checkpoint is a dense XLM-R embedder with two more heads beside it,
saved by `torch.save` as state dicts of `torch.nn.Linear` (read without torch
by `jaxserve.checkpoint.torch_zip`): `colbert_linear.pt` (hidden -> colbert dim)
and `sparse_linear.pt` (hidden -> 1). FlagEmbedding's rules
(`FlagEmbedding/finetune/embedder/encoder_only/m3/modeling.py` and
`inference/embedder/encoder_only/m3.py`):
- dense: the CLS token's last hidden state, L2-normalised;
- sparse ("lexical weights"): relu(sparse_linear(h)) per token, the max per
  token id, the tokenizer's cls, eos, pad and unk tokens dropped, zeros too;
- multi-vector ("colbert vecs"): colbert_linear(h) of every token after CLS,
  each L2-normalised.

The device runs the encoder once and ships per token one row of width
`max(hidden, colbert dim) + 1`: a sequence's first token carries its CLS
state (the dense output, where FlagEmbedding drops the ColBERT vector), every
other token its normalised ColBERT vector, and the last column is each token's
sparse weight. Any subset of the three is read from that one output on the host.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np

from jaxserve.checkpoint import modules as st_modules
from jaxserve.checkpoint.config import DenseLayer
from jaxserve.checkpoint.torch_zip import read_state_dict
from jaxserve.errors import CheckpointError

COLBERT_FILE, SPARSE_FILE = "colbert_linear.pt", "sparse_linear.pt"
OUTPUTS = ("dense", "sparse", "multivector")
# the tokens FlagEmbedding's sparse output drops, and the names XLMRobertaTokenizer gives them where a checkpoint
# names none
DROPPED_TOKENS = {"cls_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}


@dataclasses.dataclass(frozen=True)
class M3Config:
    hidden: int  # the encoder's width: the dense output's
    colbert: DenseLayer  # colbert_linear: hidden -> colbert dim
    sparse: DenseLayer  # sparse_linear: hidden -> 1, then relu
    dropped: tuple[int, ...]  # token ids without a sparse weight (cls, eos, pad, unk)

    @property
    def dim(self) -> int:
        """Width of one multi-vector (ColBERT) vector."""
        return self.colbert.out_features

    @property
    def width(self) -> int:
        """Width of one token's device output: the dense or ColBERT vector (padded to the wider), then its weight."""
        return max(self.hidden, self.dim) + 1


def is_checkpoint(path: Path) -> bool:
    """A BGE-M3 save: both heads' files beside the encoder (as FlagEmbedding loads them)."""
    return (path / COLBERT_FILE).exists() and (path / SPARSE_FILE).exists()


def dropped_tokens(path: Path, tok) -> tuple[int, ...]:
    """The ids of the tokenizer's cls, eos, pad and unk tokens (special_tokens_map.json, tokenizer_config.json;
    XLM-R's names where neither has one), as FlagEmbedding reads them from `tokenizer.special_tokens_map`."""
    named = {}
    for file in ("special_tokens_map.json", "tokenizer_config.json"):
        for key in DROPPED_TOKENS:
            value = st_modules.read_json(path / file, missing={}).get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str) and key not in named:
                named[key] = value
    ids = {tok.token_to_id(named.get(key, default)) for key, default in DROPPED_TOKENS.items()}
    return tuple(sorted(i for i in ids if i is not None))


def _linear(path: Path, file: str, hidden: int, out: int | None) -> tuple[int, dict]:
    """One head's state dict {weight [out, hidden], bias [out]} -> (out, params float32 as `dense_layers` reads)."""
    tensors = read_state_dict(path / file)
    weight, bias = tensors.get("weight"), tensors.get("bias")
    if weight is None or bias is None or set(tensors) != {"weight", "bias"}:
        raise CheckpointError(f"{path / file} holds {sorted(tensors)}, not a Linear's weight and bias")
    rows = weight.shape[0] if weight.ndim == 2 else -1
    if weight.shape != (rows, hidden) or bias.shape != (rows,) or (out is not None and rows != out):
        raise CheckpointError(f"{path / file}: weight {weight.shape} and bias {bias.shape} do not fit a Linear "
                              f"from the encoder's {hidden} features{'' if out is None else f' to {out}'}")
    return rows, {"kernel": np.ascontiguousarray(weight.astype(np.float32).T), "bias": bias.astype(np.float32)}


def from_checkpoint(path: Path, tok, hidden: int) -> tuple[M3Config, dict]:
    """The two heads' config and params ({"colbert": ..., "sparse": ...}, float32) of a BGE-M3 save."""
    dim, colbert = _linear(path, COLBERT_FILE, hidden, None)
    _, sparse = _linear(path, SPARSE_FILE, hidden, 1)
    cfg = M3Config(hidden, DenseLayer(COLBERT_FILE, hidden, dim, True, "identity"),
                   DenseLayer(SPARSE_FILE, hidden, 1, True, "relu"), dropped_tokens(path, tok))
    return cfg, {"colbert": colbert, "sparse": sparse}


def dense(m3: M3Config, vectors: list[np.ndarray]) -> np.ndarray:
    """Per sequence its token outputs -> [P, hidden] CLS states (not normalised)."""
    if not vectors:
        return np.zeros((0, m3.hidden), np.float32)
    return np.stack([v[0, : m3.hidden] for v in vectors]).astype(np.float32, copy=False)


def multivector(m3: M3Config, vectors: list[np.ndarray]) -> list[np.ndarray]:
    """Per sequence its [tokens - 1, dim] normalised ColBERT vectors: every token after CLS."""
    return [np.ascontiguousarray(v[1:, : m3.dim]) for v in vectors]


def sparse(m3: M3Config, ids: np.ndarray, offsets: np.ndarray,
           weights: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Sequences' ids back to back ([T], sequence p at offsets[p]:offsets[p + 1]) and their tokens' weights [T] ->
    per sequence its (token ids int64, weights float32): the max weight per id, positive weights only, the dropped
    tokens left out, in id order. One sort of every kept token, however many sequences."""
    seq = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))  # [T] each token's sequence
    keep = (weights > 0) & ~np.isin(ids, np.asarray(m3.dropped, ids.dtype))
    seq, tid, w = seq[keep], ids[keep].astype(np.int64), weights[keep].astype(np.float32)
    order = np.lexsort((-w, tid, seq))  # by sequence, id, then the largest weight first
    seq, tid, w = seq[order], tid[order], w[order]
    first = np.ones(len(tid), bool)
    first[1:] = (seq[1:] != seq[:-1]) | (tid[1:] != tid[:-1])  # the max of each (sequence, id)
    seq, tid, w = seq[first], tid[first], w[first]
    bounds = np.searchsorted(seq, np.arange(len(offsets)))
    return [(tid[a:b], w[a:b]) for a, b in itertools.pairwise(bounds)]


def lexical_weights(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[dict[str, float]]:
    """`sparse`'s pairs as FlagEmbedding's `lexical_weights`: per sequence {str(token id): weight}."""
    return [dict(zip(map(str, ids.tolist()), w.tolist())) for ids, w in pairs]


def index_values(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[list[dict]]:
    """`sparse`'s pairs as jaxserve's (and TEI's) sparse embeddings: per sequence [{"index", "value"}], id order."""
    return [[{"index": i, "value": v} for i, v in zip(ids.tolist(), w.tolist())] for ids, w in pairs]


def outputs(m3: M3Config, ids: np.ndarray, offsets: np.ndarray, vectors: list[np.ndarray],
            wanted: tuple[str, ...] = OUTPUTS) -> dict:
    """Sequences' ids back to back and per sequence its token outputs ([tokens, width], `forward`'s) -> the outputs
    `wanted`: dense [P, hidden] (not normalised), sparse per sequence (token ids, weights), multivector per
    sequence [tokens - 1, dim]."""
    got = {}
    if "dense" in wanted:
        got["dense"] = dense(m3, vectors)
    if "sparse" in wanted:
        weights = np.concatenate([v[:, -1] for v in vectors]) if vectors else np.zeros(0, np.float32)
        got["sparse"] = sparse(m3, ids, offsets, weights)
    if "multivector" in wanted:
        got["multivector"] = multivector(m3, vectors)
    return got
