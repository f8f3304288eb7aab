"""Checkpoints as the installed sentence-transformers (6.x) saves them, for every family jaxserve runs.

sentence-transformers 6 keeps the truncation length in the tokenizer's
`tokenizer_config.json` (`model_max_length`), not in `sentence_bert_config.json`.
Each tiny checkpoint here has 512 positions and is saved by sentence-transformers
itself with `max_seq_length = 128`; texts past 128 tokens must come out as
sentence-transformers' own `encode` gives them.
"""

import json

import hf_tiny
import pytest
from conftest import cosine_rows, warm_encoder

from jaxserve.checkpoint.config import max_seq_length, read_model_config
from jaxserve.runtime.buckets import fixed

MAX_LEN = 128
POSITIONS = 512
TABLE = fixed([(4, MAX_LEN)], layout="packed")
TEXTS = ["x", "the model", "a batch of jax documents is the query " * 3,
         "the model is a document of the batch " * 12,  # ~100 tokens: within the limit
         "the query of the model " * 40,  # ~200 tokens: truncated at 128
         " ".join(f"w{i % 10}" for i in range(150))]  # ~300 tokens

# family -> (transformers model class, config class, tokenizer template, pad token, pooling, config fields)
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
DECODER = dict(SMALL, num_key_value_heads=2, max_position_embeddings=POSITIONS)
FAMILIES = {
    "bert": ("BertModel", "BertConfig", "bert", "[PAD]", "mean", dict(SMALL, max_position_embeddings=POSITIONS)),
    "mpnet": ("MPNetModel", "MPNetConfig", "roberta", "<pad>", "mean",
              dict(SMALL, max_position_embeddings=POSITIONS + 2)),
    "distilbert": ("DistilBertModel", "DistilBertConfig", "bert", "[PAD]", "cls",
                   dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=POSITIONS)),
    "modernbert": ("ModernBertModel", "ModernBertConfig", "bert", "[PAD]", "mean",
                   dict(SMALL, local_attention=16, max_position_embeddings=POSITIONS)),
    "qwen3": ("Qwen3Model", "Qwen3Config", "decoder", "<|im_end|>", "lasttoken", dict(DECODER, head_dim=16)),
    "mistral": ("MistralModel", "MistralConfig", "decoder", "<|im_end|>", "lasttoken",
                dict(DECODER, sliding_window=32)),
    "gemma3": ("Gemma3TextModel", "Gemma3TextConfig", "gemma", "<pad>", "mean",
               dict(DECODER, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"], use_bidirectional_attention=True)),
}


def special_ids(kind: str) -> dict:
    """The token ids a real checkpoint's config.json names for the tokenizer template `kind`."""
    v = hf_tiny.vocab(kind)
    pad = {"bert": "[PAD]", "roberta": "<pad>", "decoder": "<|im_end|>", "gemma": "<pad>"}[kind]
    out = {"pad_token_id": v[pad]}
    if kind == "bert":
        out.update(cls_token_id=v["[CLS]"], sep_token_id=v["[SEP]"], bos_token_id=v["[CLS]"], eos_token_id=v["[SEP]"])
    if kind == "gemma":
        out.update(bos_token_id=v["<bos>"], eos_token_id=v["<eos>"])
    return out


def st6_checkpoint(root, family: str, dense: bool = False):
    """A tiny transformers checkpoint, wrapped and saved by sentence-transformers with max_seq_length 128."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.base.modules.normalize import Normalize
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling
    from transformers import PreTrainedTokenizerFast

    model_class, config_class, kind, pad, pooling, fields = FAMILIES[family]
    config = getattr(transformers, config_class)(vocab_size=len(hf_tiny.vocab(kind)), **fields, **special_ids(kind))
    raw = hf_tiny.write(root / "hf", model_class, config, kind=kind, seed=3, scale=0.3)
    transformer = Transformer(str(raw))
    # the tiny WordPiece tokenizer.json, not the family's own tokenizer built from the vocabulary alone
    transformer.processor = PreTrainedTokenizerFast(tokenizer_file=str(raw / "tokenizer.json"), pad_token=pad)
    modules = [transformer, Pooling(32, pooling_mode=pooling)]
    if dense:
        torch = pytest.importorskip("torch")
        torch.manual_seed(5)
        modules += [Dense(32, 32, use_residual=True, activation_function=torch.nn.GELU()),
                    Dense(32, 16, use_residual=True)]
    st = SentenceTransformer(modules=modules + [Normalize()], device="cpu",
                             prompts={"query": "query: ", "document": ""}, similarity_fn_name="dot")
    st.max_seq_length = MAX_LEN
    out = root / "st"
    st.save(str(out))
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_truncation_as_sentence_transformers(family, tmp_path):
    """Texts past 128 tokens are truncated at 128, and their vectors equal sentence-transformers' encode."""
    from sentence_transformers import SentenceTransformer

    path = st6_checkpoint(tmp_path, family)
    assert "max_seq_length" not in json.loads((path / "sentence_bert_config.json").read_text())
    assert json.loads((path / "tokenizer_config.json").read_text())["model_max_length"] == MAX_LEN
    st = SentenceTransformer(str(path), device="cpu")
    assert st.max_seq_length == MAX_LEN
    enc = warm_encoder(path, TABLE)
    assert enc.family.name == family or family in ("mistral", "qwen3")
    assert enc.embedding_config.max_seq_length == MAX_LEN
    lengths = [len(s) for s in enc.tokenizer.encode(TEXTS)]
    full = [len(ids) for ids in hf_tiny.full_ids(path, TEXTS)]
    assert max(full) > 2 * MAX_LEN and max(lengths) == MAX_LEN
    for text in TEXTS:
        assert st.tokenizer(text, truncation=True, max_length=st.max_seq_length)["input_ids"] == \
            enc.tokenizer.encode([text])[0].tolist()
    cos = cosine_rows(enc.embed(TEXTS), st.encode(TEXTS))
    assert cos.min() >= 0.99999, cos
    q = cosine_rows(enc.embed(TEXTS, prompt_name="query"), st.encode_query(TEXTS))
    assert q.min() >= 0.99999, q


def test_dense_use_residual(tmp_path):
    """sentence-transformers 6's Dense(use_residual=True): + x when widths agree, + x @ residual otherwise."""
    from sentence_transformers import SentenceTransformer

    path = st6_checkpoint(tmp_path, "bert", dense=True)
    layers = [json.loads((path / f"{i}_Dense" / "config.json").read_text()) for i in (2, 3)]
    assert all(layer["use_residual"] for layer in layers)
    enc = warm_encoder(path, TABLE)
    assert enc.dim == 16 and [d.residual for d in enc.embedding_config.dense] == [True, True]
    cos = cosine_rows(enc.embed(TEXTS), SentenceTransformer(str(path), device="cpu").encode(TEXTS))
    assert cos.min() >= 0.99999, cos


def write_plain(path, positions=POSITIONS, tokenizer_config=None, sbert=None):
    path.mkdir()
    cfg = {"model_type": "bert", "architectures": ["BertModel"], "vocab_size": 10, "hidden_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 8,
           "max_position_embeddings": positions, "type_vocab_size": 2, "layer_norm_eps": 1e-12}
    (path / "config.json").write_text(json.dumps(cfg))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if sbert is not None:
        (path / sbert[0]).write_text(json.dumps(sbert[1]))
    return path


@pytest.mark.parametrize("tokenizer_config, sbert, want", [
    (None, None, 512),  # no limit anywhere: the model's positions
    ({"model_max_length": 1000000000000000019884624838656}, None, 512),  # transformers' "no limit"
    ({"model_max_length": 256}, None, 256),  # 6.x: the tokenizer's limit
    ({"model_max_length": 256}, ("sentence_bert_config.json", {"max_seq_length": 64}), 64),  # < 6: the module's
    ({"model_max_length": 256}, ("sentence_bert_config.json",
                                 {"max_seq_length": 64, "tokenizer_args": {"model_max_length": 100}}), 100),
    (None, ("sentence_bert_config.json", {"processor_kwargs": {"model_max_length": 32}}), 32),
    (None, ("sentence_roberta_config.json", {"max_seq_length": 48}), 48),  # a legacy file name
    ({"model_max_length": 256}, ("sentence_bert_config.json", {"max_seq_length": 4096}), 512),  # past the positions
])
def test_max_seq_length_rule(tmp_path, tokenizer_config, sbert, want):
    path = write_plain(tmp_path / "ckpt", tokenizer_config=tokenizer_config, sbert=sbert)
    _, cfg = read_model_config(path)
    assert max_seq_length(path, cfg) == want
