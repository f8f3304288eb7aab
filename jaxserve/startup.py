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

from jaxserve import artifact, compiles
from jaxserve.buckets import BucketTable
from jaxserve.derivation import TableOptions

log = logging.getLogger("jaxserve.startup")
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
    """jaxserve's cache directory: warm artifacts in `warm/`."""
    return Path(directory) if directory else compiles.default_cache_dir()


def warm(encoder, spec: BucketTable | TableOptions, tokens: bool = False, cache: str | Path | None = None,
         startup: Startup | None = None, progress: bool = False) -> BucketTable:
    """Warm the encoder's engine for `spec` (a table as it is, or the options to derive one), with token
    outputs too if `tokens` (an embedding model's /embed_all). With a `cache` directory: from the matching
    artifact if there is one, else built afresh and saved. JAX's persistent compilation cache is not used:
    the artifact does its job whole, and its cache hits would not serialize (see the save below)."""
    startup = startup or Startup()
    outputs = ("pooled", "tokens") if tokens and encoder.head.kind in ("embedding", "multivector") else ("pooled",)
    fields = None
    if cache is not None:
        root = cache_root(cache)
        fields = artifact.key_fields(encoder, spec, outputs)
        with startup.phase("deserialize", "loading the warm artifact"):
            try:
                loaded = artifact.load(root / "warm", encoder, fields,
                                       lambda done, total: setattr(startup, "doing",
                                                                   f"loading the warm artifact ({done}/{total})"))
            except artifact.Skipped as why:
                log.info("warm artifact not used: %s; building afresh", why)
                startup.source = {"source": "derived" if isinstance(spec, TableOptions) else "file",
                                  "artifact_skipped": str(why)}
            else:
                startup.source = {"source": "artifact", "artifact": str(loaded.path), "created": loaded.created}
                log.info("warm artifact %s (made %s): %d buckets, no compiles", loaded.path.name, loaded.created,
                         len(loaded.tables["pooled"].buckets))
                return loaded.tables["pooled"]
    else:
        startup.source = {"source": "derived" if isinstance(spec, TableOptions) else "file"}
    engine = encoder.engine
    spent = dict(engine.spent)
    hits = compiles.cache_hits_total()
    with startup.phase("table", "compiling and timing buckets"):
        table = encoder.warmup(spec, progress=progress)
        if "tokens" in outputs:
            startup.doing = "compiling and timing token outputs"
            encoder.warmup_tokens(progress=progress)
    for name in ("compile", "timing"):
        startup.add(name, engine.spent[name] - spent[name])
    startup.phases["table"] -= sum(engine.spent[n] - spent[n] for n in ("compile", "timing"))
    if fields is not None and compiles.cache_hits_total() > hits:
        # Seen with jax 0.10 on CPU: an executable loaded from JAX's persistent cache serializes without its
        # kernels, and the artifact would fail at its first run ("Function ... not found").
        log.warning("warm artifact not saved: some executables came from JAX's persistent compilation cache "
                    "(jax_compilation_cache_dir), and those do not serialize whole; unset it to make one")
        startup.source["artifact_not_saved"] = "executables from JAX's persistent compilation cache"
    elif fields is not None:
        with startup.phase("save", "saving the warm artifact"):
            try:
                path = artifact.save(root / "warm", encoder, fields)
            except Exception as exc:  # a full disk or a read-only cache must not stop the server
                log.warning("warm artifact not saved: %s: %s", type(exc).__name__, exc)
            else:
                startup.source["artifact_saved"] = str(path)
                log.info("saved the warm artifact %s", path)
    return table
