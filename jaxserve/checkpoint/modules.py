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


def inside(path: Path, name: str, what: str) -> Path:
    """`path / name`, a checkpoint's own file or folder: a name an index or modules.json gives that leads out of
    the checkpoint's directory (absolute, `..`) is refused, never read nor listed in an error, and so is a hidden
    one (`.cache`, `.git`: not the checkpoint's, nor in its warm artifact's key). A file or folder of the checkpoint
    may be a link (a hub snapshot links each file to its blob; a variant of a model may link its module folders):
    the warm artifact's `model_digest` follows links, so it hashes all this lets through."""
    parts = Path(name).parts
    if Path(name).is_absolute() or ".." in parts:
        raise CheckpointError(f"{path}: {what} names {name!r}, outside the checkpoint's directory")
    if any(part.startswith(".") for part in parts):
        raise CheckpointError(f"{path}: {what} names {name!r}, a hidden file, not one of the checkpoint's own")
    return path / name


def folder(path: Path, module: dict) -> Path:
    """A listed module's folder, inside the checkpoint (`inside`)."""
    return inside(path, module.get("path", ""), f"modules.json's {kind(module)} module")


def module_config(path: Path, module: dict, missing=None) -> dict:
    """The config.json in a listed module's folder; CheckpointError where it is missing, unless `missing` is given."""
    file = folder(path, module) / "config.json"
    if missing is None and not file.exists():
        raise CheckpointError(f"modules.json names a {kind(module)} module but {file} is missing")
    return read_json(file, missing=missing)


def st_config(path: Path) -> dict:
    """config_sentence_transformers.json, or {} where the save has none."""
    return read_json(path / ST_CONFIG, missing={}) or {}


def is_multivector(path: Path) -> bool:
    """A MultiVectorEncoder or PyLate save (their model_type, or a MultiVectorMask module)."""
    if st_config(path).get("model_type") in ("MultiVectorEncoder", "ColBERT"):
        return True
    return any(kind(m) == "MultiVectorMask" for m in listed(path))
