"""Start-up: warm an engine from its artifact, or build it afresh and save one; every phase timed.

Phases (seconds, in the log, `/info` and `jaxserve_startup_seconds{phase}`):
- import: from process start to the loaded modules (the interpreter, jax, flax, aiohttp, ...);
- weights: reading the checkpoint and placing it on the device;
- deserialize: loading the warm artifact's executables (a warm start), or finding none;
- table: reading a table file, or deriving the bounds of each seqlen's climb;
- compile: XLA compiles (wall time; they run in parallel);
- timing: running compiled buckets to time them (the knee is decided here);
- save: writing the warm artifact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path

from jaxserve.runtime import artifact, compiles
from jaxserve.runtime.buckets import BucketTable
from jaxserve.runtime.derivation import TableOptions

log = logging.getLogger("jaxserve.runtime.startup")
PHASES = ("import", "weights", "deserialize", "table", "compile", "timing", "save")


@dataclasses.dataclass
class Startup:
    """What start-up did and is doing (read by /health and /info while the warmup thread writes it)."""

    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    doing: str = "starting"  # what /health says while warming
    source: dict = dataclasses.field(default_factory=dict)  # where the table came from

    @contextlib.contextmanager
    def phase(self, name: str, doing: str | None = None):
        self.doing = doing or name
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def shown(self) -> dict[str, float]:
        """The phases as /health and /info show them: seconds to the millisecond."""
        return {k: round(v, 3) for k, v in self.phases.items()}

    def summary(self) -> str:
        return ", ".join(f"{name} {self.phases[name]:.2f} s" for name in PHASES if name in self.phases)


def since_process_start() -> float:
    """Seconds since this process was created (the `import` phase, measured once the modules are in).

    On Linux from /proc, both clocks counted from boot (psutil's create_time adds the boot time, whole
    seconds only, and can be a second off)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())


def cache_root(directory: str | Path | None) -> Path:
    """jaxserve's cache directory (warm artifacts in `warm/`): `directory`, else $JAXSERVE_CACHE_DIR, else
    ~/.cache/jaxserve."""
    if directory:
        return Path(directory)
    return Path(os.environ.get("JAXSERVE_CACHE_DIR", Path.home() / ".cache" / "jaxserve"))


def outputs(encoder, embed_all: bool) -> tuple[str, ...]:
    """The outputs a start readies (and its artifact holds): pooled, and token outputs where the model serves them:
    always for a multi-vector model and BGE-M3 (/embed_m3's), for an embedding model's /embed_all with
    `embed_all`. The one rule for `serve`, `warmup` and `Encoder.start`, so each finds the others' artifact."""
    needed = encoder.head.kind == "multivector" or encoder.m3 is not None
    return ("pooled", "tokens") if needed or (embed_all and encoder.head.kind == "embedding") else ("pooled",)


def start(encoder, spec: BucketTable | TableOptions, tokens: bool = False, cache: str | Path | None = None,
          startup: Startup | None = None, progress: bool = False, keep: int = artifact.KEEP) -> BucketTable:
    """Ready the encoder's engine for `spec` (a table as it is, or the options to derive one), with the token
    outputs `outputs` gives (`tokens`: an embedding model's /embed_all too). With a `cache` directory
    (`cache_root`'s): from the matching artifact in its warm/ if there is one (or the one with token outputs too,
    as `serve` makes by default), else built afresh and saved, the model's artifacts then pruned to the newest
    `keep`. JAX's persistent compilation cache is not used: the artifact does its job whole, and its cache hits
    would not serialize (see `_save`)."""
    if keep < 1:
        raise ValueError(f"keep (warm artifacts kept per model) must be at least 1, not {keep}")
    startup = startup or Startup()
    wanted = outputs(encoder, tokens)
    startup.source = {"source": "derived" if isinstance(spec, TableOptions) else "file"}
    if cache is None:
        return _build(encoder, spec, wanted, startup, progress)
    root = Path(cache) / "warm"
    fields = artifact.key_fields(encoder, spec, wanted)
    fuller = outputs(encoder, True)
    table = _load(encoder, root, [fields] + ([{**fields, "outputs": list(fuller)}] if fuller != wanted else []),
                  startup)
    if table is not None:
        return table
    hits = compiles.cache_hits_total()
    table = _build(encoder, spec, wanted, startup, progress)
    _save(encoder, root, fields, startup, from_jax_cache=compiles.cache_hits_total() > hits, keep=keep)
    return table


def _load(encoder, root: Path, candidates: list[dict], startup: Startup) -> BucketTable | None:
    """The pooled table of the first artifact whose key is one of `candidates` (the outputs asked for, then more
    of them), its executables installed; None (why the first was not used, logged) if none is used."""
    with startup.phase("deserialize", "loading the warm artifact"):
        loaded, first = None, None
        for fields in candidates:
            try:
                loaded = artifact.load(root, encoder, fields,
                                       lambda done, total: setattr(startup, "doing",
                                                                   f"loading the warm artifact ({done}/{total})"))
                break
            except artifact.Skipped as why:
                first = first or why
        if loaded is None:
            log.log(logging.WARNING if isinstance(first, artifact.Refused) else logging.INFO,
                    "warm artifact not used: %s; building afresh", first)
            startup.source["artifact_skipped"] = str(first)
            return None
    startup.source = {"source": "artifact", "artifact": str(loaded.path), "created": loaded.created}
    log.info("warm artifact %s (made %s): %d buckets, no compiles", loaded.path.name, loaded.created,
             len(loaded.tables["pooled"].buckets))
    return loaded.tables["pooled"]


def _build(encoder, spec: BucketTable | TableOptions, outputs: tuple[str, ...], startup: Startup,
           progress: bool) -> BucketTable:
    """Compile and time every output's table, the phases split into compile, timing and the rest."""
    engine = encoder.engine
    spent = dict(engine.spent)
    with startup.phase("table", "compiling and timing buckets"):
        table = encoder.warmup(spec, progress=progress)
        if "tokens" in outputs:
            startup.doing = "compiling and timing token outputs"
            encoder.warmup_tokens(progress=progress)
    for name in ("compile", "timing"):
        startup.add(name, engine.spent[name] - spent[name])
    startup.phases["table"] -= sum(engine.spent[n] - spent[n] for n in ("compile", "timing"))
    return table


def _save(encoder, root: Path, fields: dict, startup: Startup, from_jax_cache: bool, keep: int) -> None:
    """Write the artifact of what `_build` made, then keep the model's newest `keep`; a failure is logged, never
    raised."""
    if from_jax_cache:
        # Seen with jax 0.10 on CPU: an executable loaded from JAX's persistent cache serializes without its
        # kernels, and the artifact would fail at its first run ("Function ... not found").
        log.warning("warm artifact not saved: some executables came from JAX's persistent compilation cache "
                    "(jax_compilation_cache_dir), and those do not serialize whole; unset it to make one")
        startup.source["artifact_not_saved"] = "executables from JAX's persistent compilation cache"
        return
    with startup.phase("save", "saving the warm artifact"):
        try:
            path = artifact.save(root, encoder, fields)
        except Exception as exc:  # a full disk or a read-only cache must not stop the server
            log.warning("warm artifact not saved: %s: %s", type(exc).__name__, exc)
        else:
            startup.source["artifact_saved"] = str(path)
            log.info("saved the warm artifact %s", path)
            removed = artifact.prune(root, encoder, keep, protect=path)
            if removed:
                startup.source["artifacts_pruned"] = [p.name for p in removed]
                log.info("pruned %d older warm artifacts of this model (keeping %d): %s", len(removed), keep,
                         ", ".join(p.name for p in removed))
