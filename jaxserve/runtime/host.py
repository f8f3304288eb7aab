"""The host's share of the work, sized by the cores this process may run on (not by a constant for 2 cores).

Rule (see docs/operations.md, "Host threads"): the device pipeline keeps
about three threads busy (prepare, device, respond) besides the event loop,
so the rest of the cores go to the two pools that grow with requests:
tokenizing (decode, tokenize, pack: the heavier) gets half the usable cores,
responding (combine, normalise, encode) a quarter, each at least 2, so a
2-core host keeps the two threads each that it always had.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import sys

MIN_POOL_THREADS = 2  # each pool: one thread busy while another waits on the GIL
# glibc's per-thread cache of freed small blocks (up to 1032 bytes), per size: 7 by default. The tokenizer (Rust)
# frees and takes back dozens of one size per text; past 7 each goes to malloc's slower bins. 1024 of each size
# hold at most ~34 MB per thread, in practice what one request's tokens took.
MALLOC_TUNABLES = "glibc.malloc.tcache_count=1024"
# Allocators a serving child may start with instead of glibc's malloc (LD_PRELOAD), in the order `--malloc auto`
# prefers them: the request path takes and frees many small and mid-sized blocks (the tokenizer's, numpy's,
# aiohttp's, the response bodies), which each does with less CPU than glibc's bins (docs/benchmarks.md)
PRELOADS = {"mimalloc": "libmimalloc.so.2", "jemalloc": "libjemalloc.so.2"}
MALLOC_CHOICES = ("auto", "glibc", *PRELOADS)
_ALLOCATOR_NAMES = ("mimalloc", "jemalloc", "tcmalloc")  # in a user's own LD_PRELOAD: theirs stands
# the cyclic collector's first generation runs after this many new containers (Python's default: 700, a collection
# every two or three one-document requests, each walking what the requests in flight hold)
GC_YOUNG_THRESHOLD = 20_000
# glibc's malloc: blocks below this come from its heap, and up to this much free heap is kept (not the defaults'
# returning every block of a batch's size to the kernel, to fault it in again, zeroed, for the next batch)
MMAP_THRESHOLD = 32 << 20  # the most glibc's own dynamic threshold would reach, fixed from the start
TRIM_THRESHOLD = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity: a container's cpuset, `taskset`), not the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity API (macOS)
        return os.cpu_count() or 1


def tokenizer_threads(cores: int) -> int:
    return max(MIN_POOL_THREADS, cores // 2)


def respond_threads(cores: int) -> int:
    return max(MIN_POOL_THREADS, cores // 4)


def pool_sizes(tokenizer: int | None = None, respond: int | None = None, cores: int | None = None) -> tuple[int, int]:
    """(tokenizer threads, respond threads): the ones given, else the rule's for `cores` (default: usable cores)."""
    cores = usable_cores() if cores is None else cores
    sizes = (tokenizer or tokenizer_threads(cores), respond or respond_threads(cores))
    if min(sizes) < 1:
        raise ValueError(f"pool threads must be at least 1, not {sizes}")
    return sizes


def frontend_workers(cores: int | None = None) -> int:
    """`jaxserve serve --workers auto`: front-end processes for `cores` (default: usable cores). Below 4 cores
    one process does everything (the engine's threads and a second interpreter would share too few cores);
    from 4, all cores but two (the engine's pipeline threads, and the kernel's network work), at most 32."""
    cores = usable_cores() if cores is None else cores
    return 1 if cores < 4 else min(cores - 2, 32)


