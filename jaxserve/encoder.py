"""`Encoder`: a checkpoint loaded for embedding, the package's Python API.

    enc = Encoder.from_pretrained(None)          # bundled all-MiniLM-L6-v2
    vectors = enc.embed(["a document", ...])     # [N, dim] float32, input order
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.checkpoint import llm_reranker, loader
from jaxserve.checkpoint import modules as st_modules
from jaxserve.checkpoint.config import EmbeddingConfig, read_head_config, read_model_config, transformer_module_config
from jaxserve.checkpoint.tokenize import Pieces, TextTokenizer
from jaxserve.dims import ModelDims
from jaxserve.errors import CheckpointError, InputError, TableError
from jaxserve.heads import bge_m3, multivector, sparse
from jaxserve.heads.forwards import (
    classify_forward,
    embed_forward,
    m3_forward,
    multivector_forward,
    sparse_forward,
    tokens_forward,
)
from jaxserve.models import ArchConfig, Family
from jaxserve.models import attention as attention_kernels
from jaxserve.models.attention import CHOICES as ATTENTION_CHOICES
from jaxserve.runtime import buckets, derivation, device, warm
from jaxserve.runtime.buckets import BucketTable
from jaxserve.runtime.derivation import TableOptions
from jaxserve.runtime.device import DEFAULT_HEADROOM
from jaxserve.runtime.engine import Engine
from jaxserve.scheduling.jobs import Job
from jaxserve.scheduling.pipeline import run_jobs
from jaxserve.scheduling.planner import Rows, pack
from jaxserve.view import Architecture, ModelView, normalize_rows

log = logging.getLogger("jaxserve")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# a climb for --device-memory above the live pool that reached a bucket too big to run here
CLIMB_REMEDY = ("It was derived for --device-memory above this device's pool: leave that out to serve here, or "
                "derive for the larger device with `jaxserve buckets --device-memory BYTES --write FILE`, which runs "
                "nothing.")


def batch_of(inputs: str | Iterable, pairs: bool = False) -> tuple[list, Callable]:
    """The Python API's inputs as a list, and what shapes its result: a str is one input answered as one
    (`embed("x")` -> [dim], as sentence-transformers' `encode`, whose batch axis is a list's), any other iterable
    a batch, read once here (a generator too). Each element must be a str (`pairs`: or a (str, str) pair), checked
    before any tokenizing or warm-up: else InputError naming the first that is not."""
    if isinstance(inputs, str):
        return [inputs], _first
    if not isinstance(inputs, Iterable):
        raise InputError(f"inputs must be a str or an iterable of str, not {type(inputs).__name__}")
    items = inputs if isinstance(inputs, list) else list(inputs)
    for i, x in enumerate(items):
        if not (isinstance(x, str) or pairs and isinstance(x, (list, tuple)) and len(x) == 2
                and all(isinstance(t, str) for t in x)):
            raise InputError(f"input {i} is {type(x).__name__}, not a str{' or a (str, str) pair' if pairs else ''}")
    return items, _batch


def _first(out):
    """A batch of one's result as one input's: its row (of each output, for a dict of them)."""
    return {k: None if v is None else v[0] for k, v in out.items()} if isinstance(out, dict) else out[0]


def _batch(out):
    return out


def resolve_dtype(dtype: str) -> str:
    """`auto`: float32 on a CPU (no faster bf16 matmul there), bfloat16 on GPUs and TPUs."""
    if dtype == "auto":
        return "float32" if jax.devices()[0].platform == "cpu" else "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, not {dtype!r}")
    return dtype


@dataclasses.dataclass
class Encoder(ModelView):
    """A checkpoint loaded for embedding: its host side (`ModelView`: configs, tokenizer, heads) and its device
    side (the architecture's Flax module, the engine holding the weights and executables)."""

    engine: Engine  # weights on device; compiled buckets
    family: Family = dataclasses.field(kw_only=True)
    model_config: ArchConfig = dataclasses.field(kw_only=True)
    last_dispatches: list = dataclasses.field(default_factory=list, repr=False, kw_only=True)  # the last `run`'s batches
    # held while a first use warms a table: a second caller waits, then runs on the table it installed
    _warming: threading.RLock = dataclasses.field(default_factory=threading.RLock, init=False, repr=False)

    def __post_init__(self):
        """Every pooled table the engine installs fits this view's limits to it (`fit_to`): derived, given or a
        warm artifact's, through `warmup`, `start` or a server; an engine that comes warm (a simulated one) now."""
        super().__post_init__()
        if self.engine.table is not None:
            self.fit_to(self.engine.table)
        if hasattr(self.engine, "on_install"):  # one that installs tables (a simulated one never does)
            self.engine.on_install = self._installed

    def _installed(self, table: BucketTable, output: str) -> None:
        if output == "pooled":
            self.fit_to(table)

    @classmethod
    def from_pretrained(
        cls, name: str | None = None, dtype: str = "auto", buckets: BucketTable | str | Path | None = None,
        devices: int | str = 1, attention: str = "auto", task: str | None = None,
    ) -> "Encoder":
        """Load a checkpoint. With `buckets` (a table or its JSON file) the engine is warmed at once;
        otherwise on first use, with the table derived for this device.

        `dtype`: of weights and activations (pooled outputs are float32 whatever it is);
        `auto` is float32 on a CPU, bfloat16 on accelerators.
        `devices`: how many local devices share each batch (an int, or "all"): data parallel,
        weights replicated, batch axis sharded.
        `attention`: auto, pallas, cudnn, xla or blockwise (`attention.plan`); per bucket, an
        implementation that cannot take it or fails to compile falls back to the next.
        `task`: the task adapter (LoRA) of a checkpoint that has them (Jina-embeddings-v3), merged into the
        weights at load (default `$JAXSERVE_TASK`; unset: none); its prompt is the default prompt."""
        dtype = resolve_dtype(dtype)
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, not {attention!r}")
        path = loader.resolve(name)
        family, cfg = read_model_config(path, loader.task_named(task))
        head = read_head_config(path, loader.named(name))
        emb = EmbeddingConfig.from_checkpoint(path, cfg)
        tokenizer = TextTokenizer.from_dir(path, emb.max_seq_length,
                                           lowercase=bool(transformer_module_config(path).get("do_lower_case")))
        jdtype = DTYPES[dtype]
        shapes = family.param_shapes(cfg, jdtype, head.num_labels)
        if head.logit_score is None:
            params = loader.load_params(path, family, cfg, shapes, dtype=jdtype)
        else:  # an LLM reranker: the encoder's weights, then the LM head's true/false rows as a one-output head
            causal = all(spec.causal for spec in getattr(cfg, "specs", ()))  # not EmbeddingGemma's bidirectional
            if family.head is None or family.pooling_for_head(cfg) != "lasttoken" or not causal:
                raise CheckpointError(f"a LogitScore reranker needs a causal decoder; {family.name} "
                                      f"{'' if causal else 'with bidirectional attention '}is not one")
            params = loader.load_params(path, family, cfg, {k: v for k, v in shapes.items() if k != "head"},
                                        dtype=jdtype)
            kernel = llm_reranker.score_kernel(path, head.logit_score, cfg.hidden_size, cfg.vocab_size)
            params["head"] = {"score": {"kernel": kernel.astype(jdtype)}}
        if emb.dense and head.kind == "embedding":
            params["dense"] = loader.load_dense(path, emb.dense)
        splade = (sparse.SparseConfig.from_module(head.sparse, cfg.vocab_size,
                                                  max_active_dims=st_modules.st_config(path).get("max_active_dims"))
                  if head.kind == "sparse" else None)
        if splade is not None:
            params["mlm"] = sparse.load_head(path, family.name, cfg, jdtype)
        colbert = (multivector.from_checkpoint(path, tokenizer, cfg.hidden_size, emb.max_seq_length,
                                               cfg.max_positions)
                   if head.kind == "multivector" else None)
        if colbert is not None:  # its sequences are at most its query or document length: the buckets' limit
            multivector.check_windows(colbert, getattr(cfg, "specs", ()))
            emb = dataclasses.replace(emb, max_seq_length=max(colbert.lengths))
            if colbert.dense:
                params["dense"] = loader.load_dense(path, colbert.dense)
        m3 = None
        if head.kind == "embedding" and bge_m3.is_checkpoint(path):  # its dense output is CLS, normalised
            if emb.dense or emb.truncate_dim is not None:
                raise CheckpointError(f"{path}: a BGE-M3 checkpoint with Dense modules or a truncate_dim is not "
                                      "supported")
            m3, params["m3"] = bge_m3.from_checkpoint(path, tokenizer.tokenizer, cfg.hidden_size)
            emb = dataclasses.replace(emb, pooling="cls", normalize=True)
        params = jax.device_put(params)
        platform = jax.devices()[0].platform

        def forward(slots: int, seqlen: int, output: str, implementation: str):
            if output == "tokens" and colbert is not None:
                impl = multivector.attention_impl(implementation, colbert, seqlen)
                return partial(multivector_forward, family.encoder(cfg, jdtype, attention=attention_kernels.Kernel(
                    impl, slots)), colbert, cfg.vocab_size, slots)
            module = family.encoder(cfg, jdtype, attention=attention_kernels.Kernel(implementation, slots))
            if output == "tokens":
                if m3 is not None:
                    return partial(m3_forward, module, m3, slots)
                return partial(tokens_forward, module, slots)
            if splade is not None:
                return partial(sparse_forward, module, cfg, splade, slots)
            if head.kind == "classifier":
                head_module = family.head(cfg, head.num_labels, jdtype)
                return partial(classify_forward, module, head_module, family.pooling_for_head(cfg), slots,
                               pad_id=family.head_pad_id(cfg))
            return partial(embed_forward, module, emb, slots)
        local = jax.devices()
        count = len(local) if devices == "all" else int(devices)
        if not 1 <= count <= len(local):
            raise ValueError(f"devices must be 'all' or 1..{len(local)}, not {devices!r}")
        dims = cfg.dims(jnp.dtype(jdtype).itemsize)
        head_dim = dims.head_dim or dims.hidden // dims.heads
        engine = Engine(forward, params, local[:count],
                        plan=partial(attention_kernels.plan, attention, platform, head_dim=head_dim, dtype=dtype,
                                     devices=count),
                        spill=splade)
        template = llm_reranker.pair_template(path, loader.named(name)) if head.logit_score is not None else None
        enc = cls(path, Architecture.of(family.name, cfg), emb, tokenizer, engine, dtype, head, splade, colbert,
                  attention=attention, pair_template=template, m3=m3, family=family, model_config=cfg)
        if buckets is not None:
            enc.warmup(buckets if isinstance(buckets, BucketTable) else BucketTable.load(buckets))
        return enc

    @property
    def module(self):
        """The Flax encoder (dense attention): (token_ids, segment_ids, positions, type_ids) -> [B, S, D]."""
        return self.family.encoder(self.model_config, DTYPES[self.dtype])

    @property
    def params(self) -> dict:
        return self.engine.params

    @property
    def dims(self) -> ModelDims:
        return self.model_config.dims(jnp.dtype(DTYPES[self.dtype]).itemsize)

    def derive_table(
        self, ladder: str = "default", layout: str = "packed", device_memory: int | None = None, headroom: float = DEFAULT_HEADROOM,
        max_batch_tokens: int | None = None, max_batch: int | None = None, seqlens: list[int] | None = None,
        batch_multiple: int | None = None, batch_ladder: bool = True,
    ) -> BucketTable:
        """The bucket table for this model on this device, untimed (compiles each seqlen's largest batch to
        check its memory): what `jaxserve buckets` prints. Serving derives by climbing instead (`warmup`).

        With `device_memory` given, the table is derived for a device of that
        size, still with this backend's compiler doing the memory analysis.
        `batch_ladder` adds batches 1, 4, 16, ... below each seqlen's largest.
        Caps left as None are the device's (on an accelerator: memory and a token cap bound the batch).
        """
        opts = TableOptions(ladder, layout, tuple(seqlens) if seqlens else None, device_memory, headroom,
                            max_batch_tokens, max_batch, batch_multiple, batch_ladder)
        bounds, fields = self._derivation(opts)
        return buckets.derive(bounds.pop("seqlens"), self.dims, self.engine.weights_bytes, measure=self.engine.bucket_bytes,
                              batch_ladder=batch_ladder, **bounds, **fields)

    def climb_table(self, options: TableOptions = TableOptions(), progress: bool = False) -> BucketTable:
        """Derive and warm the table by climbing each seqlen's batch ladder to its throughput knee
        (`jaxserve.runtime.derivation`): only the kept buckets and one step past each knee are compiled."""
        bounds, fields = self._derivation(options)
        seqlens = bounds.pop("seqlens")
        ladders = derivation.climbs(seqlens, self.dims, self.engine.weights_bytes, **bounds,
                                    batch_ladder=options.batch_ladder, knee=options.knee)
        check = self._fits_check(options.headroom, remedy=CLIMB_REMEDY)
        warm.climb(self.engine, ladders, progress=progress, check=check)
        table = derivation.table_of(ladders, self.dims, self.engine.weights_bytes, bounds["devices"],
                                    budget_bytes=bounds["budget_bytes"], max_batch_tokens=bounds["max_batch_tokens"],
                                    layout=options.layout, host_dispatch_s=self.engine.host_dispatch_s, **fields)
        return self.engine.install(table)

    def _derivation(self, o: TableOptions) -> tuple[dict, dict]:
        """The derivation's bounds (seqlens, budget, caps; the device's defaults where `o` leaves None) and the
        table's descriptive fields."""
        info = device.describe(o.device_memory)
        label = info.kind if o.device_memory is None else f"{info.kind} compiler, {o.device_memory} bytes given"
        seqlens = list(o.seqlens) if o.seqlens else buckets.ladder(o.ladder, self.limits.max_seq_length)
        if self.colbert is not None:  # a query expansion past the seqlens is refused before anything compiles
            multivector.within(self.limits.colbert, seqlens[-1])
        bounds = dict(
            seqlens=seqlens,
            budget_bytes=device.budget_bytes(info.memory_bytes, o.headroom),
            max_batch_tokens=o.max_batch_tokens or info.max_batch_tokens, max_batch=o.max_batch or info.max_batch,
            multiple=o.batch_multiple or info.batch_multiple, layout=o.layout, devices=self.engine.devices,
        )
        fields = dict(ladder="custom" if o.seqlens else o.ladder, device=label, device_memory=info.memory_bytes)
        return bounds, fields

    def warmup(self, table: BucketTable | TableOptions | None = None, progress: bool = False) -> BucketTable:
        """Compile and time the buckets: a given `table` as it is, or one derived for this device (by climbing
        each seqlen's ladder to its throughput knee; `TableOptions` say how, default: the device's)."""
        if not isinstance(table, BucketTable):
            return self.climb_table(table or TableOptions(), progress)
        if table.max_seqlen < self.limits.max_seq_length:
            raise TableError(f"bucket table stops at seqlen {table.max_seqlen}, below the model's "
                             f"max_seq_length {self.limits.max_seq_length}")
        return warm.given(self.engine, self._budgeted_here(table), progress=progress, check=self._fits_check())

    def _budgeted_here(self, table: BucketTable) -> BucketTable:
        """A given table held to this device's pool, as `_fits_check` holds it: its device, memory, budget and
        weights then say so in /info, `?explain=1` and /v1/plan (they said the device it was derived for)."""
        info = device.describe()
        if table.device and table.device != info.kind:
            log.info("bucket table derived for %s; budgeted against this device's pool (%s, %d bytes)",
                     table.device, info.kind, info.memory_bytes)
        return dataclasses.replace(table, device=info.kind, device_memory=info.memory_bytes,
                                   budget_bytes=device.budget_bytes(info.memory_bytes, DEFAULT_HEADROOM),
                                   weights_bytes=self.engine.weights_bytes)

    def _fits_check(self, headroom: float | None = None, remedy: str = buckets.GIVEN_REMEDY):
        """The check against the live pool, of a given table's compiled buckets and of each bucket a climb runs
        (its budget another device's with `--device-memory` above this pool): within the budget derivation uses."""
        info = device.describe()
        headroom = DEFAULT_HEADROOM if headroom is None else headroom
        rule = (f"{headroom} x this device's pool of {info.memory_bytes} bytes, "
                f"{device.POOL_RULE.get(info.platform, device.POOL_RULE['gpu'])}")
        return partial(buckets.check_fits, budget_bytes=device.budget_bytes(info.memory_bytes, headroom),
                       weights_bytes=self.engine.weights_bytes,
                       fit=buckets.batch_fitter(info.batch_multiple, self.engine.devices), budget_rule=rule,
                       remedy=remedy)

    def start(self, table: BucketTable | TableOptions | None = None, cache: str | Path | None = None,
              tokens: bool = False, progress: bool = False, keep: int | None = None) -> BucketTable:
        """Ready the engine as `jaxserve serve` starts: the matching warm artifact's table and executables in
        `cache` (default $JAXSERVE_CACHE_DIR or ~/.cache/jaxserve), no compile; else `warmup`, then saved there
        and the model's artifacts pruned to the newest `keep` (default: --keep-artifacts'). `tokens`: /embed_all's
        token outputs too (a multi-vector or BGE-M3 model's always); an artifact with them (`serve`'s and
        `jaxserve warmup`'s by default) serves a start without."""
        from jaxserve.runtime import artifact, startup

        return startup.start(self, table or TableOptions(), tokens, startup.cache_root(cache), progress=progress,
                             keep=artifact.KEEP if keep is None else keep)

    def warm_table(self) -> BucketTable:
        """The table batches run at: the warm one, or (first use) one derived for this device and warmed now, once
        (two threads' warm-ups would each install a table dropping the other's executables)."""
        with self._warming:
            if self.engine.table is None:
                self.warmup()
            return self.engine.table

    def warmup_tokens(self, progress: bool = False) -> BucketTable:
        """Compile and time token outputs at each seqlen's smallest batch of the warm table (/embed_all), or at
        every bucket of it (a multi-vector or BGE-M3 model: its per-token outputs are served as its pooled ones)."""
        table = self.warm_table()
        smallest = tuple(table.at(s)[0] for s in table.seqlens)
        chosen = table.buckets if self.colbert is not None or self.m3 is not None else smallest
        return warm.given(self.engine, dataclasses.replace(table, buckets=chosen), progress=progress, output="tokens",
                          check=self._fits_check())

    def warm_token_table(self) -> BucketTable:
        """The token outputs' table (/embed_all, multi-vector): the warm one, or warmed now (first use), once."""
        with self._warming:
            if "tokens" not in self.engine.tables:
                self.warmup_tokens()
            return self.engine.tables["tokens"]

    def prepare(self, texts: list[str], long: str = "truncate", prompt: str | None = None) -> tuple[Pieces, Rows]:
        """Tokenize (with `prompt` in front of each text) and pack (no device work): the sequences and their rows."""
        pieces = self.tokenizer.documents(list(texts), long, prompt=prompt)
        return pieces, pack(pieces.lengths, self.warm_table())

    def run(self, pieces: Pieces, rows: Rows | None = None) -> np.ndarray | sparse.SparseRows:
        """Run sequences through the device -> [P, out_dim] (pooled, not normalised), in input order; a SPLADE
        model's as `sparse.SparseRows`, the non-zeros of sequences over the cap kept from their full rows in the
        same pass (`Job.kept`).

        The batches are formed by the same batcher as the server's, drained at
        once; `last_dispatches` keeps the batches that ran (what `explain` reports).
        """
        table = self.warm_table()
        rows = rows if rows is not None else pack(pieces.lengths, table)
        job = Job(rows, pieces.ids, pieces.offsets, pieces.types, self.out_dim)
        self.last_dispatches = run_jobs(self.engine, table, [job], streams=device.streams())
        return job.out if self.splade is None else sparse.SparseRows(job.out, job.kept)

    def run_tokens(self, pieces: Pieces) -> list[np.ndarray]:
        """Run sequences for their token outputs -> per sequence its [tokens, token_dim] float32 states, in order."""
        table = self.warm_token_table()
        job = Job(pack(pieces.lengths, table), pieces.ids, pieces.offsets, None, self.token_dim, output="tokens")
        self.last_dispatches = run_jobs(self.engine, table, [job])
        return [job.token_vectors(p) for p in range(pieces.count)]

    def embed(self, texts: str | Iterable[str], normalize: bool | None = None, long: str = "truncate",
              prompt_name: str | None = None, prompt: str | None = None) -> np.ndarray:
        """Texts -> [N, out_dim] float32 embeddings in input order, as sentence-transformers' `encode`.

        `normalize`: default as the checkpoint's modules say (Normalize listed or not).
        `long`: what to do with a text over the model's max length: `truncate`
        (as sentence-transformers), `chunk` (overlapping windows, token-weighted
        mean), or `error` (raise `InputError` naming its token count).
        `prompt_name` (one of the checkpoint's `prompts`) or `prompt` (a text) goes in
        front of every text; neither: the checkpoint's `default_prompt_name`, if any.
        A str is one text: its [out_dim] vector (`batch_of`).
        """
        texts, shaped = batch_of(texts)
        self._require("embedding")
        pieces, rows = self.prepare(texts, long, self.embedding_config.prompt(prompt_name, prompt))
        return shaped(self.embed_prepared(pieces, rows, len(texts), normalize))

    def embed_prepared(self, pieces: Pieces, rows: Rows, documents: int, normalize: bool | None = None) -> np.ndarray:
        """`embed` after `prepare`: run the sequences, combine each document's, normalise as the checkpoint says
        (or as `normalize` says) -> [documents, dim]."""
        out = pieces.combine(self.run(pieces, rows), documents)
        normalize = self.embedding_config.normalize if normalize is None else normalize
        return normalize_rows(out) if normalize else out

    def embed_all(self, texts: str | Iterable[str], prompt_name: str | None = None,
                  prompt: str | None = None) -> list[np.ndarray]:
        """Texts -> per text its [tokens, hidden] last hidden states, special tokens included (truncated to the
        model's length), as TEI's /embed_all; a str's alone."""
        texts, shaped = batch_of(texts)
        self._require("embedding")
        if self.m3 is not None:
            raise InputError("a BGE-M3 model's token outputs are its heads' (embed_m3), not its hidden states")
        pieces = self.tokenizer.documents(texts, "truncate", prompt=self.embedding_config.prompt(prompt_name, prompt))
        return shaped(self.run_tokens(pieces))

    def embed_sparse(self, texts: str | Iterable[str], long: str = "truncate", prompt_name: str | None = None,
                     prompt: str | None = None) -> list[list[dict]]:
        """Texts -> per text its non-zero weights [{"index", "value"}] in index order, as SparseEncoder's
        `encode` (a SPLADE checkpoint; `long`: truncate or error), or a BGE-M3 checkpoint's lexical weights; a
        str's alone."""
        texts, shaped = batch_of(texts)
        if self.m3 is not None:
            return shaped(bge_m3.index_values(self.m3_outputs(texts, ("sparse",), long, prompt_name, prompt)["sparse"]))
        self._require("sparse")
        if long == "chunk":
            raise InputError("sparse embeddings are per sequence: `long: chunk` does not apply")
        pieces, rows = self.prepare(texts, long, self.embedding_config.prompt(prompt_name, prompt))
        return shaped(sparse.decode(self.run(pieces, rows), self.splade))

    def embed_multivector(self, texts: str | Iterable[str], kind: str = "document", long: str = "truncate",
                          prompt: str | None = None) -> list[np.ndarray]:
        """Texts -> per text its [tokens, dim] float32 token vectors, as MultiVectorEncoder's `encode_query`
        (kind="query") / `encode_document` (kind="document") and PyLate's `encode(is_query=...)` give them; a
        BGE-M3 checkpoint's ColBERT vectors (the same for either kind, as FlagEmbedding's); a str's alone."""
        texts, shaped = batch_of(texts)
        if self.m3 is not None:
            if kind not in multivector.KINDS:
                raise InputError(f"kind must be one of {', '.join(multivector.KINDS)}, not {kind!r}")
            return shaped(self.m3_outputs(texts, ("multivector",), long, prompt=prompt)["multivector"])
        pieces = self.multivector_pieces(texts, kind, long, prompt)
        return shaped(multivector.outputs(self.colbert, kind, pieces.seqs, self.run_tokens(pieces)))

    def m3_outputs(self, texts: str | Iterable[str], outputs: tuple[str, ...] = bge_m3.OUTPUTS,
                   long: str = "truncate", prompt_name: str | None = None, prompt: str | None = None) -> dict:
        """A BGE-M3 checkpoint's `outputs` (any of dense, sparse, multivector) of texts, from one forward: dense
        [N, hidden] (not normalised), sparse per text (token ids, weights), multivector per text [tokens - 1, dim]
        (`bge_m3.outputs`). `long`: truncate or error. A str's: its row of each."""
        texts, shaped = batch_of(texts)
        if self.m3 is None:
            raise InputError(f"{self.path.name} is not a BGE-M3 model (no {bge_m3.COLBERT_FILE} and "
                             f"{bge_m3.SPARSE_FILE} beside it)")
        unknown = [o for o in outputs if o not in bge_m3.OUTPUTS]
        if unknown or not outputs:
            raise InputError(f"outputs must be some of {', '.join(bge_m3.OUTPUTS)}, not {list(outputs)}")
        if long == "chunk":
            raise InputError("BGE-M3's outputs are per sequence: `long: chunk` does not apply")
        pieces = self.tokenizer.documents(texts, long, prompt=self.embedding_config.prompt(prompt_name, prompt))
        return shaped(bge_m3.outputs(self.m3, pieces.ids, pieces.offsets, self.run_tokens(pieces), tuple(outputs)))

    def embed_m3(self, texts: str | Iterable[str], return_dense: bool = True, return_sparse: bool = True,
                 return_colbert_vecs: bool = True, long: str = "truncate", prompt_name: str | None = None,
                 prompt: str | None = None) -> dict:
        """Texts -> FlagEmbedding's `BGEM3FlagModel.encode` result, every output asked for from one forward:
        {"dense_vecs": [N, hidden] normalised, "lexical_weights": per text {str(token id): weight},
        "colbert_vecs": per text its [tokens - 1, dim] normalised vectors}, None for an output not asked for.
        Unlike FlagEmbedding's, every flag defaults to true; a str's outputs alone, as its."""
        texts, shaped = batch_of(texts)
        wanted = tuple(o for o, on in zip(bge_m3.OUTPUTS, (return_dense, return_sparse, return_colbert_vecs)) if on)
        if not wanted:
            raise InputError("ask for at least one of return_dense, return_sparse, return_colbert_vecs")
        got = self.m3_outputs(texts, wanted, long, prompt_name, prompt)
        return shaped({"dense_vecs": normalize_rows(got["dense"]) if "dense" in got else None,
                       "lexical_weights": bge_m3.lexical_weights(got["sparse"]) if "sparse" in got else None,
                       "colbert_vecs": got.get("multivector")})

    def classify(self, inputs: str | Iterable, truncate: bool = True) -> np.ndarray:
        """Texts, or (text, text) pairs, mixed -> [N, num_labels] logits (a classifier checkpoint). A str is one
        text: its [num_labels] row; a pair is one input inside a list (`[(a, b)]`: a bare tuple is a batch)."""
        inputs, shaped = batch_of(inputs, pairs=True)
        self._require("classifier")
        return shaped(self.run(self.prepare_pairs(inputs, truncate)))

    def rerank(self, query: str, texts: str | Iterable[str], truncate: bool = True,
               instruction: str | None = None) -> np.ndarray:
        """Cross-encoder relevance logits [N] of (query, text) pairs, in input order (an LLM reranker's: the
        true token's logit minus the false one's at the last position, as LogitScore). `instruction`: the task in
        a Qwen3-Reranker's prompt (default its model card's); a model without that slot refuses one. A str in
        `texts` is one text: its score alone, as CrossEncoder's `predict` of one pair."""
        texts, shaped = batch_of(texts)
        if not isinstance(query, str):
            raise InputError(f"the query is {type(query).__name__}, not a str")
        self._require("classifier")
        scores = self.run(self.prepare_pairs([(query, t) for t in texts], truncate, instruction=instruction))[:, 0]
        return shaped(scores)
