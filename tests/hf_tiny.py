"""Tiny seeded checkpoints written by transformers itself, with its PyTorch model as the reference.

For the families whose reference is transformers' own modeling code (ModernBERT,
Qwen3, Gemma3, ...): the test builds a tiny config, transformers initialises
the model from a fixed seed and saves it as it saves real checkpoints
(safetensors, config.json), and the same PyTorch model gives the reference
hidden states. torch is a test dependency only.
"""

from __future__ import annotations

import functools
import json
import string
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

WORDS = ["the", "a", "of", "and", "to", "in", "is", "document", "jax", "model", "query", "batch"]

# Special-token templates as real checkpoints of each kind carry them.
TEMPLATES = {
    "bert": (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], "[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1"),
    "roberta": (["<s>", "<pad>", "</s>", "<unk>", "<mask>"], "<s> $A </s>", "<s> $A </s> </s> $B </s>"),
    "decoder": (["<|endoftext|>", "<unk>", "<|im_start|>", "<|im_end|>"], "$A <|endoftext|>", "$A <|endoftext|> $B:1 <|endoftext|>:1"),
    "gemma": (["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"], "<bos> $A <eos>", "<bos> $A <eos> $B:1 <eos>:1"),
}


def vocab(kind: str) -> dict[str, int]:
    specials = TEMPLATES[kind][0]
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    tokens = specials + WORDS + chars + ["##" + c for c in chars]
    return {t: i for i, t in enumerate(tokens)}


def make_tokenizer(kind: str) -> Tokenizer:
    """A WordPiece tokenizer over a small vocabulary, with the special-token template of `kind`."""
    specials, single, pair = TEMPLATES[kind]
    v = vocab(kind)
    unk = next(t for t in specials if "unk" in t.lower())
    tok = Tokenizer(models.WordPiece(v, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    used = sorted({w.split(":")[0] for w in (single + " " + pair).split() if not w.startswith("$")})
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                       special_tokens=[(t, v[t]) for t in used])
    return tok


def write(path: Path, model_class: str, config, kind: str, seed: int = 0, scale: float | None = None) -> Path:
    """Initialise `transformers.<model_class>(config)` from `seed`, save it and a tokenizer of `kind` to `path`.

    `scale`: if given, every floating parameter is redrawn as N(0, scale²) (norm weights
    around 1), so that tiny models are far from their init's near-identity regime.
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    if scale is not None:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=gen) * scale
                p.copy_(1 + noise if "norm" in name.lower() and p.ndim == 1 else noise)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(kind).save(str(path / "tokenizer.json"))
    return path


def torch_model(path: Path, model_class: str):
    import torch
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, model_class).from_pretrained(path, torch_dtype=torch.float32,
                                                               attn_implementation="eager")
    return model.eval()


def hidden(model, ids: np.ndarray) -> np.ndarray:
    """Last hidden states [S, D] of one sequence (no padding) from a transformers model, float32."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids[None], dtype=torch.long),
                    attention_mask=torch.ones((1, len(ids)), dtype=torch.long))
    return out.last_hidden_state[0].float().numpy()


def logits(model, ids: np.ndarray) -> np.ndarray:
    """[L] logits of one sequence from a *ForSequenceClassification model."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids[None], dtype=torch.long),
                    attention_mask=torch.ones((1, len(ids)), dtype=torch.long))
    return out.logits[0].float().numpy()


def full_ids(path, texts):
    """Untruncated model sequences (with the special tokens), longer than the encoder's cap."""
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    return [np.asarray(e.ids, np.int32) for e in tok.encode_batch(texts)]


def hidden_states(module, params, docs, packed: bool, seqlen: int = 128):
    """Each document's hidden states, from one packed row or from padded rows (one document each)."""
    import jax

    starts = np.cumsum([0] + [len(d) for d in docs])[:-1]
    place = [(0, int(s)) for s in starts] if packed else [(k, 0) for k in range(len(docs))]  # (row, start)
    ids, seg, pos = (np.zeros((1 if packed else len(docs), seqlen), np.int32) for _ in range(3))  # [B, S]
    for k, (d, (r, s)) in enumerate(zip(docs, place)):
        ids[r, s:s + len(d)] = d
        seg[r, s:s + len(d)] = k + 1 if packed else 1
        pos[r, s:s + len(d)] = np.arange(len(d))
    # jitted: one compile of the whole forward (as the engine runs it), not one per primitive of an eager apply
    apply = jax.jit(functools.partial(module.apply, packed=packed))
    h = np.asarray(apply({"params": params}, ids, seg, pos, np.zeros_like(ids)))  # [B, S, D]
    return [h[r, s:s + len(d)] for d, (r, s) in zip(docs, place)]


def check_hidden(family, cfg, params, model, docs, atol=1e-4):
    """Padded rows and one packed row (also through the blockwise kernel of long seqlens) against transformers."""
    want = [hidden(model, d) for d in docs]
    worst = 0.0
    for impl, packed in [("dense", False), ("dense", True), ("blockwise", True)]:
        got = hidden_states(family.encoder(cfg, attention=impl), params, docs, packed)
        for g, ref in zip(got, want):
            np.testing.assert_allclose(g, ref, atol=atol, rtol=1e-4, err_msg=f"{impl}, packed={packed}")
            worst = max(worst, float(np.abs(g - ref).max()))
    return want, worst


