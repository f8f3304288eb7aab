"""The ASCII path of the tokenizer: the same ids as the checkpoint's own tokenizer, cheaper (pure, no JAX)."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, normalizers, pre_tokenizers

from jaxserve.checkpoint import loader
from jaxserve.checkpoint.tokenize import TextTokenizer

MAX_LEN = 64  # short, so that truncation is reached too


@pytest.fixture(scope="module")
def minilm_tokenizers():
    """(jaxserve's tokenizer, the checkpoint's own tokenizer.json truncating at the same length)."""
    path = loader.resolve(None)
    ref = Tokenizer.from_file(str(path / "tokenizer.json"))
    ref.no_padding()
    ref.enable_truncation(MAX_LEN)
    return TextTokenizer.from_dir(path, MAX_LEN), ref


ascii_text = st.text(st.characters(max_codepoint=127), max_size=200)
any_text = st.text(st.characters(codec="utf-8"), max_size=60)


def ids_of(pieces) -> list[list[int]]:
    return [s.tolist() for s in pieces.seqs]


class Seen:
    """A tokenizer that records what it is asked to encode, then encodes it."""

    def __init__(self, tok):
        self.tok, self.items = tok, []

    def encode_batch_fast(self, items, **kw):
        self.items += items
        return self.tok.encode_batch_fast(items, **kw)

    def encode_batch(self, items, **kw):
        self.items += items
        return self.tok.encode_batch(items, **kw)


def watched(tok: TextTokenizer) -> tuple[TextTokenizer, dict, dict]:
    """`tok` with every tokenizer it may pick recorded: (it, the ASCII ones by direction, the checkpoint's own)."""
    own = {"whole": Seen(tok.tokenizer), **{d: Seen(t) for d, t in tok._truncating.items()}}
    fast = {d: Seen(t) for d, t in tok._ascii.items()} if tok._ascii is not None else None
    out = TextTokenizer(own["whole"], tok.prefix, tok.suffix, tok.max_length)
    out.__dict__.update(_ascii=fast, _truncating={d: own[d] for d in ("right", "left")})  # the cached properties
    return out, fast, own


def test_ascii_texts_take_the_ascii_tokenizer_and_the_rest_the_checkpoints_own(minilm_tokenizers):
    """Each text by itself: one accented text does not take a request's others off the ASCII path."""
    tok, ref = minilm_tokenizers
    assert tok._ascii is not None  # MiniLM's normalizer is BERT's
    texts = ["Plain text.", "café au lait", "more plain", "naïve"]
    seen, fast, own = watched(tok)
    assert ids_of(seen.documents(texts)) == [e.ids for e in ref.encode_batch(texts)]
    assert (fast["right"].items, own["right"].items) == (["Plain text.", "more plain"], ["café au lait", "naïve"])
    seen.pairs(["Plain text.", ("a", "b"), ("a", "naïve")], direction="left")
    assert (fast["left"].items, own["left"].items) == (["Plain text.", ("a", "b")], [("a", "naïve")])
    seen.documents(["x " * 300, "é " * 300], "chunk")  # windows: bodies from the tokenizer that does not truncate
    assert (fast["whole"].items, own["whole"].items) == (["x " * 300], ["é " * 300])


@pytest.mark.parametrize("part", ["normalizer", "pre_tokenizer"])
def test_no_ascii_tokenizer_for_another_normalizer_or_pre_tokenizer(minilm_tokenizers, part):
    tok, _ = minilm_tokenizers
    other = Tokenizer.from_str(tok.tokenizer.to_str())
    if part == "normalizer":
        other.normalizer = normalizers.Lowercase()
    else:  # one that would not split on a tab as on a space
        other.pre_tokenizer = pre_tokenizers.Metaspace()
    plain = TextTokenizer(other, tok.prefix, tok.suffix, tok.max_length)
    assert plain._ascii is None
    seen, _, own = watched(plain)
    seen.documents(["Plain text."])
    assert own["right"].items == ["Plain text."]


def test_no_ascii_tokenizer_where_an_added_token_holds_whitespace(minilm_tokenizers):
    """BERT's normalizer turns a tab into a space before added tokens are matched; the ASCII one does not, so a
    normalized added token with whitespace in it would match differently."""
    from tokenizers import AddedToken

    tok, _ = minilm_tokenizers
    other = Tokenizer.from_str(tok.tokenizer.to_str())
    other.add_tokens([AddedToken("foo bar", normalized=True)])
    plain = TextTokenizer(other, tok.prefix, tok.suffix, tok.max_length)
    assert plain._ascii is None
    want = Tokenizer.from_str(other.to_str())
    want.enable_truncation(MAX_LEN)
    assert ids_of(plain.documents(["x foo\tbar y"])) == [want.encode("x foo\tbar y").ids]


@settings(max_examples=300, deadline=None)
@given(st.lists(ascii_text, min_size=1, max_size=4))
@example(["A\x01b\tC\x0bd\x7fe\r\nF\x1fG\x0cH\x00", "Tab\tand  spaces, UPPER; (punct)!"])
@example(["x " * 200])
@example(["".join(map(chr, range(128))), "a!!b...c--d__e~`{|}[\\]^@:;<=>?/"])  # every character; punctuation runs
def test_ascii_path_gives_the_checkpoints_own_ids(minilm_tokenizers, texts):
    tok, ref = minilm_tokenizers
    assert ids_of(tok.documents(texts)) == [e.ids for e in ref.encode_batch(texts)]


@settings(max_examples=150, deadline=None)
@given(st.lists(ascii_text, min_size=1, max_size=4), st.sampled_from(["chunk", "truncate"]),
       st.sampled_from(["right", "left"]))
@example(["A\x01b\tC " * 40], "chunk", "right")
def test_ascii_windows_and_ends_as_the_checkpoints_own_path(minilm_tokenizers, texts, long, direction):
    """Windows of long documents (`chunk`, bodies without special tokens) and truncation at either end: the same
    sequences with the ASCII path as with the checkpoint's own tokenizer (the same tokenizer, ASCII path off)."""
    tok, _ = minilm_tokenizers
    own = TextTokenizer(tok.tokenizer, tok.prefix, tok.suffix, tok.max_length)
    own.__dict__["_ascii"] = None  # the cached property, read as off
    assert ids_of(tok.documents(texts, long, direction=direction)) == ids_of(own.documents(texts, long,
                                                                                             direction=direction))


@settings(max_examples=100, deadline=None)
@given(st.lists(any_text, min_size=1, max_size=4))
@example(["Café NAÏVE résumé", "ascii too"])
def test_any_text_gives_the_checkpoints_own_ids(minilm_tokenizers, texts):
    tok, ref = minilm_tokenizers
    assert ids_of(tok.documents(texts)) == [e.ids for e in ref.encode_batch(texts)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(ascii_text, ascii_text), min_size=1, max_size=3))
@example([("What IS\x02 it?", "It\tis\nTHIS.")])
def test_ascii_pairs_give_the_checkpoints_own_ids_and_types(minilm_tokenizers, pairs):
    tok, ref = minilm_tokenizers
    pieces = tok.pairs(pairs)
    want = ref.encode_batch(pairs)
    assert ids_of(pieces) == [e.ids for e in want]
    assert [t.tolist() for t in pieces.type_seqs] == [e.type_ids for e in want]


def test_flat_ids_lengths_and_offsets(minilm_tokenizers):
    tok, ref = minilm_tokenizers
    texts = ["one", "two words", "", "THREE, four; five."]
    pieces = tok.documents(texts)
    assert pieces.lengths.tolist() == [len(e.ids) for e in ref.encode_batch(texts)]
    assert pieces.ids.dtype == np.int32 and pieces.offsets[-1] == len(pieces.ids)
    assert pieces.tokens == int(pieces.lengths.sum()) == len(pieces.ids)
    one = tok.documents(texts[1:2])  # a query's piece, made without numpy's calls
    assert one.tokens == int(one.lengths.sum()) == len(ref.encode(texts[1]).ids)
