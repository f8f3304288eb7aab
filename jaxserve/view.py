"""`ModelView`: the host's side of a loaded model, everything but the weights and the compiled executables.

It tokenizes, pairs and sizes what the device runs, and reads what comes back: what the HTTP layer needs of a
model. `Encoder` is a `ModelView` with its device side (the Flax module, the engine). A front-end process of
`jaxserve serve --workers N` holds only the view (`Encoder.view`), sent to it by the engine process, and never
imports JAX: nothing imported here does (tests/test_workers.py checks a front-end's memory map).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import numpy as np

from jaxserve.checkpoint import llm_reranker
from jaxserve.checkpoint.config import EmbeddingConfig, HeadConfig
from jaxserve.checkpoint.tokenize import Pieces, TextTokenizer, from_sequences
from jaxserve.errors import InputError
from jaxserve.heads import bge_m3, multivector, sparse
from jaxserve.runtime.buckets import BucketTable


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """L2-normalise on the host (a device op would compile once per new shape)."""
    if len(x) == 1:  # one vector (a query's): its norm as a scalar, the same float32 values in two ufuncs fewer
        return x / max(np.float32(math.sqrt(np.add.reduce(np.square(x[0])))), np.float32(1e-12))
    return x / np.maximum(np.sqrt(np.add.reduce(np.square(x), axis=-1, keepdims=True)), 1e-12)  # np.linalg.norm's


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What the host reads of the architecture's config (the family's frozen config is the device's)."""

    family: str  # the family's name (`jaxserve.models`)
    model_type: str  # config.json's
    vocab_size: int
    hidden_size: int

    @classmethod
    def of(cls, family: str, cfg) -> Architecture:
        return cls(family, cfg.model_type, cfg.vocab_size, cfg.hidden_size)


@dataclasses.dataclass(frozen=True)
class Limits:
    """A checkpoint's own limits, as loaded: what `ModelView.fit_to` cuts to each table from, whatever an earlier
    table cut them to."""

    max_length: int  # the tokenizer's, special tokens included
    max_seq_length: int  # the embedding config's (a multi-vector model's: its longer kind's length)
    colbert: multivector.MultiVectorConfig | None

    @classmethod
    def of(cls, view: ModelView) -> Limits:
        return cls(view.tokenizer.max_length, view.embedding_config.max_seq_length, view.colbert)


