"""Counting XLA compilations, and the persistent compilation cache.

`xla_compiles_total()` counts executables built since process start (served as
`jaxserve_xla_compiles_total`), persistent-cache hits included: a hit is still
a new executable and still costs time. After warmup it must not move.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import jax

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_count = 0
_cache_hits = 0
_installed = False


def _on_duration(event: str, duration: float, **_) -> None:
    global _count
    if event == _COMPILE_EVENT:
        with _lock:
            _count += 1


def _on_event(event: str, **_) -> None:
    global _cache_hits
    if event == _CACHE_HIT_EVENT:
        with _lock:
            _cache_hits += 1


def install() -> None:
    """Start counting (idempotent); called on import of the engine."""
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
            _installed = True


def xla_compiles_total() -> int:
    return _count


def cache_hits_total() -> int:
    """Of those, how many came from the persistent cache."""
    return _cache_hits


def default_cache_dir() -> Path:
    """jaxserve's cache root (warm artifacts in warm/, JAX's persistent compilation cache in xla/)."""
    return Path(os.environ.get("JAXSERVE_CACHE_DIR", Path.home() / ".cache" / "jaxserve"))


def enable_persistent_cache(directory: Path | str | None = None) -> Path:
    """Store every compiled executable on disk, however quick its compile (CPU compiles are < 1 s)."""
    path = Path(directory) if directory else default_cache_dir() / "xla"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


install()
