"""The ASCII path of the tokenizer: the same ids as the checkpoint's own tokenizer, cheaper (pure, no JAX)."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, normalizers, pre_tokenizers

from jaxserve.checkpoint import loader
from jaxserve.checkpoint.tokenize import TextTokenizer, from_sequences, interleaved
from jaxserve.errors import InputError, TooLongError

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


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(ascii_text, any_text, st.tuples(ascii_text, any_text)), min_size=1, max_size=4),
       st.integers(3, MAX_LEN), st.sampled_from(["right", "left"]))
@example(["x " * 200, ("a question", "y " * 200)], 9, "right")
def test_a_requests_own_length_cuts_as_the_checkpoints_tokenizer_truncating_there(minilm_tokenizers, items, limit,
                                                                                     direction):
    """`limit` (vLLM's `truncate_prompt_tokens`): texts and pairs truncated at it as the checkpoint's tokenizer does
    with `truncation=True, max_length=limit` (`longest_first` for a pair, special tokens counted), on the ASCII path
    and off it; token ids cut at the `direction` end."""
    tok, _ = minilm_tokenizers
    ref = Tokenizer.from_str(tok.tokenizer.to_str())
    ref.enable_truncation(limit, direction=direction)
    want = ref.encode_batch(items)
    pieces = tok.pairs(items, direction=direction, limit=limit)
    assert ids_of(pieces) == [e.ids for e in want]
    assert [t.tolist() for t in pieces.type_seqs] == [e.type_ids for e in want]
    texts = [x for x in items if isinstance(x, str)]
    if texts:
        want = [e.ids for e in ref.encode_batch(texts)]
        assert ids_of(tok.documents(texts, direction=direction, limit=limit)) == want
        ids = [np.asarray(e.ids, np.int32) for e in tok.tokenizer.encode_batch(texts)]
        kept = [s[:limit] if direction == "right" else s[-limit:] for s in ids]
        assert ids_of(tok.given(ids, direction=direction, limit=limit)) == [s.tolist() for s in kept]


def test_a_requests_own_length_is_within_the_model_and_leaves_room_for_the_special_tokens(minilm_tokenizers):
    tok, _ = minilm_tokenizers
    for bad in (0, MAX_LEN + 1):
        with pytest.raises(InputError, match=f"a cut to {bad} tokens is outside 1 to the model's limit of {MAX_LEN}"):
            tok.documents(["x"], limit=bad)
    with pytest.raises(InputError, match="a cut to 2 tokens leaves no room for the model's 3 special tokens around"):
        tok.pairs([("a", "b")], limit=2)
    assert ids_of(tok.documents(["x y z"], limit=2)) == [[*tok.prefix, *tok.suffix]]


def test_flat_ids_lengths_and_offsets(minilm_tokenizers):
    tok, ref = minilm_tokenizers
    texts = ["one", "two words", "", "THREE, four; five."]
    pieces = tok.documents(texts)
    assert pieces.lengths.tolist() == [len(e.ids) for e in ref.encode_batch(texts)]
    assert pieces.ids.dtype == np.int32 and pieces.offsets[-1] == len(pieces.ids)
    assert pieces.tokens == int(pieces.lengths.sum()) == len(pieces.ids)
    one = tok.documents(texts[1:2])  # a query's piece, made without numpy's calls
    assert one.tokens == int(one.lengths.sum()) == len(ref.encode(texts[1]).ids)


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory) -> TextTokenizer:
    """A SentencePiece-style tokenizer (Unigram, Metaspace), where "query: " alone ends in a lone "▁" that the
    prompt and its text joined do not have (multilingual-e5's and EmbeddingGemma's prompts end in a space)."""
    from tokenizers import AddedToken, models, processors

    scores = {"<s>": 0.0, "</s>": 0.0, "<unk>": 0.0, "▁query": -1.0, ":": -1.0, "▁": -2.0, "▁hello": -1.0,
              "hello": -1.5, "▁world": -1.0, **dict.fromkeys("queryhlowd", -5.0)}
    tok = Tokenizer(models.Unigram(list(scores.items()), unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<unk>")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    path = tmp_path_factory.mktemp("metaspace")
    tok.save(str(path / "tokenizer.json"))
    return TextTokenizer.from_dir(path, 12)


def test_a_prompt_is_joined_with_its_text_before_tokenizing_in_every_mode(metaspace):
    """Refusing (`error`, TEI's `truncate: false`) and chunking tokenized the prompt apart from the text, which a
    Metaspace tokenizer reads differently from the two joined (['▁query', ':', '▁', '▁hello'] for ['▁query', ':',
    '▁hello']): every mode now gives the truncate path's ids, sentence-transformers' and TEI's."""
    tok = metaspace
    tokens = lambda seq: [tok.tokenizer.id_to_token(int(i)) for i in seq]
    joined = ["<s>", "▁query", ":", "▁hello", "▁world", "</s>"]
    for long in ("truncate", "error", "chunk"):
        assert [tokens(s) for s in tok.documents(["hello world"], long, prompt="query: ").seqs] == [joined], long
    # a long text: the first window as the joined text tokenizes, every later one starting with the prompt's tokens
    windows = [tokens(s) for s in tok.documents(["hello world" + " world" * 20], "chunk", overlap=2,
                                                prompt="query: ").seqs]
    assert windows[0] == ["<s>", "▁query", ":", "▁hello"] + ["▁world"] * 7 + ["</s>"]
    assert len(windows) > 2 and all(w[:3] == ["<s>", "▁query", ":"] and w[3:-1] == ["▁world"] * 8 and w[-1] == "</s>"
                                    for w in windows[1:])
    with pytest.raises(InputError, match="the prompt has 10 tokens"):
        tok.documents(["hello"], "chunk", prompt="query: " * 5)


def test_token_ids_run_as_given(minilm_tokenizers):
    """Token-id inputs are whole sequences (TEI's /embed and vLLM's meaning): none added to, cut at their
    `direction` end or refused; chunked, each window keeps the [CLS] and [SEP] they came with, so a text's own
    ids chunk as the text does."""
    tok, _ = minilm_tokenizers
    text = "the quick brown fox jumps over the lazy dog " * 20
    (full,) = tok.encode_bodies([text])
    ids = np.concatenate([tok.prefix, full, tok.suffix]).astype(np.int32)
    short = ids[:10]
    assert ids_of(tok.given([short])) == [short.tolist()]
    assert ids_of(tok.given([ids])) == [ids[:MAX_LEN].tolist()]
    assert ids_of(tok.given([ids], direction="left")) == [ids[-MAX_LEN:].tolist()]
    assert ids_of(tok.given([ids], "chunk")) == ids_of(tok.documents([text], "chunk"))
    assert ids_of(tok.given([full], "chunk"))[0] == full[:MAX_LEN].tolist()  # no template: none added
    with pytest.raises(TooLongError, match=f"input 1 has {len(ids)} tokens, over the model's limit of {MAX_LEN}"):
        tok.given([short, ids], "error")
    assert tok.given([short, ids]).tokens == 10 + MAX_LEN  # usage: the ids run


MIXED = ["Hello World, JAX Documents!", "The MODEL", "Émile ZOLA à Paris", "ΟΔΟΣ und STRAßE", "İstanbul\tNAÏVE"]


@pytest.fixture(scope="module")
def cased_minilm(tmp_path_factory):
    """MiniLM's files with a cased tokenizer (its normalizer's and tokenizer_config's lowercasing off) under a
    Transformer module with `do_lower_case`: (jaxserve's tokenizer, sentence-transformers' processor, which
    it gives a Lowercase in front)."""
    import json

    from sentence_transformers import SentenceTransformer

    src, path = loader.resolve(None), tmp_path_factory.mktemp("cased")
    for f in src.iterdir():
        (path / f.name).symlink_to(f)
    edits = {"tokenizer.json": lambda c: {**c, "normalizer": {**c["normalizer"], "lowercase": False}},
             "tokenizer_config.json": lambda c: {**c, "do_lower_case": False},
             "sentence_bert_config.json": lambda c: {**c, "do_lower_case": True}}
    for name, edit in edits.items():
        config = json.loads((src / name).read_text())
        (path / name).unlink()
        (path / name).write_text(json.dumps(edit(config)))
    processor = SentenceTransformer(str(path), device="cpu")[0].processor
    return TextTokenizer.from_dir(path, MAX_LEN, lowercase=True), processor


def test_do_lower_case_lowercases_on_every_path(cased_minilm):
    """The ids of sentence-transformers' processor for mixed-case texts: ASCII (its own path) and not, with a
    prompt, in windows, and as pairs."""
    tok, proc = cased_minilm
    assert tok._ascii is not None  # still BERT's normalizer, lowercasing
    want = lambda texts: proc(texts, truncation=True, max_length=MAX_LEN)["input_ids"]
    assert ids_of(tok.documents(MIXED)) == want(MIXED)
    assert ids_of(tok.documents(MIXED[:2])) == want(MIXED[:2])  # all ASCII: the ASCII tokenizer alone
    assert ids_of(tok.documents(MIXED, prompt="Query: ")) == want(["Query: " + t for t in MIXED])
    assert ids_of(tok.documents(MIXED, "chunk", prompt="Query: ")) == want(["Query: " + t for t in MIXED])
    pairs = list(zip(MIXED, reversed(MIXED)))
    assert ids_of(tok.pairs(pairs)) == proc([a for a, _ in pairs], [b for _, b in pairs], truncation="longest_first",
                                            max_length=MAX_LEN)["input_ids"]


@pytest.mark.parametrize("norm", [None, normalizers.NFKC(), normalizers.Sequence([normalizers.NFD()]),
                                  normalizers.BertNormalizer(lowercase=False, strip_accents=True)],
                         ids=["none", "nfkc", "sequence", "bert-stripping"])
def test_do_lower_case_puts_a_lowercase_in_front_of_another_normalizer(norm):
    """Any other normalizer (or none) gets sentence-transformers' Lowercase in front; one that lowercases, none."""
    from jaxserve.checkpoint.tokenize import _lowercasing

    got = _lowercasing(norm)
    assert type(got) is normalizers.Sequence and type(next(iter(got))) is normalizers.Lowercase
    assert got.normalize_str("ÉMILE Zola") == (norm.normalize_str("émile zola") if norm else "émile zola")
    assert _lowercasing(got) is got
    bert = normalizers.BertNormalizer()  # lowercases (and strips accents) already
    assert _lowercasing(bert) is bert


def test_interleaved_puts_each_kinds_pieces_back_in_document_order():
    """A TEI batch of texts and token ids, tokenized apart: document j of a part is document `positions[j]`, a
    document's windows stay together and in their order, and token types follow their sequences."""
    seq = lambda *ids: np.array(ids, np.int32)
    texts = from_sequences([seq(1, 2), seq(3), seq(4, 5)], np.array([0, 0, 1]), np.array([2.0, 1.0, 2.0]),
                           [seq(0, 1), seq(0), seq(1, 1)])
    ids = from_sequences([seq(7, 8, 9)], np.array([0]), np.array([3.0]))
    both = interleaved([(texts, [0, 2]), (ids, [1])])
    assert [s.tolist() for s in both.seqs] == [[1, 2], [3], [7, 8, 9], [4, 5]]
    assert both.doc.tolist() == [0, 0, 1, 2] and both.weight.tolist() == [2.0, 1.0, 3.0, 2.0]
    assert [t.tolist() for t in both.type_seqs] == [[0, 1], [0], [0, 0, 0], [1, 1]]
    vectors = np.arange(8, dtype=np.float32).reshape(4, 2)
    np.testing.assert_allclose(both.combine(vectors, 3)[1:], vectors[2:])