@dataclasses.dataclass
class ModelView:
    """A model's configs, tokenizer and heads, and its engine's tables: what tokenizing, pairing and reading
    outputs need, no weights."""

    path: Path
    arch: Architecture
    embedding_config: EmbeddingConfig
    tokenizer: TextTokenizer
    engine: object  # an `Encoder`'s engine; a front-end's: the tables only (`http.workers.EngineView`)
    dtype: str
    head: HeadConfig = HeadConfig()  # embedding, a classifier's labels, or sparse
    splade: sparse.SparseConfig | None = None  # a SPLADE checkpoint's pooling (jaxserve.heads.sparse)
    colbert: multivector.MultiVectorConfig | None = None  # a multi-vector checkpoint's (jaxserve.heads.multivector)
    attention: str = "auto"  # the --attention choice (each bucket's implementation: engine.attention_of)
    # an LLM reranker's chat template or prompt for (query, document) pairs (jaxserve.checkpoint.llm_reranker)
    pair_template: llm_reranker.PairTemplate | llm_reranker.Qwen3RerankerPrompt | None = None
    m3: bge_m3.M3Config | None = None  # a BGE-M3 checkpoint's sparse and multi-vector heads (jaxserve.heads.bge_m3)
    limits: Limits | None = None  # the checkpoint's own (None: the fields above as given, at construction)

    def __post_init__(self):
        if self.limits is None:
            self.limits = Limits.of(self)

    def view(self, engine: object) -> ModelView:
        """This model's host side alone, with `engine` in place of its own (a front-end process's)."""
        return ModelView(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ModelView)} | {"engine": engine})

    @property
    def dim(self) -> int:
        """Width of an embedding: the hidden size, times the pooling modes, or the last Dense layer's."""
        return self.embedding_config.out_dim(self.arch.hidden_size)

    @property
    def out_dim(self) -> int:
        """Width of one sequence's output: the embedding, or the classifier's logits."""
        if self.splade is not None:
            return self.splade.out_dim
        return self.head.num_labels if self.head.kind == "classifier" else self.dim

    @property
    def token_dim(self) -> int:
        """Width of one token's output: the hidden size (/embed_all), a multi-vector model's projection, or a
        BGE-M3 model's three outputs in one row (`bge_m3.M3Config.width`)."""
        if self.m3 is not None:
            return self.m3.width
        return self.colbert.dim if self.colbert is not None else self.arch.hidden_size

    def fit_to(self, table: BucketTable) -> None:
        """Sequences no longer than the table's longest seqlen: a table derived at fewer seqlens than the model
        takes (`--seqlens 32,128` for a model of 256) makes its largest seqlen the limit that inputs are
        truncated to (or refused at, `long="error"`), where they would otherwise fit no bucket; a multi-vector
        model's query and document lengths with them (`multivector.within`). Fitted from the checkpoint's own
        `limits`, so a longer table installed after a shorter one raises them again. An `Encoder` calls it for
        every pooled table its engine installs."""
        longest, own = table.max_seqlen, self.limits
        if own.colbert is not None:
            self.colbert = multivector.within(own.colbert, longest)
            self.__dict__.pop("_kind_tokenizers", None)  # made again from the lengths cut
        if self.tokenizer.max_length != min(own.max_length, longest):
            self.tokenizer = dataclasses.replace(self.tokenizer, max_length=min(own.max_length, longest))
        if self.embedding_config.max_seq_length != min(own.max_seq_length, longest):
            self.embedding_config = dataclasses.replace(self.embedding_config,
                                                        max_seq_length=min(own.max_seq_length, longest))

    def multivector_pieces(self, texts: list[str], kind: str, long: str = "truncate",
                           prompt: str | None = None) -> Pieces:
        """Texts as a multi-vector model's `kind` (query or document) sequences (no device work)."""
        self._require("multivector")
        return multivector.pieces(self.colbert, self._kind_tokenizers, list(texts), kind, prompt, long,
                                  self.arch.vocab_size)

    @functools.cached_property
    def _kind_tokenizers(self) -> dict:
        return multivector.tokenizers(self.colbert, self.tokenizer)

    def prepare_pairs(self, inputs: list, truncate: bool, direction: str = "right",
                      instruction: str | None = None, limit: int | None = None) -> Pieces:
        """Texts (one sequence each) or pairs ([CLS] a [SEP] b [SEP]), mixed, as model sequences, truncated at the
        model's length or a request's own `limit`; an LLM reranker with a chat template or a model card's prompt:
        each pair rendered through it, with `instruction` in the prompt's slot (`llm_reranker.with_instruction`),
        at the model's length only (the template keeps its end where a cut would take it)."""
        template = llm_reranker.with_instruction(self.pair_template, instruction)
        if template is None:
            return self.tokenizer.pairs(inputs, truncate, direction, limit)
        if limit is not None:
            raise InputError(f"a cut to {limit} tokens is not served for an LLM reranker: its prompt template is cut "
                             "at the model's length only, keeping the template's end")
        return self._templated_pairs(template, inputs, truncate, direction)

    def _templated_pairs(self, template, inputs: list, truncate: bool, direction: str) -> Pieces:
        """Pairs through the LLM reranker's template (`llm_reranker`), one sequence each."""
        if any(isinstance(x, str) for x in inputs):
            raise InputError("an LLM reranker scores (query, document) pairs, not single texts")
        seqs = template.sequences(self.tokenizer, [tuple(x) for x in inputs], truncate, direction)
        return from_sequences(seqs, np.arange(len(seqs)), np.ones(len(seqs)))

    def _require(self, kind: str) -> None:
        if self.head.kind != kind:
            raise InputError(f"{self.path.name} is a{'n' if self.head.kind == 'embedding' else ''} {self.head.kind} "
                             f"model; this needs a{'n' if kind == 'embedding' else ''} {kind} model")
