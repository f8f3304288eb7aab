"""Multi-vector (late interaction, ColBERT) embeddings, as sentence-transformers' `MultiVectorEncoder`
and PyLate compute them.

A ColBERT checkpoint is a Transformer, token-level Dense projection(s) (e.g.
768 -> 128, no bias), a scoring mask and a per-token L2 normalisation. Two
save formats, one meaning (sentence-transformers 6 loads both):
- `MultiVectorEncoder` (model_type "MultiVectorEncoder"): prompts carry the
  "[Q] " / "[D] " markers as text; the Transformer module's config has
  `query_length`, `document_length` and `query_expansion`
  {strategy, attend, token, length}; a `MultiVectorMask` module has the
  skiplist; `Normalize` on `token_embeddings` normalises each token.
- PyLate (model_type "ColBERT"): `query_prefix` / `document_prefix` tokens
  inserted after the first special token, `query_length`, `document_length`,
  `do_query_expansion`, `attend_to_expansion_tokens`, `skiplist_words`
  (default: punctuation) at the top of config_sentence_transformers.json;
  modules Transformer + Dense only, normalisation always.

Query expansion pads a query to a fixed length with mask tokens, which are
scored. With `attend` false they are queries of the attention but never keys:
the host marks them by adding the vocabulary size to their ids, and the device
gives them the negated segment id of their sequence (`jaxserve.models.attention`:
a key is seen only by queries of its own |segment| when its id is positive).
Documents drop skiplist tokens (punctuation) from their outputs. Outputs are
per token, without padding: per text its [tokens, dim] float32 array.
"""

from __future__ import annotations

import dataclasses
import itertools
import string
from pathlib import Path

import numpy as np

from jaxserve.checkpoint import modules as st_modules
from jaxserve.checkpoint.config import DenseLayer, dense_layer, truncate_dim
from jaxserve.checkpoint.tokenize import Pieces, TextTokenizer, from_sequences
from jaxserve.errors import CheckpointError, InputError, TableError

KINDS = ("query", "document")
MASK_TOKENS = ("[MASK]", "<mask>")  # looked up when the tokenizer config names none
CLASSIC_QUERY_LENGTH = 32  # ColBERT's, and sentence-transformers' default for a PyLate save without one


@dataclasses.dataclass(frozen=True)
class MultiVectorConfig:
    """What a ColBERT checkpoint's modules and configs say, resolved to token ids."""

    dim: int  # width of a token vector
    dense: tuple[DenseLayer, ...]
    normalize: bool  # L2 per token
    lengths: tuple[int, int]  # query, document: tokens at most, special tokens and markers included
    prompts: tuple[str | None, str | None]  # query, document: text put in front (MultiVectorEncoder)
    prefix_ids: tuple[int | None, int | None]  # query, document: id inserted after the first token (PyLate)
    expansion: int | None  # queries padded to this many tokens with `expansion_id` (None: no expansion)
    expansion_strategy: str  # fixed: queries cut to `expansion` too | min: a floor only
    expansion_id: int
    attend: bool  # the encoder attends to expansion tokens
    skiplist: tuple[int, ...]  # token ids dropped from outputs of the `skiplist_tasks` kinds
    skiplist_tasks: tuple[str, ...]
    similarity: str = "maxsim"  # maxsim | meanmaxsim (MaxSim over the query's token count)

    def length(self, kind: str) -> int:
        return self.lengths[KINDS.index(kind)]


def _token_id(tok, token: str | None) -> int | None:
    return None if not token else tok.token_to_id(token)


def mask_token_id(path: Path, tok) -> int | None:
    """The tokenizer's mask token (tokenizer_config.json / special_tokens_map.json), else its EOS, as
    sentence-transformers' expansion token falls back."""
    names = {}
    for file in ("special_tokens_map.json", "tokenizer_config.json"):
        for key in ("mask_token", "eos_token"):
            value = st_modules.read_json(path / file, missing={}).get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if value and key not in names:
                names[key] = value
    for token in (names.get("mask_token"), *MASK_TOKENS, names.get("eos_token")):
        if token and tok.token_to_id(token) is not None:
            return tok.token_to_id(token)
    return None


