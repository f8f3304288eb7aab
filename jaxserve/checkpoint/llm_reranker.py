"""A causal LM used as a reranker, as sentence-transformers 6 saves it: a `CrossEncoder` whose Transformer module
runs the `text-generation` task and whose `LogitScore` module scores a pair by the logits of its true ("yes") and
false ("no") tokens at the last position.

Only those one or two rows of the LM head matter: the score is `h · (W[yes] - W[no])` for the last token's hidden
state h, so the head is a single-output linear layer on the last token, never a vocabulary-wide output.

A pair reaches the model as sentence-transformers feeds it: through the chat template with one message per role
(`query`, `document`) when the save's Transformer module takes messages, else as the tokenizer's own pair. The hub's
Qwen3-Reranker (a plain causal LM, no sentence-transformers modules) gets its model card's prompt instead, whose
instruction a request may set (`with_instruction`: the card's `format_instruction(instruction, query, doc)`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from jaxserve.checkpoint import modules as st_modules
from jaxserve.checkpoint.tokenize import TextTokenizer
from jaxserve.errors import CheckpointError, InputError, TooLongError

PAIR_ROLES = ("query", "document")  # sentence-transformers' roles for the two halves of a pair
LM_HEAD = "lm_head.weight"
EMBEDDINGS = ("model.embed_tokens.weight", "embed_tokens.weight")  # a tied head's rows


@dataclasses.dataclass(frozen=True)
class LogitScore:
    """sentence-transformers' LogitScore: the true token's logit, minus the false token's when it has one."""

    true_token_id: int
    false_token_id: int | None = None

    @classmethod
    def from_module(cls, raw: dict) -> "LogitScore":
        source = raw.get("module_input_name", "causal_logits")
        if source != "causal_logits":
            raise CheckpointError(f"LogitScore reads {source!r}; jaxserve scores causal_logits only")
        try:
            true = int(raw["true_token_id"])
            false = None if raw.get("false_token_id") is None else int(raw["false_token_id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"LogitScore config {raw} lacks an integer true_token_id ({exc})") from None
        return cls(true, false)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return (self.true_token_id,) if self.false_token_id is None else (self.true_token_id, self.false_token_id)


def logit_score(path: Path) -> LogitScore | None:
    """The save's LogitScore module, or None where `modules.json` lists none."""
    for module in st_modules.listed(path):
        if st_modules.kind(module) == "LogitScore":
            if st_modules.st_config(path).get("default_prompt_name"):
                raise CheckpointError(f"{path}: a default prompt on an LLM reranker is not supported by jaxserve "
                                      "(put the instruction in its chat template)")
            return LogitScore.from_module(st_modules.module_config(path, module))
    return None


def score_kernel(path: Path, score: LogitScore, hidden_size: int, vocab_size: int) -> np.ndarray:
    """[D, 1] float32: the LM head's true row minus its false row (the tied input embeddings where the checkpoint
    has no `lm_head.weight`), read from the safetensors files without loading the rest of the head."""
    from safetensors import safe_open

    bad = [t for t in score.token_ids if not 0 <= t < vocab_size]
    if bad:
        raise CheckpointError(f"LogitScore token ids {bad} are outside the vocabulary of {vocab_size}")
    files = sorted(path.glob("model*.safetensors"))
    for name in (LM_HEAD, *EMBEDDINGS):
        for file in files:
            with safe_open(str(file), framework="numpy") as f:
                if name not in f.keys():
                    continue
                rows = f.get_slice(name)
                shape = tuple(rows.get_shape())
                if shape != (vocab_size, hidden_size):
                    raise CheckpointError(f"{name} has shape {shape}; config.json says ({vocab_size}, {hidden_size})")
                picked = [np.asarray(rows[t : t + 1], np.float32)[0] for t in score.token_ids]
                diff = picked[0] - picked[1] if len(picked) == 2 else picked[0]
                return diff[:, None]
    raise CheckpointError(f"{path} has neither {LM_HEAD} nor tied input embeddings to score the LogitScore tokens")


@dataclasses.dataclass(frozen=True)
class PairTemplate:
    """The chat template a text-generation CrossEncoder renders each (query, document) pair with."""

    template: str
    kwargs: tuple[tuple[str, object], ...] = ()  # the save's chat_template processing kwargs (add_generation_prompt, ...)

    def render(self, query: str, document: str) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        messages = [{"role": r, "content": c} for r, c in zip(PAIR_ROLES, (query, document))]
        rendered, _ = render_jinja_template([messages], chat_template=self.template, **dict(self.kwargs))
        return rendered[0]

    def suffix(self, query: str, document: str) -> str:
        """What the template writes after the document's content."""
        marker = "\x00jaxserve-document-end\x00"
        rendered = self.render(query, document + marker)
        return rendered[rendered.rindex(marker) + len(marker):]

    def sequences(self, tokenizer: TextTokenizer, pairs: list[tuple[str, str]], truncate: bool,
                  direction: str = "right") -> list[np.ndarray]:
        """Each pair rendered and tokenized without special tokens (as `apply_chat_template`). One over the model's
        length is cut at the `direction` end; cut on the right it then ends in the template's suffix again, as
        sentence-transformers restores it (the scored last position stays the template's, e.g. the assistant turn)."""
        limit = tokenizer.max_length
        seqs = tokenizer.encode_bodies([self.render(q, d) for q, d in pairs])
        for i, ids in enumerate(seqs):
            if len(ids) <= limit:
                continue
            _check_truncate(truncate, i, len(ids), limit)
            if direction == "left":
                seqs[i] = ids[-limit:]
                continue
            suffix = tokenizer.encode_bodies([self.suffix(*pairs[i])])[0][:limit]
            seqs[i] = np.concatenate([ids[: limit - len(suffix)], suffix])
        return seqs


@dataclasses.dataclass(frozen=True)
class Qwen3RerankerPrompt:
    """The prompt Qwen3-Reranker's model card builds by hand around each pair: a fixed system turn, the instruction,
    query and document in the user turn, an empty thinking block in the assistant turn. The three parts are tokenized
    apart, and only the middle one is truncated (on the right), as the card's code does."""

    instruction: str = "Given a web search query, retrieve relevant passages that answer the query"
    prefix: str = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                   'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
    suffix: str = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

    def body(self, query: str, document: str) -> str:
        return f"<Instruct>: {self.instruction}\n<Query>: {query}\n<Document>: {document}"

    def sequences(self, tokenizer: TextTokenizer, pairs: list[tuple[str, str]], truncate: bool,
                  direction: str = "right") -> list[np.ndarray]:
        head, tail = tokenizer.encode_bodies([self.prefix, self.suffix])
        room = tokenizer.max_length - len(head) - len(tail)
        if room < 1:
            raise CheckpointError(f"the reranker prompt has {len(head) + len(tail)} tokens, leaving no room for a pair "
                                  f"within the model's limit of {tokenizer.max_length}")
        seqs = []
        for i, body in enumerate(tokenizer.encode_bodies([self.body(q, d) for q, d in pairs])):
            if len(body) > room:
                _check_truncate(truncate, i, len(body) + len(head) + len(tail), tokenizer.max_length)
                body = body[:room] if direction == "right" else body[-room:]
            seqs.append(np.concatenate([head, body, tail]))
        return seqs


def with_instruction(template: PairTemplate | Qwen3RerankerPrompt | None, instruction: str | None):
    """The pairs' template with a request's `instruction` in its slot (Qwen3-Reranker's `<Instruct>`, where the card's
    default stands otherwise); None: the template as loaded. A template without that slot refuses one: a chat
    template or the tokenizer's pair would silently drop it."""
    if instruction is None:
        return template
    if not isinstance(template, Qwen3RerankerPrompt):
        raise InputError("`instruction` is for rerankers whose prompt has an instruction slot (Qwen3-Reranker); "
                         "this model's has none")
    if not isinstance(instruction, str):
        raise InputError(f"`instruction` must be a string, not {type(instruction).__name__}")
    if not instruction.strip():
        raise InputError("`instruction` must not be empty (leave it out for the model card's)")
    return dataclasses.replace(template, instruction=instruction)


def _check_truncate(truncate: bool, i: int, n: int, limit: int) -> None:
    if not truncate:
        raise TooLongError(f"input {i} has {n} tokens, over the model's limit of {limit} (allow truncation)")


def pair_template(path: Path, name: str | None = None) -> PairTemplate | Qwen3RerankerPrompt | None:
    """How pairs reach the model: the hub's Qwen3-Reranker prompt (`is_qwen3_reranker`); the chat template, where
    the save's Transformer module takes messages; else None (the tokenizer's own pair template)."""
    from jaxserve.checkpoint.config import transformer_module_config

    if is_qwen3_reranker(path, name):
        return Qwen3RerankerPrompt()
    sbert = transformer_module_config(path)
    if "message" not in (sbert.get("modality_config") or {}):
        return None
    template = _chat_template(path)
    if template is None:
        raise CheckpointError(f"{path}: the Transformer module takes chat messages but the checkpoint has no chat "
                              "template (chat_template.jinja or tokenizer_config.json's chat_template)")
    kwargs = dict((sbert.get("processing_kwargs") or {}).get("chat_template") or {})
    kwargs.pop("restore_suffix", None)
    return PairTemplate(template, tuple(sorted(kwargs.items())))


def is_qwen3_reranker(path: Path, name: str | None) -> bool:
    """The hub's Qwen3-Reranker layout: a plain Qwen3ForCausalLM (no `modules.json`) whose name says it is one.
    Nothing in its files tells it from a base Qwen3 LM, which loads as an embedder; vLLM also needs it named
    (`hf_overrides`)."""
    named = str(name or path).rstrip("/").rsplit("/", 1)[-1].lower()
    if not named.startswith("qwen3-reranker") or (path / "modules.json").exists():
        return False
    archs = st_modules.read_json(path / "config.json", missing={}).get("architectures") or []
    return archs == ["Qwen3ForCausalLM"]


def hub_logit_score(path: Path) -> LogitScore:
    """The Qwen3-Reranker card's score: the logits of "yes" against "no" at the last token."""
    if not (path / "tokenizer.json").exists():
        raise CheckpointError(f"{path}: a Qwen3-Reranker checkpoint needs its tokenizer.json")
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = [tokenizer.token_to_id(t) for t in ("yes", "no")]
    if None in ids:
        raise CheckpointError(f"{path}: the tokenizer has no 'yes' and 'no' tokens for the reranker's score")
    return LogitScore(*ids)


def _chat_template(path: Path) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    raw = st_modules.read_json(path / "tokenizer_config.json", missing={}).get("chat_template")
    if isinstance(raw, list):  # named templates: transformers' default is the one named "default"
        raw = {t.get("name"): t.get("template") for t in raw}.get("default")
    return raw if isinstance(raw, str) else None

