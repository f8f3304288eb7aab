"""Tiny random checkpoints written by the tests themselves, plus a numpy reference forward.

The checkpoints use Hugging Face's own file layout and tensor names, so they go
through the same loader as real models. The numpy reference reads the HF
tensors directly: it shares no code with jaxserve's model or loader.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
WORDS = ["the", "a", "of", "and", "to", "in", "is", "document", "jax", "model", "query", "batch"]


def _vocab(specials: list[str]) -> dict[str, int]:
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    tokens = specials + WORDS + chars + ["##" + c for c in chars]
    return {t: i for i, t in enumerate(tokens)}


def make_tokenizer(model_type: str) -> Tokenizer:
    roberta = model_type != "bert"
    specials = ROBERTA_SPECIALS if roberta else BERT_SPECIALS
    vocab = _vocab(specials)
    tok = Tokenizer(models.WordPiece(vocab, unk_token=specials[3] if roberta else "[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    if roberta:
        tok.post_processor = processors.RobertaProcessing(("</s>", vocab["</s>"]), ("<s>", vocab["<s>"]))
    else:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
    return tok


def tiny_config(model_type: str = "bert", **over) -> dict:
    roberta = model_type != "bert"
    cfg = {
        "architectures": ["RobertaModel" if roberta else "BertModel"],
        "model_type": model_type,
        "vocab_size": len(_vocab(BERT_SPECIALS)),
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 66 if roberta else 64,
        "type_vocab_size": 1 if roberta else 2,
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-12 if not roberta else 1e-5,
        "pad_token_id": 1 if roberta else 0,
        "position_embedding_type": "absolute",
    }
    cfg.update(over)
    return cfg


def random_tensors(cfg: dict, seed: int = 0, prefix: str = "") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    t: dict[str, np.ndarray] = {}

    def w(name, *shape, scale=0.2):
        t[prefix + name] = (rng.standard_normal(shape) * scale).astype(np.float32)

    def ln(name):
        t[prefix + name + ".weight"] = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
        t[prefix + name + ".bias"] = (0.1 * rng.standard_normal(d)).astype(np.float32)

    w("embeddings.word_embeddings.weight", cfg["vocab_size"], d, scale=1.0)
    w("embeddings.position_embeddings.weight", cfg["max_position_embeddings"], d, scale=1.0)
    w("embeddings.token_type_embeddings.weight", cfg["type_vocab_size"], d, scale=1.0)
    ln("embeddings.LayerNorm")
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for n in ("query", "key", "value"):
            w(p + f"attention.self.{n}.weight", d, d)
            w(p + f"attention.self.{n}.bias", d, scale=0.1)
        w(p + "attention.output.dense.weight", d, d)
        w(p + "attention.output.dense.bias", d, scale=0.1)
        ln(p + "attention.output.LayerNorm")
        w(p + "intermediate.dense.weight", f, d)
        w(p + "intermediate.dense.bias", f, scale=0.1)
        w(p + "output.dense.weight", d, f)
        w(p + "output.dense.bias", d, scale=0.1)
        ln(p + "output.LayerNorm")
    return t


def head_tensors(cfg: dict, seed: int = 1) -> dict[str, np.ndarray]:
    """A *ForSequenceClassification head: BERT's pooler + classifier, or RoBERTa's classifier."""
    rng = np.random.default_rng(seed)
    d, n = cfg["hidden_size"], cfg["num_labels"]
    w = lambda *shape: (rng.standard_normal(shape) * 0.3).astype(np.float32)
    if cfg["model_type"] == "bert":
        return {"pooler.dense.weight": w(d, d), "pooler.dense.bias": w(d), "classifier.weight": w(n, d),
                "classifier.bias": w(n)}
    return {"classifier.dense.weight": w(d, d), "classifier.dense.bias": w(d), "classifier.out_proj.weight": w(n, d),
            "classifier.out_proj.bias": w(n)}


def write_checkpoint(
    path: Path, model_type: str = "bert", pooling: str | None = "mean", max_seq_length: int | None = None,
    seed: int = 0, num_labels: int = 0, **config_over,
) -> Path:
    """A complete sentence-transformers style directory; `pooling=None` writes a plain HF checkpoint.

    With `num_labels`, a *ForSequenceClassification checkpoint (prefixed encoder tensors and a head)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(model_type, **config_over)
    tensors = random_tensors(cfg, seed)
    if num_labels:
        family = "Bert" if model_type == "bert" else "Roberta"
        cfg.update(architectures=[f"{family}ForSequenceClassification"], num_labels=num_labels,
                   id2label={str(i): f"label_{chr(97 + i)}" for i in range(num_labels)})
        prefix = "bert." if model_type == "bert" else "roberta."
        tensors = {prefix + k: v for k, v in tensors.items()} | head_tensors(cfg)
        pooling = None
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    make_tokenizer(model_type).save(str(path / "tokenizer.json"))
    if pooling is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ]
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir(exist_ok=True)
        flags = {f"pooling_mode_{m}": pooling == k for k, m in
                 [("mean", "mean_tokens"), ("cls", "cls_token"), ("max", "max_tokens"), ("lasttoken", "lasttoken")]}
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": cfg["hidden_size"], **flags}))
    if max_seq_length is not None:
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return path