def from_checkpoint(path: Path, tokenizer: TextTokenizer, hidden: int, default_length: int,
                    positions: int) -> MultiVectorConfig:
    """Read a MultiVectorEncoder or PyLate save. `default_length`: the model's own limit (EmbeddingConfig's),
    where the checkpoint sets no per-kind length; `positions`: what the model can index, capping every length."""
    tok = tokenizer.tokenizer
    st = st_modules.st_config(path)
    pylate = st.get("model_type") == "ColBERT"
    sbert = st_modules.read_json(path / "sentence_bert_config.json", missing={}) or {}
    dense, normalize, mask = [], pylate, None
    for module in st_modules.listed(path):
        kind, folder = st_modules.kind(module), module.get("path", "")
        raw = st_modules.module_config(path, module, missing={}) or {} if kind != "Transformer" else {}
        if kind == "Dense":
            dense.append(dense_layer(raw, folder, reads="token_embeddings"))
        elif kind == "MultiVectorMask":
            mask = raw
        elif kind == "Normalize":
            normalize = normalize or raw.get("module_input_name", "sentence_embedding") == "token_embeddings"
        elif kind != "Transformer":
            raise CheckpointError(f"modules.json lists a {module.get('type')!r} module, which jaxserve's multi-vector "
                                  "models do not run (they run Transformer, Dense, MultiVectorMask, Normalize)")
    width = hidden
    for layer in dense:
        if layer.in_features != width:
            raise CheckpointError(f"Dense module {layer.path} takes {layer.in_features} features, not {width}")
        width = layer.out_features
    cut = truncate_dim(st)  # MultiVectorEncoder's: each token vector cut to it, then L2-normalised
    if cut is not None:
        width, normalize = min(width, cut), True

    expansion = sbert.get("query_expansion")
    query_length, document_length = sbert.get("query_length"), sbert.get("document_length")
    prompts = dict(st.get("prompts") or {})
    prefix_ids = (None, None)
    if pylate:  # PyLate's top-level knobs, as sentence-transformers' loader reads them
        query_length = st.get("query_length", query_length)
        document_length = st.get("document_length", document_length)
        if "query_expansion" not in sbert and st.get("do_query_expansion", True) is not False:
            attend = st.get("attend_to_expansion_tokens", st.get("attend_to_mask_tokens"))
            expansion = {"strategy": "fixed", "attend": bool(attend),
                         "length": st.get("query_length") or CLASSIC_QUERY_LENGTH}
            query_length = None
        ids = []
        for key in ("query_prefix", "document_prefix"):
            prefix = st.get(key)
            if prefix and tok.token_to_id(prefix) is None:
                raise CheckpointError(f"{path}: the {key} {prefix!r} is not a token of the tokenizer")
            ids.append(_token_id(tok, prefix))
        prefix_ids = tuple(ids)
        words = st.get("skiplist_words")
        mask = {"skiplist_words": list(string.punctuation) if words is None else words} if mask is None else mask
    if mask and mask.get("keep_only_token_ids"):
        raise CheckpointError("a MultiVectorMask with keep_only_token_ids (image-patch documents) is not supported")
    mask = mask or {}
    tasks = mask.get("skiplist_tasks") or ["document"]
    tasks = [tasks] if isinstance(tasks, str) else tasks
    skip = tuple(sorted({i for w in mask.get("skiplist_words") or () if (i := tok.token_to_id(w)) is not None}))

    exp_len, strategy, attend, exp_id = None, "fixed", False, 0
    if expansion is not None:
        strategy, attend, exp_len = expansion.get("strategy", "fixed"), bool(expansion.get("attend", False)), \
            expansion.get("length")
        if strategy not in ("fixed", "min") or not isinstance(exp_len, int) or exp_len < 1:
            raise CheckpointError(f"query_expansion {expansion}: strategy must be fixed or min, length a positive int")
        found = _token_id(tok, expansion.get("token")) if expansion.get("token") else mask_token_id(path, tok)
        if found is None:
            raise CheckpointError(f"{path}: no query expansion token (token {expansion.get('token')!r}, no mask "
                                  "or EOS token in the tokenizer)")
        exp_id = found
    cap = lambda n: min(default_length if n is None else int(n), positions)
    if strategy == "fixed" and exp_len is not None:
        query = exp_len
    else:
        query = cap(query_length) if exp_len is None else max(cap(query_length), exp_len)
    if query > positions:
        raise CheckpointError(f"{path}: queries of {query} tokens exceed the model's {positions} positions")
    similarity = st.get("similarity_fn_name") if st.get("similarity_fn_name") in ("maxsim", "meanmaxsim") else "maxsim"
    return MultiVectorConfig(width, tuple(dense), normalize, (query, cap(document_length)),
                             (prompts.get("query"), _document_prompt(prompts)), prefix_ids, exp_len, strategy,
                             exp_id, attend, skip, tuple(tasks), similarity)