def assert_matches_sentence_transformers(enc, path: Path, texts: list[str], pad_token: str, max_len: int) -> None:
    """`enc.embed` equals sentence-transformers' `encode` (cosine 0.99999) with left and with right padding,
    texts past `max_len` truncated the same way on both sides."""
    from conftest import cosine_rows

    st = sentence_transformer_on_tokenizer_json(path, pad_token, max_len)
    assert st.max_seq_length == max_len
    assert len(full_ids(path, texts)[-1]) > max_len  # truncated the same way on both sides
    assert st.tokenizer(texts[1])["input_ids"] == enc.tokenizer.encode(texts[1:2])[0].tolist()
    got = enc.embed(texts)
    for side in ("left", "right"):
        st.tokenizer.padding_side = side
        cos = cosine_rows(got, st.encode(texts))
        assert cos.min() >= 0.99999, (side, cos)


def assert_packed_equals_padded(enc, path: Path, texts: list[str], max_len: int) -> None:
    """Rows shared by several documents give each the vectors it gets alone in a padded row."""
    from conftest import warm_encoder

    from jaxserve.runtime.buckets import fixed

    texts = [texts[i % len(texts)] + " doc" * (i % 5) for i in range(24)]
    assert enc.prepare(texts)[1].docs.max() > 1  # rows are shared
    padded = warm_encoder(path, fixed([(4, max_len)]))
    np.testing.assert_allclose(enc.embed(texts), padded.embed(texts), atol=2e-5)


def assert_bfloat16_close(enc, path: Path, texts: list[str], table) -> None:
    """bfloat16 vectors within cosine 0.999 of `enc`'s float32 ones."""
    from conftest import cosine_rows, warm_encoder

    bf16 = warm_encoder(path, table, dtype="bfloat16")
    cos = cosine_rows(bf16.embed(texts), enc.embed(texts))
    assert cos.min() >= 0.999, cos


def sentence_transformer_on_tokenizer_json(path: Path, pad_token: str, max_length: int):
    """sentence-transformers' model of a checkpoint directory, tokenizing with its tokenizer.json.

    For decoder families (qwen2/qwen3, gemma3_text) AutoTokenizer builds the family's own tokenizer
    from the vocabulary alone; the tiny tokenizer.json (WordPiece) is what jaxserve and the reference
    must both use."""
    from sentence_transformers import SentenceTransformer
    from transformers import PreTrainedTokenizerFast

    st = SentenceTransformer(str(path), device="cpu")
    st[0].processor = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), pad_token=pad_token,
                                              model_max_length=max_length)
    return st


def sentence_transformers_dir(path: Path, pooling: str = "mean", max_seq_length: int | None = None,
                              normalize: bool = True, dense: list[dict] | None = None,
                              prompts: dict | None = None, default_prompt_name: str | None = None,
                              hidden_size: int | None = None) -> Path:
    """Add sentence-transformers modules to a checkpoint directory: Pooling, Dense layers, Normalize, prompts.

    `dense`: per Dense layer {"in": int, "out": int, "bias": bool, "activation": torch class path,
    "seed": int}; its weights are written as sentence-transformers saves them.
    """
    import torch
    from safetensors.torch import save_file

    hidden_size = hidden_size or json.loads((path / "config.json").read_text())["hidden_size"]
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {"mean": "mean_tokens", "cls": "cls_token", "max": "max_tokens", "lasttoken": "lasttoken",
             "mean_sqrt_len": "mean_sqrt_len_tokens", "weightedmean": "weightedmean_tokens"}
    flags = {f"pooling_mode_{m}": pooling == k for k, m in modes.items()}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden_size, **flags}))
    for i, layer in enumerate(dense or [], start=2):
        d = path / f"{i}_Dense"
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps({
            "in_features": layer["in"], "out_features": layer["out"], "bias": layer.get("bias", True),
            "activation_function": layer.get("activation", "torch.nn.modules.linear.Identity")}))
        gen = torch.Generator().manual_seed(layer.get("seed", i))
        tensors = {"linear.weight": torch.randn((layer["out"], layer["in"]), generator=gen) * 0.3}
        if layer.get("bias", True):
            tensors["linear.bias"] = torch.randn((layer["out"],), generator=gen) * 0.1
        save_file(tensors, str(d / "model.safetensors"))
        modules.append({"idx": i, "name": str(i), "path": f"{i}_Dense", "type": "sentence_transformers.models.Dense"})
    if normalize:
        n = len(modules)
        modules.append({"idx": n, "name": str(n), "path": f"{n}_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    if max_seq_length is not None:
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                    "do_lower_case": False}))
    st = {"prompts": prompts or {}, "default_prompt_name": default_prompt_name, "similarity_fn_name": "cosine"}
    (path / "config_sentence_transformers.json").write_text(json.dumps(st))
    return path
