"""Model and embedding configuration, built once from a checkpoint's JSON files.

Everything below the loader takes frozen dataclasses; nothing reads
`config.json` deep inside model code. The architecture's config belongs to its
family (`jaxserve.models`); this module holds what sentence-transformers and
the task head add.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from jaxserve.checkpoint import llm_reranker
from jaxserve.checkpoint import modules as st_modules
from jaxserve.errors import CheckpointError, InputError

if TYPE_CHECKING:  # the families are Flax modules: a front-end process reads these configs without JAX
    from jaxserve.models import ArchConfig, Family

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# sentence-transformers' older Pooling configs: one flag per mode, in its output order
LEGACY_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """What the model's output is: pooled embeddings, or a sequence-classification head's logits."""

    kind: str = "embedding"  # embedding | classifier | sparse (SPLADE) | multivector (ColBERT)
    labels: tuple[str, ...] = ()  # classifier: label of each logit (id2label order)
    sparse: dict | None = None  # sparse: its SpladePooling config
    logit_score: llm_reranker.LogitScore | None = None  # classifier: a causal LM scored at its last token (LogitScore)

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


# torch activation classes a Dense module may name -> our names (jaxserve.heads.pooling.DENSE_ACTIVATIONS runs them)
TORCH_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.activation.ReLU": "relu",
    "torch.nn.modules.activation.GELU": "gelu",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.SiLU": "silu",
}


@dataclasses.dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers Dense module: Linear(in, out) then an activation, on the pooled vector."""

    path: str  # its folder in the checkpoint, e.g. 2_Dense
    in_features: int
    out_features: int
    bias: bool
    activation: str  # identity, tanh, relu, gelu, sigmoid, silu
    residual: bool = False  # sentence-transformers 6's use_residual: + x (or + x @ residual, in != out)


@dataclasses.dataclass(frozen=True)
class EmbeddingConfig:
    """Sentence-transformers semantics: how token states become one vector, and the prompts it knows.

    The pipeline is the checkpoint's own `modules.json`: Transformer, then
    Pooling (every mode; several modes are concatenated in sentence-transformers'
    order), then any Dense layers, then Normalize if (and only if) it is listed
    (last: a module after it is refused).
    """

    pooling: str = "mean"  # a mode of POOLING_MODES, or several joined by "+" (concatenated)
    max_seq_length: int = 512
    normalize: bool = True
    dense: tuple[DenseLayer, ...] = ()
    prompts: tuple[tuple[str, str], ...] = ()  # (name, text): prepended to the text before tokenizing
    default_prompt_name: str | None = None
    # the widths config.json says the vectors may be cut to (Matryoshka; as vLLM reads it); (): any width
    matryoshka_dimensions: tuple[int, ...] = ()
    # config_sentence_transformers.json's truncate_dim: the served width, cut after the modules run (None: full)
    truncate_dim: int | None = None
    # Task adapters (Jina-embeddings-v3): the one merged into the weights, and the others, whose prompts are refused
    task: str | None = None
    other_tasks: tuple[str, ...] = ()

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(self.pooling.split("+"))

    def out_dim(self, hidden: int) -> int:
        """Width of the final vector: the last module's, cut to `truncate_dim` (sentence-transformers' slice: a
        wider one keeps the full width)."""
        full = self.dense[-1].out_features if self.dense else hidden * len(self.modes)
        return full if self.truncate_dim is None else min(full, self.truncate_dim)

    def prompt(self, name: str | None = None, text: str | None = None) -> str | None:
        """The prompt text a request asks for: by `name`, as `text`, or the checkpoint's default."""
        if name is not None and text is not None:
            raise InputError("give `prompt_name` or `prompt`, not both")
        if text is not None:
            return text
        name = name if name is not None else self.default_prompt_name
        if name is None:
            return None
        if name in self.other_tasks:
            runs = f"the {self.task!r} adapter" if self.task else "no task adapter"
            raise InputError(f"prompt_name {name!r} is the prompt of another task adapter; this server runs {runs} "
                             f"(load the model with task {name!r} for it)")
        known = dict(self.prompts)
        if name not in known:
            names = ", ".join(repr(k) for k in known) or "none"
            shown = repr(name[:60]) + ("..." if len(name) > 60 else "")  # a request's value: bounded in the message
            raise InputError(f"unknown prompt_name {shown}; this model's prompts: {names}")
        return known[name]

    @classmethod
    def from_checkpoint(cls, path: Path, model: ArchConfig) -> "EmbeddingConfig":
        """Read `modules.json` with its modules' configs, `sentence_bert_config.json` and
        `config_sentence_transformers.json`.

        A plain transformers checkpoint (no `modules.json`) gets what
        sentence-transformers gives it: `plain_pooling`, not normalised.
        """
        modules = [] if st_modules.is_multivector(path) else st_modules.listed(path)  # multi-vector: heads.multivector
        pooling, normalize, dense = "mean" if modules else plain_pooling(path), False, []
        for module in modules:
            kind = st_modules.kind(module)
            if normalize and kind in ("Pooling", "Dense"):
                raise CheckpointError(f"modules.json lists a {kind} module ({module.get('path')!r}) after Normalize; "
                                      "jaxserve normalises the final vector only (Normalize must come last)")
            if kind == "Pooling":
                pooling = pooling_mode(st_modules.module_config(path, module))
            elif kind == "Dense":
                dense.append(dense_layer(st_modules.module_config(path, module), module.get("path", "")))
            elif kind == "Normalize":
                normalize = True
            elif kind in ("SpladePooling", "LogitScore"):  # heads of their own (HeadConfig): no dense pooling
                continue
            elif kind not in ("Transformer", "MLMTransformer"):
                raise CheckpointError(f"modules.json lists a {module.get('type')!r} module, which jaxserve cannot run "
                                      "(it runs Transformer, Pooling, Dense and Normalize)")
        max_len = max_seq_length(path, model)
        st_config = st_modules.st_config(path)
        prompts = tuple((str(k), str(v)) for k, v in (st_config.get("prompts") or {}).items())
        default = st_config.get("default_prompt_name")
        task, adapters = getattr(model, "task", None), getattr(model, "adapters", ())
        if adapters:  # config.json's task_instructions where the save has none of that name; the task's is default
            prompts += tuple(p for p in model.task_prompts if p[0] not in dict(prompts))
            if task in dict(prompts):
                default = task
            elif default in adapters:  # another task's prompt is never the default
                default = None
        if default is not None and default not in dict(prompts):
            raise CheckpointError(f"default_prompt_name {default!r} is not one of the checkpoint's prompts")
        return cls(pooling=pooling, max_seq_length=max_len, normalize=normalize, dense=tuple(dense),
                   prompts=prompts, default_prompt_name=default, task=task,
                   other_tasks=tuple(t for t in adapters if t != task),
                   matryoshka_dimensions=matryoshka_dimensions(path), truncate_dim=truncate_dim(st_config))


