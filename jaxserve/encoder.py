"""`Encoder`: a checkpoint loaded for embedding, the package's Python API.

    enc = Encoder.from_pretrained(None)          # bundled all-MiniLM-L6-v2
    vectors = enc.embed(["a document", ...])     # [N, dim] float32, input order
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import checkpoint
from jaxserve.config import EmbeddingConfig, ModelConfig, read_model_config
from jaxserve.model import Encoder as EncoderModule
from jaxserve.model import param_shapes
from jaxserve.pooling import l2_normalize, pool
from jaxserve.tokenize import TextTokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def embed_forward(module: EncoderModule, pooling: str, num_segments: int, params, batch: dict) -> jax.Array:
    """Pure forward: a batch of packed rows -> [B, K, D] pooled float32 vectors (not normalised)."""
    hidden = module.apply(
        {"params": params}, batch["token_ids"], batch["segment_ids"], batch["positions"], batch["type_ids"]
    )  # [B, S, D]
    return pool(pooling, hidden, batch["segment_ids"], batch["positions"], num_segments)


def rows_batch(seqs: list[np.ndarray], batch: int, seqlen: int) -> dict[str, np.ndarray]:
    """One document per row, right-padded to [batch, seqlen]."""
    out = {k: np.zeros((batch, seqlen), np.int32) for k in ("token_ids", "segment_ids", "positions", "type_ids")}
    for r, ids in enumerate(seqs):
        n = len(ids)
        out["token_ids"][r, :n] = ids
        out["segment_ids"][r, :n] = 1
        out["positions"][r, :n] = np.arange(n)
    return out


@dataclasses.dataclass
class Encoder:
    path: Path
    model_config: ModelConfig
    embedding_config: EmbeddingConfig
    tokenizer: TextTokenizer
    params: dict  # on device
    dtype: str

    @classmethod
    def from_pretrained(cls, name: str | None = None, dtype: str = "float32") -> "Encoder":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
        path = checkpoint.resolve(name)
        cfg = read_model_config(path)
        emb = EmbeddingConfig.from_checkpoint(path, cfg)
        tokenizer = TextTokenizer.from_dir(path, emb.max_seq_length)
        jdtype = DTYPES[dtype]
        params = checkpoint.load_params(path, cfg, param_shapes(cfg, jdtype), dtype=jdtype)
        return cls(path, cfg, emb, tokenizer, jax.device_put(params), dtype)

    @property
    def dim(self) -> int:
        return self.model_config.hidden_size

    @property
    def module(self) -> EncoderModule:
        return EncoderModule(self.model_config, DTYPES[self.dtype])

    def embed(self, texts: list[str], normalize: bool | None = None) -> np.ndarray:
        """Texts -> [N, dim] float32 embeddings in input order (truncated at the model's max length)."""
        normalize = self.embedding_config.normalize if normalize is None else normalize
        seqs = self.tokenizer.encode(list(texts))
        out = np.zeros((len(seqs), self.dim), np.float32)
        fwd = _jitted_forward(self.module, self.embedding_config.pooling)
        for idx, seqlen in _simple_groups([len(s) for s in seqs]):
            batch = rows_batch([seqs[i] for i in idx], len(idx), seqlen)
            vecs = fwd(self.params, jax.device_put(batch))[:, 0]  # [B, D]
            if normalize:
                vecs = l2_normalize(vecs)
            out[idx] = np.asarray(vecs)
        return out


@partial(jax.jit, static_argnums=(0, 1))
def _forward(module, pooling, params, batch):
    return embed_forward(module, pooling, 1, params, batch)


def _jitted_forward(module, pooling):
    return partial(_forward, module, pooling)


def _simple_groups(lengths: list[int], max_batch: int = 32):
    """Documents grouped by power-of-two length, at most `max_batch` each."""
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_len.setdefault(max(16, 1 << (n - 1).bit_length()), []).append(i)
    for seqlen, idx in sorted(by_len.items()):
        for start in range(0, len(idx), max_batch):
            yield np.asarray(idx[start : start + max_batch]), seqlen
