"""Counting XLA compilations.

`xla_compiles_total()` counts executables built since process start (served as
`jaxserve_xla_compiles_total`), persistent-cache hits included: a hit is still
a new executable and still costs time. After warmup it must not move.

Importing this module imports no JAX (a front-end process reads the count, 0); the engine installs the
listeners when it is imported, before anything compiles.
"""

from __future__ import annotations

import threading

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
    import jax

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

