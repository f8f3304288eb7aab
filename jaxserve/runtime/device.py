"""What the device offers: its memory limit and the batch rounding that suits it.

The caps and the budget rule are read by processes that never import JAX (a front-end of `--workers N`, the
simulated device's table): JAX is imported by the first question put to the device (`_devices`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

import psutil

log = logging.getLogger("jaxserve")
# Share of free host RAM a CPU "device" may use: the rest stays for the
# tokenizer, the HTTP server and the OS.
CPU_MEMORY_SHARE = 0.5
# Fraction of the device limit the buckets may fill (XLA's analysis misses
# allocator fragmentation and the runtime's own buffers).
DEFAULT_HEADROOM = 0.9
UNCAPPED = 2**40  # a cap that never binds
# Tokens per dispatch on an accelerator: the climb to the throughput knee never proposes more. A bucket
# this size keeps an H200 busy for tens of ms with MiniLM and seconds with an 8B model, long past the
# knee; without a cap, memory alone proposed multi-million-token buckets that took seconds to compile.
ACCELERATOR_MAX_BATCH_TOKENS = 2**18


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    platform: str  # cpu, gpu, tpu
    kind: str  # e.g. "NVIDIA H200", "cpu"
    count: int
    memory_bytes: int  # per device
    batch_multiple: int  # batch sizes are rounded down to this
    max_batch_tokens: int  # default token budget per dispatch
    max_batch: int  # default cap on rows per dispatch


def describe(memory_override: int | None = None) -> DeviceInfo:
    """This device, its memory the live pool's (`pool_bytes`) or `memory_override` (a warning if that is larger:
    a table derived for it may not fit here)."""
    dev = _devices()[0]
    platform = dev.platform
    live = _memory_limit(dev)
    if memory_override and memory_override > live:
        log.warning("device memory of %d bytes given, above this device's pool of %d bytes (%s): a table derived "
                    "for it is refused here at warmup if a bucket is over this pool (`jaxserve buckets` runs none)",
                    memory_override, live, POOL_RULE.get(platform, POOL_RULE["gpu"]))
    memory = memory_override or live
    if platform == "cpu":
        # On CPU, big dispatches gain nothing over medium ones once both cores are
        # busy, and cost latency: cap the tokens per dispatch.
        return DeviceInfo(platform, "cpu", len(_devices()), memory, batch_multiple=1, max_batch_tokens=4096,
                          max_batch=256)
    # An accelerator: memory and the token cap bound each seqlen's batch, and the measured
    # throughput knee (jaxserve.runtime.derivation) picks where the ladder stops.
    return DeviceInfo(platform, dev.device_kind, len(_devices()), memory, batch_multiple=8,
                      max_batch_tokens=ACCELERATOR_MAX_BATCH_TOKENS, max_batch=UNCAPPED)



def _devices() -> list:
    import jax

    return jax.devices()


def budget_bytes(memory_bytes: int, headroom: float | None = None) -> int:
    """What the buckets may fill of a device's memory: `headroom` (default DEFAULT_HEADROOM) of it. The one rule
    that deriving a table and checking a given table against the live pool both apply."""
    return int((DEFAULT_HEADROOM if headroom is None else headroom) * memory_bytes)


@functools.cache
def streams() -> int:
    """Batches worth running at once, each from a thread of its own (the service's device threads).

    On a CPU two: batches launched from one thread run one after another there, and
    XLA's single-threaded fusions leave a core idle that a second batch fills. On an
    accelerator one thread launches for the device, which runs batches in order."""
    return 2 if _devices()[0].platform == "cpu" else 1


def info_of(table) -> dict:
    """The device a server runs on, for /info: its platform, the device and memory its table is budgeted for (this
    one's pool, unless derived for `--device-memory`), how many."""
    return {"platform": _devices()[0].platform, "kind": table.device, "count": len(_devices()),
            "memory_bytes": table.device_memory}


POOL_RULE = {
    "cpu": f"{CPU_MEMORY_SHARE:.0%} of the host's available RAM",
    "gpu": "XLA's allocator limit: XLA_CLIENT_MEM_FRACTION of the card (or its older name "
           "XLA_PYTHON_CLIENT_MEM_FRACTION, not both), 75% unless set",
}


def pool_bytes() -> int:
    """The memory the first device's buffers may take now: on an accelerator XLA's pool (`bytes_limit`), on a
    CPU a share of the host's available RAM (`POOL_RULE`)."""
    return _memory_limit(_devices()[0])


def _memory_limit(dev) -> int:
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return int(CPU_MEMORY_SHARE * _host_available())


def _host_available() -> int:
    available = psutil.virtual_memory().available
    cgroup = Path("/sys/fs/cgroup/memory.max")
    try:
        raw = cgroup.read_text().strip()
        if raw != "max":
            available = min(available, int(raw))
    except (OSError, ValueError):
        pass
    return available