def truncate_dim(st_config: dict) -> int | None:
    """config_sentence_transformers.json's `truncate_dim`: the width sentence-transformers' `encode` cuts the
    vectors to after its modules (None: none set)."""
    return positive_or_none(st_config.get("truncate_dim"), "config_sentence_transformers.json's truncate_dim")


def positive_or_none(value, what: str) -> int | None:
    """A sentence-transformers setting that is a positive integer or unset (None); else CheckpointError."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise CheckpointError(f"{what} {value!r} is not a positive integer")
    return value


def plain_pooling(path: Path) -> str:
    """The pooling sentence-transformers gives a checkpoint without `modules.json`: the last token for a causal
    LM (config.json's first architecture a `...ForCausalLM`, its `is_causal` not false), else the mean."""
    raw = _read_config(path)
    archs = raw.get("architectures") or [""]
    causal = isinstance(archs[0], str) and archs[0].endswith("ForCausalLM") and raw.get("is_causal", True)
    return "lasttoken" if causal else "mean"


def matryoshka_dimensions(path: Path) -> tuple[int, ...]:
    """The widths config.json's `matryoshka_dimensions` says the vectors may be cut to, sorted (its integers
    only; absent or not a list: none, any width)."""
    dims = _read_config(path).get("matryoshka_dimensions")
    if not isinstance(dims, list):
        return ()
    return tuple(sorted({d for d in dims if isinstance(d, int) and not isinstance(d, bool) and d > 0}))


# sentence-transformers' Transformer module config, under its current and its legacy names, first found wins
SBERT_CONFIG_FILES = ("sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
                      "sentence_camembert_config.json", "sentence_albert_config.json",
                      "sentence_xlm-roberta_config.json", "sentence_xlnet_config.json")


def transformer_module_config(path: Path) -> dict:
    """The Transformer module's saved config (`sentence_bert_config.json` or a legacy name), or {}."""
    for name in SBERT_CONFIG_FILES:
        if (path / name).exists():
            return st_modules.read_json(path / name) or {}
    return {}


def max_seq_length(path: Path, model: ArchConfig) -> int:
    """The truncation length, resolved as sentence-transformers' Transformer module resolves it.

    In order: `model_max_length` among the module's processor (tokenizer) kwargs; else its
    `max_seq_length` (what sentence-transformers < 6 saved); else the tokenizer's own
    `model_max_length` (tokenizer_config.json: where 6.x keeps it), capped at config.json's
    `max_position_embeddings`. Only the last is capped there by sentence-transformers; jaxserve caps
    every answer at the positions the model can index, beyond which sentence-transformers fails.
    """
    sbert = transformer_module_config(path)
    kwargs = sbert.get("processor_kwargs") or sbert.get("tokenizer_args") or {}
    limit = kwargs.get("model_max_length")
    if limit is None:
        limit = sbert.get("max_seq_length")
    if limit is None:
        tok_file = path / "tokenizer_config.json"
        limit = st_modules.read_json(tok_file, missing={}).get("model_max_length")
        positions = _read_config(path).get("max_position_embeddings")
        if isinstance(positions, int) and positions != -1:
            limit = positions if limit is None else min(int(limit), positions)
    try:
        limit = int(limit) if limit is not None else model.max_positions
    except (TypeError, ValueError):
        raise CheckpointError(f"{path}: max sequence length {limit!r} is not an integer") from None
    if limit < 1:
        raise CheckpointError(f"{path}: max sequence length {limit} is not positive")
    return min(limit, model.max_positions)


def pooling_mode(raw: dict) -> str:
    """The pooling mode(s) a sentence-transformers Pooling config turns on ("+"-joined, in its output order)."""
    if raw.get("include_prompt", True) is False:
        raise CheckpointError("this checkpoint's Pooling leaves prompt tokens out (include_prompt: false), "
                              "which jaxserve does not support")
    mode = raw.get("pooling_mode")
    if mode is not None:
        modes = [mode] if isinstance(mode, str) else list(mode)
    else:
        modes = [m for key, m in LEGACY_POOLING_FLAGS.items() if raw.get(key)]
    bad = [m for m in modes if m not in POOLING_MODES]
    if not modes or bad:
        raise CheckpointError(f"unsupported pooling config {raw}: pooling modes must be among {', '.join(POOLING_MODES)}")
    return "+".join(modes)


def dense_layer(raw: dict, folder: str, reads: str = "sentence_embedding") -> DenseLayer:
    """A Dense module's config. On the pooled vector (`reads` sentence_embedding) its default activation is
    sentence-transformers' Tanh; on a multi-vector model's tokens (token_embeddings) PyLate's Identity."""
    default = "torch.nn.modules.activation.Tanh" if reads == "sentence_embedding" else "torch.nn.modules.linear.Identity"
    activation = raw.get("activation_function", default)
    if activation not in TORCH_ACTIVATIONS:
        raise CheckpointError(f"Dense module {folder} uses activation {activation!r}; supported: "
                              f"{', '.join(TORCH_ACTIVATIONS)}")
    source = raw.get("module_input_name", reads)
    if source != reads:
        raise CheckpointError(f"Dense module {folder} reads {source!r}; jaxserve runs this model's Dense layers on "
                              f"{reads} only")
    try:
        return DenseLayer(folder, int(raw["in_features"]), int(raw["out_features"]), bool(raw.get("bias", True)),
                          TORCH_ACTIVATIONS[activation], bool(raw.get("use_residual", False)))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"Dense module {folder}: config.json lacks in_features/out_features ({exc})") from None