def within(mv: MultiVectorConfig, seqlen: int) -> MultiVectorConfig:
    """`mv` for a table whose longest seqlen is `seqlen`: each kind truncated there. A query expansion pads
    every query to its length, which no truncation shortens: past the table it is refused (TableError)."""
    if mv.expansion is not None and mv.expansion > seqlen:
        raise TableError(f"this model expands every query to {mv.expansion} tokens, past the bucket table's "
                         f"longest seqlen {seqlen}: give seqlens reaching {mv.expansion}")
    return dataclasses.replace(mv, lengths=tuple(min(n, seqlen) for n in mv.lengths))


def _document_prompt(prompts: dict) -> str | None:
    """encode_document's default prompt: the first of document / passage / corpus the checkpoint has."""
    return next((prompts[k] for k in ("document", "passage", "corpus") if k in prompts), None)


def pieces(mv: MultiVectorConfig, tokenizers: dict, texts: list[str], kind: str, prompt: str | None,
           long: str, vocab: int) -> Pieces:
    """Texts -> model sequences of `kind`, as the references tokenize them: the marker (prompt text, or
    PyLate's token after the first), truncated to the kind's length, queries padded with expansion tokens
    (ids + `vocab` where the encoder must not attend to them)."""
    if kind not in KINDS:
        raise InputError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    if long not in ("truncate", "error"):
        raise InputError("multi-vector embeddings are per token of one sequence: `long` must be truncate or error")
    prefix_id = mv.prefix_ids[KINDS.index(kind)]
    tok = tokenizers[kind]
    prompt = prompt if prompt is not None else mv.prompts[KINDS.index(kind)]
    if long == "error":
        full = tok.documents(texts, "chunk", prompt=prompt)
        if full.count != len(texts):
            too = int(np.flatnonzero(np.bincount(full.doc) > 1)[0])
            raise InputError(f"input {too} is over this model's {kind} length of {mv.length(kind)} tokens "
                             "(allow truncation)")
    got = tok.documents(texts, "truncate", prompt=prompt)
    seqs = got.seqs
    if prefix_id is not None:
        seqs = [np.concatenate([s[:1], [prefix_id], s[1:]]).astype(np.int32) for s in seqs]
    if kind == "query" and mv.expansion is not None:
        fill = mv.expansion_id + (0 if mv.attend else vocab)
        seqs = [np.concatenate([s, np.full(max(0, mv.expansion - len(s)), fill, np.int32)]) for s in seqs]
    return from_sequences(seqs, np.arange(len(seqs)), np.ones(len(seqs)))


def tokenizers(mv: MultiVectorConfig, tokenizer: TextTokenizer) -> dict:
    """Per kind the tokenizer truncating at its length (one token less where PyLate inserts its marker)."""
    return {kind: dataclasses.replace(tokenizer, max_length=mv.length(kind) - (mv.prefix_ids[i] is not None))
            for i, kind in enumerate(KINDS)}


def check_windows(mv: MultiVectorConfig, specs) -> None:
    """Refuse hidden expansion tokens that a sliding-window layer would leave without any key.

    An expansion token at position p sees the query's first token (position 0) in a layer of window w
    (|q - k| < w) while p < w. Past that, in a short query, it may see no real token at all: an
    all-masked attention row, which transformers and jaxserve resolve differently (neither is meaningful),
    so such a checkpoint is refused rather than served with different vectors. Trained ModernBERT ColBERTs
    (local_attention 128: w = 65, queries of 32) are far from it."""
    if mv.expansion is None or mv.attend:
        return
    windows = [s.window for s in specs if s.window is not None]
    if windows and mv.expansion > min(windows):
        raise CheckpointError(f"query expansion to {mv.expansion} tokens, not attended to, past this model's "
                              f"sliding window ({min(windows) - 1} positions either side): expansion tokens far "
                              "from every real token would see no key at all; jaxserve does not serve it")


