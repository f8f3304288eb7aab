"""What jaxserve needs of one architecture family, in one place per family.

Each family module (bert.py, mpnet.py, ...) ends with a `FAMILY = Family(...)`;
`jaxserve.models.FAMILIES` lists them by `model_type`. Everything outside
the family module sees only this record and the config's common fields
(`ArchConfig`), so the planner, batcher, engine and server never change when
a family is added.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

from jaxserve.dims import ModelDims
from jaxserve.errors import CheckpointError


class ArchConfig(Protocol):
    """The fields of a family's frozen config that code outside the family reads."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int

    @property
    def max_positions(self) -> int:
        """Longest sequence the model takes, special tokens included."""

    def dims(self, dtype_bytes: int) -> ModelDims:
        """What the memory estimate needs of the architecture."""


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.json `model_type` values this family reads
    configure: Callable[[dict], ArchConfig]  # config.json -> frozen config; CheckpointError names what is unsupported
    # (cfg, dtype, attention=implementation) -> a Flax module:
    #   (token_ids, segment_ids, positions, type_ids, packed) each [B, S] int32 -> last hidden states [B, S, D]
    encoder: Callable[..., Any]
    weights: Callable[[ArchConfig], dict]  # cfg -> the params tree with (tensor names, combine) leaves
    # cfg -> prefixes the encoder's tensors carry in task checkpoints ("bert.", "model.")
    encoder_prefixes: Callable[[ArchConfig], tuple[str, ...]] = lambda cfg: ()
    ignored: tuple[str, ...] = ()  # tensor-name prefixes a checkpoint may carry that the encoder does not use
    rename: Callable[[str], str] = lambda key: key  # legacy tensor names -> current ones
    # Sequence classification, where transformers has a head for the family:
    head: Callable[..., Any] | None = None  # (cfg, num_labels, dtype) -> module: pooled [B, K, D] -> logits [B, K, L]
    head_weights: Callable[[ArchConfig], dict] | None = None
    head_pooling: str | Callable[[ArchConfig], str] = "cls"  # which token(s) feed the head: cls, mean, lasttoken

    def pooling_for_head(self, cfg: ArchConfig) -> str:
        return self.head_pooling(cfg) if callable(self.head_pooling) else self.head_pooling

    def head_pad_id(self, cfg: ArchConfig) -> int | None:
        """The token a last-token head looks past: transformers' classifiers (GenericForSequenceClassification)
        score each sequence's rightmost token that is not the config's pad token, which may well be the EOS
        the tokenizer appends (Qwen3's <|endoftext|>)."""
        if self.pooling_for_head(cfg) != "lasttoken":
            return None
        return getattr(cfg, "pad_token_id", None)

    def param_shapes(self, cfg: ArchConfig, dtype, num_labels: int = 0) -> dict:
        """The params tree the modules expect, as ShapeDtypeStructs (no memory used); `head` with labels."""
        import jax

        ids = jax.ShapeDtypeStruct((1, 8), "int32")
        init = lambda *xs: self.encoder(cfg, dtype).init(jax.random.key(0), *xs)
        tree = dict(jax.eval_shape(init, ids, ids, ids, ids)["params"])
        if num_labels:
            if self.head is None:
                raise CheckpointError(f"{self.name} checkpoints have no sequence-classification head in jaxserve")
            pooled = jax.ShapeDtypeStruct((1, 1, cfg.hidden_size), dtype)
            head = self.head(cfg, num_labels, dtype)
            tree["head"] = jax.eval_shape(lambda x: head.init(jax.random.key(0), x), pooled)["params"]
        return tree