def read_model_config(path: Path, task: str | None = None) -> tuple[Family, ArchConfig]:
    """The checkpoint's architecture family and its frozen config; `task` chooses a task adapter (LoRA) where
    the checkpoint has them (Jina-embeddings-v3), merged into the weights at load."""
    from jaxserve.models import family_of  # the families import JAX: only a process that runs the model reads them

    raw = _read_config(path)
    family = family_of(raw)
    cfg = family.configure(raw)
    if task is None:
        return family, cfg
    if not getattr(cfg, "adapters", ()):
        raise CheckpointError(f"task {task!r} asked for, but {path} has no task adapters (lora_adaptations)")
    return family, cfg.with_task(task)


def read_head_config(path: Path, name: str | None = None) -> HeadConfig:
    """The model's head: a multi-vector (ColBERT) save, a SPLADE pooling module in `modules.json`
    (sentence-transformers' SparseEncoder), a LogitScore module or the hub's Qwen3-Reranker (`name`: the model
    asked for; an LLM reranker: one score), else what config.json's architecture says."""
    if st_modules.is_multivector(path):
        return HeadConfig("multivector")
    if llm_reranker.is_qwen3_reranker(path, name):
        return HeadConfig("classifier", ("score",), logit_score=llm_reranker.hub_logit_score(path))
    score = llm_reranker.logit_score(path)
    if score is not None:
        return HeadConfig("classifier", ("score",), logit_score=score)
    for module in st_modules.listed(path):
        if st_modules.kind(module) == "SpladePooling":
            return HeadConfig("sparse", sparse=st_modules.module_config(path, module))
    return HeadConfig.from_dict(_read_config(path))


def _read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.exists():
        raise CheckpointError(f"{path} has no config.json (found: {_listing(path)})")
    return st_modules.read_json(file)


def _listing(path: Path) -> str:
    names = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    return ", ".join(names) or "nothing"
