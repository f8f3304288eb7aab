"""Model and embedding configuration, built once from a checkpoint's JSON files.

Everything below the loader takes frozen dataclasses; nothing reads
`config.json` deep inside model code. The architecture's config belongs to its
family (`jaxserve.models`); this module holds what sentence-transformers and
the task head add.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxserve.errors import CheckpointError
from jaxserve.models import ArchConfig, Family, family_of

POOLING_MODES = ("mean", "cls", "max", "lasttoken")


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
    def from_checkpoint(cls, path: Path, model: ArchConfig) -> "EmbeddingConfig":
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


def read_model_config(path: Path) -> tuple[Family, ArchConfig]:
    """The checkpoint's architecture family and its frozen config."""
    raw = _read_config(path)
    family = family_of(raw)
    return family, family.configure(raw)


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
