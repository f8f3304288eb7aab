"""One reader for a sentence-transformers save: its JSON files and the modules `modules.json` lists.

Every head (pooled embeddings, SPLADE, multi-vector, classifiers) reads the checkpoint's modules
through these few functions, so a module's kind, its folder's config and a missing or broken file are
handled one way.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxserve.errors import CheckpointError

ST_CONFIG = "config_sentence_transformers.json"  # sentence-transformers' own: prompts, model_type, PyLate's knobs


def read_json(file: Path, missing=None):
    """A JSON file's content, CheckpointError if it cannot be read; `missing` (when given) if it does not exist."""
    if missing is not None and not file.exists():
        return missing
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from exc


def listed(path: Path) -> list[dict]:
    """The modules `modules.json` lists, in order ([] for a plain transformers checkpoint)."""
    return read_json(path / "modules.json", missing=[]) or []


def kind(module: dict) -> str:
    """A listed module's class name: `sentence_transformers.models.Pooling` -> `Pooling`."""
    return module.get("type", "").rsplit(".", 1)[-1]


def module_config(path: Path, module: dict) -> dict:
    """The config.json in a listed module's folder, which must exist."""
    file = path / module.get("path", "") / "config.json"
    if not file.exists():
        raise CheckpointError(f"modules.json names a {kind(module)} module but {file} is missing")
    return read_json(file)


def st_config(path: Path) -> dict:
    """config_sentence_transformers.json, or {} where the save has none."""
    return read_json(path / ST_CONFIG, missing={}) or {}


def is_multivector(path: Path) -> bool:
    """A MultiVectorEncoder or PyLate save (their model_type, or a MultiVectorMask module)."""
    if st_config(path).get("model_type") in ("MultiVectorEncoder", "ColBERT"):
        return True
    return any(kind(m) == "MultiVectorMask" for m in listed(path))
