"""Sparse (SPLADE) embeddings, as sentence-transformers' `SparseEncoder` computes them.

A SPLADE checkpoint is a masked-LM (a `fill-mask` Transformer module) followed
by `SpladePooling`: per sequence, `log(1 + relu(logits))` pooled over its
tokens (max, or sum), one weight per vocabulary entry, most of them zero.

Two things keep it cheap on a device:
- the vocabulary projection runs in blocks of `BLOCK` entries (`lax.map`), each
  block pooled before the next is computed: no [B, S, vocab] tensor exists, only
  [B, S, BLOCK] at a time and the pooled [B, K, vocab];
- the device compacts each sequence's non-zeros to the front (index order) and
  ships [B, K, 1 + 2 * cap] (count, values, indices) instead of [B, K, vocab].
  Up to the cap that is lossless. The same executable also returns the pooled
  [B, K, vocab] weights as a second output (its spill), which stays on the
  device, unread, unless a batch holds a sequence over the cap: then that
  batch's full rows are copied back in the same pass, and such a sequence's
  non-zeros are kept from its own (`SparseConfig.needed`, `keep`; the engine's
  spill, `runtime.engine.Spill`) into its job (`SparseRows`). A model's output
  is never refused; the cost of a dense row falls on the batches that have one
  (docs/models.md).

The device side (the projection in blocks, `compact`, `sparse_forward`) is in `jaxserve.heads.forwards`; this
module is the host's: the config, the head's weights, decoding what the device shipped.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from pathlib import Path

import numpy as np
import orjson

from jaxserve.checkpoint.config import positive_or_none
from jaxserve.errors import CheckpointError

BLOCK = 4096  # vocabulary entries projected at a time
CAP_ENV = "JAXSERVE_SPARSE_CAP"  # non-zeros shipped compact per sequence (more: its full row, from the spill)
DEFAULT_CAP = 2048  # (or the vocabulary, if smaller): trained SPLADE models keep far fewer (docs/models.md)
STRATEGIES = ("max", "sum")
ACTIVATIONS = ("relu", "log1p_relu")


@dataclasses.dataclass(frozen=True)
class SparseConfig:
    """SpladePooling's config, and what the device ships per sequence."""

    vocab_size: int
    strategy: str = "max"  # max | sum over a sequence's tokens
    activation: str = "relu"  # relu: log1p(relu(x)); log1p_relu: log1p(log1p(relu(x)))
    cap: int = 0  # non-zeros shipped per sequence
    block: int = BLOCK  # vocabulary entries projected at a time (the module's BLOCK when the model was loaded)
    max_active: int | None = None  # config_sentence_transformers.json's max_active_dims: the largest weights kept

    @property
    def out_dim(self) -> int:
        """Width of one sequence's device output: its count, then `cap` values, then `cap` indices."""
        return 1 + 2 * self.cap

    @classmethod
    def from_module(cls, raw: dict, vocab_size: int, cap: int | None = None,
                    max_active_dims: int | None = None) -> "SparseConfig":
        """SpladePooling's config `raw`; `max_active_dims`: the SparseEncoder's (its non-zeros per text, at most)."""
        max_active_dims = positive_or_none(max_active_dims, "max_active_dims")
        strategy = raw.get("pooling_strategy", "max")
        activation = raw.get("activation_function", "relu")
        if strategy not in STRATEGIES or activation not in ACTIVATIONS:
            raise CheckpointError(f"SpladePooling {raw}: pooling_strategy must be one of {STRATEGIES}, "
                                  f"activation_function one of {ACTIVATIONS}")
        if cap is None:
            cap = int(os.environ.get(CAP_ENV) or DEFAULT_CAP)
        # both change the executables: the warm artifact's key holds this config whole
        return cls(vocab_size, strategy, activation, max(1, min(int(cap), vocab_size)), BLOCK, max_active_dims)

    def needed(self, out_bkw: np.ndarray) -> np.ndarray:
        """A batch's compact rows [B, k, 1 + 2 cap] -> [B, k] bool: the sequences over the cap, whose full rows
        (the spill) are needed (`runtime.engine.Spill`)."""
        return out_bkw[..., 0] > self.cap

    @staticmethod
    def keep(weights_v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A sequence's full row [V] -> what its job keeps of it: its non-zeros (`nonzeros`)."""
        return nonzeros(weights_v)


# family -> the MLM head's tensors: transform dense, its LayerNorm, untied decoder weight, decoder bias(es)
MLM_HEADS = {
    "bert": ("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm", "cls.predictions.decoder.weight",
             ("cls.predictions.bias", "cls.predictions.decoder.bias")),
    "roberta": ("lm_head.dense", "lm_head.layer_norm", "lm_head.decoder.weight", ("lm_head.bias", "lm_head.decoder.bias")),
    "distilbert": ("vocab_transform", "vocab_layer_norm", "vocab_projector.weight", ("vocab_projector.bias",)),
}


def mlm_kind(family: str, model_type: str) -> str:
    if family == "bert":
        return "bert" if model_type == "bert" else "roberta"
    if family == "distilbert":
        return "distilbert"
    raise CheckpointError(f"SPLADE checkpoints of the {family} family are not supported (BERT, RoBERTa, XLM-R, "
                          "DistilBERT masked-LM heads are)")


def load_head(path: Path, family: str, cfg, dtype) -> dict:
    """The masked-LM head's params: transform {kernel, bias}, ln {scale, bias}, bias [V], decoder [V, D] if untied."""
    from jaxserve.checkpoint.loader import read_tensors

    dense, norm, decoder, biases = MLM_HEADS[mlm_kind(family, cfg.model_type)]
    tensors = read_tensors(path)
    find = lambda name: next((tensors[k] for k in (name, f"{cfg.model_type}.{name}") if k in tensors), None)
    got = {n: find(n) for n in (f"{dense}.weight", f"{dense}.bias", f"{norm}.weight", f"{norm}.bias")}
    bias = next((find(b) for b in biases if find(b) is not None), None)
    missing = [n for n, v in got.items() if v is None] + ([] if bias is not None else [biases[0]])
    if missing:
        raise CheckpointError(f"{path} is a SPLADE checkpoint without its masked-LM head: missing {', '.join(missing)}")
    d, v = cfg.hidden_size, cfg.vocab_size
    cast = lambda x: np.ascontiguousarray(np.asarray(x, np.float32)).astype(dtype)
    head = {"transform": {"kernel": cast(got[f"{dense}.weight"].T), "bias": cast(got[f"{dense}.bias"])},
            "ln": {"scale": cast(got[f"{norm}.weight"]), "bias": cast(got[f"{norm}.bias"])},
            "bias": np.asarray(bias, np.float32)}
    untied = find(decoder)
    if untied is not None:
        head["decoder"] = cast(untied)
    if head["transform"]["kernel"].shape != (d, d) or head["bias"].shape != (v,) or \
            head.get("decoder", np.zeros((v, d))).shape != (v, d):
        raise CheckpointError(f"{path}: the masked-LM head's shapes do not fit hidden_size {d}, vocab_size {v}")
    return head


@dataclasses.dataclass
class SparseRows:
    """Each sequence's weights as the device shipped them: `compact` [P, 1 + 2 cap] rows (count, values, indices),
    and by sequence the non-zeros (indices, values) of those over the cap, kept from their full rows in the same
    pass (`Job.kept`)."""

    compact: np.ndarray
    full: dict[int, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)


def counts(out: np.ndarray) -> np.ndarray:
    """[P] each compact row's non-zeros (more than the cap: the sequence's are in `SparseRows.full`)."""
    return out[:, 0].astype(np.int64)


def over_cap(out: np.ndarray, sparse: SparseConfig) -> np.ndarray:
    """The sequences whose non-zeros the compact rows cannot hold (their full rows are needed)."""
    return np.flatnonzero(counts(out) > sparse.cap)


def nonzeros(weights_v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A full [V] row -> its non-zeros (indices int64, values float32), index order, as `compact` keeps them."""
    indices = np.flatnonzero(weights_v > 0)
    return indices, np.ascontiguousarray(weights_v[indices], np.float32)


def largest(indices: np.ndarray, values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """One sequence's non-zeros (index order) -> its `k` largest, in index order: sentence-transformers'
    `select_max_active_dims` (its topk; equal weights: the lower index first)."""
    if len(values) <= k:
        return indices, values
    keep = np.sort(np.argsort(-values, kind="stable")[:k])
    return indices[keep], values[keep]


def _rows(out, sparse: SparseConfig) -> SparseRows:
    """Device rows as `SparseRows`, each sequence's non-zeros cut to the model's `max_active_dims` if it has one."""
    rows = out if isinstance(out, SparseRows) else SparseRows(out)
    missing = set(over_cap(rows.compact, sparse).tolist()) - set(rows.full)
    if missing:  # compact rows from a pass that kept no spill: a caller's error, never the request's
        raise ValueError(f"compact SPLADE rows over the cap without their full rows (sequences {sorted(missing)})")
    k, cap = sparse.max_active, sparse.cap
    n = counts(rows.compact)
    if k is None or not (n > k).any():
        return rows
    compact = rows.compact.copy()
    for p in np.flatnonzero((n > k) & (n <= cap)):
        indices, values = largest(compact[p, 1 + cap : 1 + cap + n[p]], compact[p, 1 : 1 + n[p]], k)  # copies
        compact[p, 0] = k
        compact[p, 1 : 1 + k] = values
        compact[p, 1 + cap : 1 + cap + k] = indices
    full = {p: largest(*rows.full[p], k) for p in rows.full}
    return SparseRows(compact, full)


def decode(out: SparseRows | np.ndarray, sparse: SparseConfig) -> list[list[dict]]:
    """Device rows -> per sequence its non-zeros [{"index", "value"}], index order (TEI's shape)."""
    rows = _rows(out, sparse)
    result = []
    for p, (row, n) in enumerate(zip(rows.compact, counts(rows.compact))):
        if n > sparse.cap:
            indices, values = rows.full[p]
        else:
            values = row[1 : 1 + n]
            indices = row[1 + sparse.cap : 1 + sparse.cap + n].astype(np.int64)
        result.append([{"index": int(i), "value": float(v)} for i, v in zip(indices, values)])
    return result


JSON_BLOCK = 2**16  # weights written to JSON per orjson call, at most (a row more where one row has more)


def json_rows(out: SparseRows | np.ndarray, sparse: SparseConfig) -> list[bytes]:
    """Device rows -> per sequence `decode`'s list as JSON (values at float32's shortest repr).

    Built in bulk, as a server needs it for a thousand inputs of thousands of weights each: orjson writes a
    block of rows' indices, then their values, at once, and the records are joined from those pieces, with no
    Python object per weight beyond its two numbers' texts. Blocks of `JSON_BLOCK` weights bound how long one
    call holds the GIL (orjson keeps it throughout), and with it the event loop of the thread that waits."""
    rows = _rows(out, sparse)
    compact, cap = rows.compact, sparse.cap
    n = counts(compact)
    shipped = np.where(n > cap, 0, n)  # a row over the cap is written from its full row below
    step = max(1, JSON_BLOCK // cap)
    result = [row for a in range(0, len(compact), step)
              for row in _json_block(compact[a : a + step, 1 + cap :], compact[a : a + step, 1 : 1 + cap],
                                     shipped[a : a + step])]
    for p in over_cap(compact, sparse):
        result[p] = _json_full(*rows.full[p])
    return result


def _json_full(indices: np.ndarray, values: np.ndarray) -> bytes:
    """One sequence's non-zeros read from its full row, as JSON: `JSON_BLOCK` weights per orjson call."""
    blocks = [_json_block(indices[None, a : a + JSON_BLOCK], values[None, a : a + JSON_BLOCK],
                          np.array([min(JSON_BLOCK, len(indices) - a)]))[0][1:-1]
              for a in range(0, len(indices), JSON_BLOCK)]
    return b"[" + b",".join(blocks) + b"]"


def _json_block(indices: np.ndarray, values: np.ndarray, n: np.ndarray) -> list[bytes]:
    """[P, W] indices and values, the first n[p] of row p taken -> per row its records as JSON."""
    taken = np.arange(indices.shape[1]) < n[:, None]  # [P, W]
    if not taken.any():
        return [b"[]"] * len(n)
    numbers = lambda a: orjson.dumps(a, option=orjson.OPT_SERIALIZE_NUMPY)[1:-1].split(b",")
    pieces = [b'},{"index":', None, b',"value":', None] * int(n.sum())
    pieces[1::4] = numbers(indices[taken].astype(np.int64))
    pieces[3::4] = numbers(values[taken])
    bounds = (4 * np.concatenate([[0], np.cumsum(n)])).tolist()
    return [b'[{"index":' + b"".join(pieces[a + 1 : b]) + b"}]" if b > a else b"[]"
            for a, b in itertools.pairwise(bounds)]
