"""Model and embedding configuration, built once from a checkpoint's JSON files.

Everything below the loader takes these frozen dataclasses; nothing reads
`config.json` deep inside model code.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxserve.errors import CheckpointError

# Families whose encoder layout matches BERT's; they differ only in how
# position ids are counted (RoBERTa/XLM-R start after the padding index).
SUPPORTED_MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
POSITION_OFFSET_FROM_PAD = ("roberta", "xlm-roberta")

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "silu", "swish")

POOLING_MODES = ("mean", "cls", "max", "lasttoken")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The encoder's architecture (what `config.json` says)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    # Added to every position id: 0 for BERT, pad_token_id + 1 for RoBERTa/XLM-R.
    position_offset: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_positions(self) -> int:
        """Longest sequence the position table can index."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"unsupported model_type {model_type!r} in config.json "
                f"(architectures={raw.get('architectures')}); supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise CheckpointError(
                f"unsupported position_embedding_type {raw['position_embedding_type']!r}; only 'absolute'"
            )
        act = raw.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise CheckpointError(f"unsupported hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}")
        required = (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size", "max_position_embeddings",
        )
        missing = [k for k in required if not isinstance(raw.get(k), int)]
        if missing:
            raise CheckpointError(f"config.json lacks integer field(s): {', '.join(missing)}")
        if raw["hidden_size"] % raw["num_attention_heads"]:
            raise CheckpointError(
                f"hidden_size {raw['hidden_size']} is not divisible by num_attention_heads {raw['num_attention_heads']}"
            )
        pad = int(raw.get("pad_token_id") or 0)
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=raw["num_attention_heads"],
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=raw["max_position_embeddings"],
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            hidden_act=act,
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            pad_token_id=pad,
            position_offset=pad + 1 if model_type in POSITION_OFFSET_FROM_PAD else 0,
        )


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """What the model's output is: pooled embeddings, or a sequence-classification head's logits."""

    kind: str = "embedding"  # embedding | classifier
    labels: tuple[str, ...] = ()  # classifier: label of each logit (id2label order)

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @classmethod
    def from_dict(cls, raw: dict) -> "HeadConfig":
        archs = raw.get("architectures") or []
        if not any(a.endswith("ForSequenceClassification") for a in archs):
            return cls()
        n = int(raw.get("num_labels") or len(raw.get("id2label") or {}) or 2)
        id2label = {int(k): v for k, v in (raw.get("id2label") or {}).items()}
        return cls("classifier", tuple(id2label.get(i, f"LABEL_{i}") for i in range(n)))


@dataclasses.dataclass(frozen=True)
class EmbeddingConfig:
    """Sentence-transformers semantics: how token states become one vector."""

    pooling: str = "mean"
    max_seq_length: int = 512
    normalize: bool = True

    @classmethod
    def from_checkpoint(cls, path: Path, model: ModelConfig) -> "EmbeddingConfig":
        """Read `modules.json`, the pooling config and `sentence_bert_config.json`.

        A plain transformers checkpoint (no `modules.json`) gets what
        sentence-transformers gives it: mean pooling at the model's full length.
        """
        pooling = "mean"
        modules = _read_json(path / "modules.json") if (path / "modules.json").exists() else []
        for module in modules:
            if module.get("type", "").endswith("models.Pooling"):
                pooling_file = path / module.get("path", "") / "config.json"
                if not pooling_file.exists():
                    raise CheckpointError(f"modules.json names a Pooling module but {pooling_file} is missing")
                pooling = pooling_mode(_read_json(pooling_file))
        max_len = model.max_positions
        sbert = path / "sentence_bert_config.json"
        if sbert.exists():
            max_len = min(max_len, int(_read_json(sbert).get("max_seq_length") or max_len))
        return cls(pooling=pooling, max_seq_length=max_len)


def pooling_mode(raw: dict) -> str:
    """The one pooling mode a sentence-transformers Pooling config turns on."""
    flags = {
        "mean": raw.get("pooling_mode_mean_tokens", False),
        "cls": raw.get("pooling_mode_cls_token", False),
        "max": raw.get("pooling_mode_max_tokens", False),
        "lasttoken": raw.get("pooling_mode_lasttoken", False),
    }
    unsupported = [
        k for k in ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens") if raw.get(k)
    ]
    chosen = [k for k, on in flags.items() if on]
    if unsupported or len(chosen) != 1 or chosen[0] not in POOLING_MODES:
        raise CheckpointError(
            f"unsupported pooling config {raw}: exactly one of {', '.join(POOLING_MODES)} must be on"
        )
    return chosen[0]


def read_model_config(path: Path) -> ModelConfig:
    return ModelConfig.from_dict(_read_config(path))


def read_head_config(path: Path) -> HeadConfig:
    return HeadConfig.from_dict(_read_config(path))


def _read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.exists():
        raise CheckpointError(f"{path} has no config.json (found: {_listing(path)})")
    return _read_json(file)


def _read_json(file: Path):
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from exc


def _listing(path: Path) -> str:
    names = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    return ", ".join(names) or "nothing"