def tokenizer_env(cores: int, workers: int, environ) -> dict[str, str]:
    """The tokenizer's own threads in a front-end of `--workers`: its share of the cores (`RAYON_NUM_THREADS`,
    not every core in every front-end); with one, no parallel batches at all (`TOKENIZERS_PARALLELISM=false`):
    a one-thread pool gives a batch no second core, only hand-offs between the calling thread and the pool's
    (docs/benchmarks.md). A variable the user set stands."""
    threads = environ.get("RAYON_NUM_THREADS") or str(max(1, cores // workers))
    env = {"RAYON_NUM_THREADS": threads}
    if threads == "1":
        env["TOKENIZERS_PARALLELISM"] = environ.get("TOKENIZERS_PARALLELISM", "false")
    return env


OPEN_FILES = 65535  # the soft limit `serve` asks for (vLLM's `set_ulimit` asks the same): a connection is a file


def raise_open_files(target: int = OPEN_FILES) -> str:
    """The soft limit of open files raised towards `target` (never past the hard limit, never lowered), for the
    server and the processes it starts: each connection holds one, and at a distribution's default of 1024 a
    few hundred idle keep-alive clients beside the model's files leave `accept` failing with EMFILE, which the
    event loop only logs. -> the limit as it now stands, for the start-up log ("unlimited", or why it stayed)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return "the platform's own"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:  # e.g. macOS, past kern.maxfilesperproc
            return f"{soft} (not raised to {want}: {exc})"
        soft = want
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep the blocks of a batch's size once freed (`MMAP_THRESHOLD`, `TRIM_THRESHOLD`), for
    the process that runs the model: its batches' inputs, outputs and joins, a few MB each, come and go every
    batch, and by default each is a fresh mapping whose pages the kernel faults in and zeroes (with the engine
    saturated, about 8% of its respond thread). True where applied (glibc on Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


def malloc_tunables(given: str | None) -> str:
    """$GLIBC_TUNABLES for a serving process started from this one (read by the dynamic loader at its start, so it
    cannot be set from inside): `given` (the user's) with `MALLOC_TUNABLES` added where it sets no tcache count
    of its own. Other C libraries ignore it."""
    given = given or ""
    if "glibc.malloc.tcache_count=" in given:
        return given
    return f"{given}:{MALLOC_TUNABLES}" if given else MALLOC_TUNABLES


def malloc_env(choice: str, environ, find=ctypes.util.find_library) -> tuple[str, dict[str, str]]:
    """(the allocator, the variables a serving child starts with) for `--malloc choice`: a named allocator
    preloaded after the user's own LD_PRELOAD (the first library that defines malloc serves it: a replacement of
    the user's own stands, a wrapper of theirs calls through to ours; ValueError where the loader cannot find it:
    `find`); `auto`, the first of PRELOADS installed, or none where the user's LD_PRELOAD names a known allocator;
    `glibc`, nothing added. Every child gets `malloc_tunables` (only glibc's malloc reads them). Off Linux nothing
    is preloaded: the system's allocator (`auto`), or ValueError for a named one (`not_on_linux`)."""
    env = {"GLIBC_TUNABLES": malloc_tunables(environ.get("GLIBC_TUNABLES"))}
    if not sys.platform.startswith("linux"):
        if choice in ("auto", "glibc"):
            return "system", env
        raise ValueError(not_on_linux(choice))
    given = environ.get("LD_PRELOAD", "")
    theirs = _allocator_named(given)
    if choice == "glibc" or (choice == "auto" and theirs):
        return theirs or "glibc", env
    if choice != "auto" and choice not in PRELOADS:
        raise ValueError(f"--malloc must be one of {', '.join(MALLOC_CHOICES)}, not {choice!r}")
    for name in PRELOADS if choice == "auto" else (choice,):
        if (lib := find(name)) is not None:
            env["LD_PRELOAD"] = f"{given}:{lib}" if given else lib
            return name, env
    if choice != "auto":
        package = {"mimalloc": "libmimalloc2.0", "jemalloc": "libjemalloc2"}[choice]
        raise ValueError(f"--malloc {choice}: the dynamic loader finds no lib{choice} (Debian and Ubuntu: "
                         f"apt-get install {package})")
    return "glibc", env


def _allocator_named(text: str) -> str | None:
    """The known allocator a library path or LD_PRELOAD names, if any."""
    return next((name for name in _ALLOCATOR_NAMES if name in text), None)


def not_on_linux(choice: str) -> str:
    return f"--malloc {choice}: preloading an allocator is done on Linux only"


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p), ("dli_sname", ctypes.c_char_p),
                ("dli_saddr", ctypes.c_void_p)]


@functools.cache
def allocator_in_use() -> str:
    """The allocator this process runs on: the library whose `malloc` the dynamic loader resolves (`dladdr`), by
    name (mimalloc, jemalloc, tcmalloc; glibc for libc; else the library's file name); off Linux, the system's.
    Read once: a preload is loaded when the process starts, so it cannot change afterwards."""
    if not sys.platform.startswith("linux"):
        return "system"
    try:
        process = ctypes.CDLL(None)
        info = _DlInfo()
        if not process.dladdr(ctypes.cast(process.malloc, ctypes.c_void_p), ctypes.byref(info)):
            return "glibc"
        library = os.path.basename(info.dli_fname.decode())
    except (OSError, AttributeError, UnicodeDecodeError):
        return "glibc"
    if library.startswith(("libc.", "libc-")):
        return "glibc"
    return _allocator_named(library) or library


def settle_heap() -> None:
    """Once a serving process is ready (its modules, model view and tables loaded): what it built so far moves out
    of the cyclic garbage collector's sight (`gc.freeze`: it is never garbage, and each older-generation collection
    walked all of it), and the youngest generation is collected after `GC_YOUNG_THRESHOLD` new containers, not 700.
    Requests and batches make short-lived containers by the hundred, and the collections they set off showed in a
    front-end's work per one-document request (docs/benchmarks.md)."""
    gc.collect()  # garbage first (a card replaced by a restarted engine's): a frozen cycle would never go
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