# ---- numpy reference (HF semantics, read straight from the HF tensor names) ----

def _gelu(x):
    from scipy.special import erf

    return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def _ln(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def reference_hidden(tensors: dict, cfg: dict, ids: np.ndarray, types: np.ndarray | None = None) -> np.ndarray:
    """One sequence [S] of ids (special tokens included) -> [S, D] last hidden states, float64."""
    t = {k: v.astype(np.float64) for k, v in tensors.items()}
    roberta = cfg["model_type"] != "bert"
    eps = cfg["layer_norm_eps"]
    s = len(ids)
    pos = np.arange(s) + (cfg["pad_token_id"] + 1 if roberta else 0)
    x = t["embeddings.word_embeddings.weight"][ids] + t["embeddings.position_embeddings.weight"][pos]
    x = x + t["embeddings.token_type_embeddings.weight"][np.zeros(s, int) if types is None else types]
    x = _ln(x, t["embeddings.LayerNorm.weight"], t["embeddings.LayerNorm.bias"], eps)
    n = cfg["num_attention_heads"]
    hd = cfg["hidden_size"] // n
    lin = lambda x, name: x @ t[name + ".weight"].T + t[name + ".bias"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q, k, v = (lin(x, p + f"attention.self.{m}").reshape(s, n, hd).transpose(1, 0, 2) for m in ("query", "key", "value"))
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd)  # [N, S, S]
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        att = (probs @ v).transpose(1, 0, 2).reshape(s, -1)
        x = _ln(x + lin(att, p + "attention.output.dense"), t[p + "attention.output.LayerNorm.weight"],
                t[p + "attention.output.LayerNorm.bias"], eps)
        h = _gelu(lin(x, p + "intermediate.dense"))
        x = _ln(x + lin(h, p + "output.dense"), t[p + "output.LayerNorm.weight"], t[p + "output.LayerNorm.bias"], eps)
    return x


def reference_logits(tensors: dict, cfg: dict, ids, types=None) -> np.ndarray:
    """[L] logits of a *ForSequenceClassification model (unprefixed encoder tensors + head tensors)."""
    first = reference_hidden(tensors, cfg, ids, types)[0]
    h = {k: v.astype(np.float64) for k, v in head_tensors(cfg).items()}
    if cfg["model_type"] == "bert":
        x = np.tanh(first @ h["pooler.dense.weight"].T + h["pooler.dense.bias"])
        return x @ h["classifier.weight"].T + h["classifier.bias"]
    x = np.tanh(first @ h["classifier.dense.weight"].T + h["classifier.dense.bias"])
    return x @ h["classifier.out_proj.weight"].T + h["classifier.out_proj.bias"]


def reference_embedding(tensors: dict, cfg: dict, ids: np.ndarray, pooling: str, normalize: bool = True) -> np.ndarray:
    h = reference_hidden(tensors, cfg, ids)
    vec = {"mean": h.mean(0), "max": h.max(0), "cls": h[0], "lasttoken": h[-1]}[pooling]
    return vec / np.linalg.norm(vec) if normalize else vec