def attention_impl(impl: str, mv: MultiVectorConfig, seqlen: int) -> str:
    """The fused kernels see segment ids as equal-or-not (Pallas) or as document offsets (cuDNN): expansion
    tokens hidden as keys (negative segment ids) need the mask rule of the dense and blockwise kernels."""
    from jaxserve.models import attention

    if impl in ("pallas", "cudnn") and mv.expansion is not None and not mv.attend:
        return attention.xla_impl(seqlen)
    return impl


def kept(mv: MultiVectorConfig, kind: str, ids: np.ndarray,
         offsets: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """Which tokens of `kind` sequences (ids [T] back to back, sequence p at offsets[p]:offsets[p + 1]) their
    outputs keep: a mask over `ids` (None: all, no skiplist for this kind) and the sequences' offsets among the
    kept tokens. One pass over every token, however many sequences."""
    if kind not in mv.skiplist_tasks or not mv.skiplist:
        return None, offsets
    keep = ~np.isin(ids, np.asarray(mv.skiplist))
    return keep, np.concatenate([[0], np.cumsum(keep)])[offsets]  # kept tokens before each offset


def split(vectors: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """[T, dim] sequences back to back -> per sequence its [tokens, dim] rows (views)."""
    bounds = np.asarray(offsets).tolist()
    return [vectors[a:b] for a, b in itertools.pairwise(bounds)]


def outputs(mv: MultiVectorConfig, kind: str, seq_ids: list[np.ndarray], vectors: list[np.ndarray]) -> list[np.ndarray]:
    """Per sequence its token vectors, skiplist tokens dropped for the kinds the skiplist applies to."""
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seq_ids])]).astype(np.int64)
    flat = np.concatenate(vectors).astype(np.float32, copy=False) if vectors else np.zeros((0, mv.dim), np.float32)
    keep, offsets = kept(mv, kind, np.concatenate(seq_ids) if seq_ids else np.zeros(0, np.int32), offsets)
    return split(flat if keep is None else flat[keep], offsets)


MAXSIM_BLOCK = 8192  # document tokens scored by one product: their similarities to the query stay in cache


def maxsim_flat(query: np.ndarray, vectors: np.ndarray, offsets: np.ndarray, mean: bool = False) -> np.ndarray:
    """`maxsim` of documents laid out back to back ([T, dim], document i at offsets[i]:offsets[i + 1]): one
    product per block of whole documents of about `MAXSIM_BLOCK` tokens, each document's best per query token
    taken by one `maximum.reduceat`; an empty document scores 0."""
    lengths = np.diff(offsets)
    scores = np.zeros(len(lengths), np.float32)
    docs = np.flatnonzero(lengths)
    starts = np.asarray(offsets)[docs]
    bounds = [0, *(np.flatnonzero(np.diff(starts // MAXSIM_BLOCK)) + 1).tolist(), len(docs)]
    for lo, hi in itertools.pairwise(bounds):
        if hi > lo:
            first, end = starts[lo], offsets[docs[hi - 1] + 1]
            sims = query @ vectors[first:end].T  # [Q, block tokens]
            scores[docs[lo:hi]] = np.maximum.reduceat(sims, starts[lo:hi] - first, axis=1).sum(0)
    return scores / max(len(query), 1) if mean else scores


def maxsim(query: np.ndarray, documents: list[np.ndarray], mean: bool = False) -> np.ndarray:
    """PyLate's `colbert_scores` / MultiVectorEncoder's similarity: per document, the sum over query tokens of
    their best dot product with a document token ([Q, dim] against each [T, dim]); `mean`: / query tokens."""
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype(np.int64)
    flat = np.concatenate(documents) if documents else np.zeros((0, query.shape[-1]), query.dtype)
    return maxsim_flat(query, flat, offsets, mean)
