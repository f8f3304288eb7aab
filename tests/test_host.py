"""Host sizing without JAX: pool threads by usable cores, the queue bound in tokens, the host's cost per dispatch."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxserve.runtime import host
from jaxserve.runtime.buckets import (
    HOST_DISPATCH_S,
    Bucket,
    BucketTable,
    dispatch_s,
    fixed,
    throughput_knee,
)
from jaxserve.scheduling.batcher import MAX_QUEUE_TOKENS, MIN_QUEUE_TOKENS, queue_tokens
from jaxserve.scheduling.planner import cost_model


def test_pools_follow_the_usable_cores_and_keep_two_threads_on_a_small_host():
    assert host.pool_sizes(cores=2) == (2, 2)  # what a 2-core host always had
    assert host.pool_sizes(cores=1) == (2, 2)
    assert host.pool_sizes(cores=16) == (8, 4)  # the H200 host
    assert host.pool_sizes(cores=64) == (32, 16)
    assert host.pool_sizes(tokenizer=3, respond=1, cores=16) == (3, 1)  # --tokenizer-threads / --respond-threads


@given(st.integers(1, 512))
def test_pool_sizes_never_shrink_with_more_cores(cores):
    assert all(a <= b for a, b in zip(host.pool_sizes(cores=cores), host.pool_sizes(cores=cores + 1)))
    assert min(host.pool_sizes(cores=cores)) >= host.MIN_POOL_THREADS


def test_usable_cores_are_the_affinity_not_the_machine(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert host.usable_cores() == 3
    assert host.pool_sizes() == (2, 2)


def test_server_state_sizes_its_pools_by_the_rule_or_the_config(monkeypatch):
    from jaxserve.http.state import AppState, ServerConfig

    monkeypatch.setattr(host, "usable_cores", lambda: 16)
    state = AppState(ServerConfig(), None)
    assert state.pool_threads == (8, 4) and state.tokenizer_pool._max_workers == 8
    assert state.respond_pool._max_workers == 4
    state = AppState(ServerConfig(tokenizer_threads=5), None)
    assert state.pool_threads == (5, 4)


def timed(table: BucketTable, rate: float, host_s: float | None = None) -> BucketTable:
    """Every bucket at `rate` tokens/s of device time; the host's cost per dispatch injected."""
    return dataclasses.replace(table, host_dispatch_s=host_s,
                               buckets=tuple(dataclasses.replace(b, run_s=b.tokens / rate) for b in table.buckets))


TABLE = fixed([(1, 16), (4, 16), (16, 16), (1, 64), (4, 64)], layout="packed")


def test_queue_bound_is_seconds_of_device_work_clamped():
    assert queue_tokens(TABLE) == MIN_QUEUE_TOKENS  # untimed: the floor
    assert queue_tokens(timed(TABLE, rate=1e6, host_s=0.0), device_s=2.0) == 2_000_000
    assert queue_tokens(timed(TABLE, rate=1e9, host_s=0.0)) == MAX_QUEUE_TOKENS
    assert queue_tokens(timed(TABLE, rate=1e3, host_s=0.0)) == MIN_QUEUE_TOKENS


def test_queue_bound_counts_the_hosts_cost_per_dispatch():
    """With a host cost above every bucket's run time, the best rate is the largest bucket per host dispatch."""
    fast = timed(TABLE, rate=1e9, host_s=1e-3)
    assert queue_tokens(fast, device_s=2.0) == 2 * int(256 / 1e-3)


def test_the_tables_measured_host_cost_replaces_the_constant():
    b = Bucket(4, 16, run_s=1e-5)
    assert dispatch_s(b) == HOST_DISPATCH_S
    assert dispatch_s(b, 2e-3) == 2e-3
    fast = timed(TABLE, rate=1e9)  # every bucket runs in under a microsecond: the host sets the pace
    cheap, dear = dataclasses.replace(fast, host_dispatch_s=1e-10), dataclasses.replace(fast, host_dispatch_s=1e-3)
    # a dear host makes every larger batch pay (its cost per token falls with the batch); a near-free one does not
    assert [b.batch for b in throughput_knee(dear).at(16)] == [1, 4, 16]
    assert [b.batch for b in throughput_knee(cheap).at(16)] == [1]
    assert cost_model(dear)(dear.at(16)[0]) == 1e-3


def test_the_queue_bound_in_the_server_config_is_tokens():
    from jaxserve.http.state import ServerConfig

    assert ServerConfig().max_queue_tokens is None  # the table's: a few seconds of device work
    with pytest.raises(ValueError, match="positive"):
        ServerConfig(max_queue_tokens=0)


def test_serve_flags_for_the_queue_and_the_pools():
    from jaxserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-queue-tokens", "100000", "--tokenizer-threads", "6",
                                      "--respond-threads", "3"])
    assert (args.max_queue_tokens, args.tokenizer_threads, args.respond_threads) == (100_000, 6, 3)
    args = build_parser().parse_args(["serve"])
    assert (args.max_queue_tokens, args.tokenizer_threads, args.respond_threads) == (None, None, None)


def test_the_model_process_keeps_freed_batch_memory():
    """In a process of its own: with the settings, a batch-sized block freed and taken again comes back at the same
    address (kept by malloc); without them, the first is a mapping of its own, given back to the kernel on free,
    and the second lands elsewhere."""
    import os
    import subprocess
    import sys

    code = """
import sys
import numpy as np
from jaxserve.runtime import host
applied = host.keep_freed_memory() if sys.argv[1] == "on" else False
first = np.empty(host.MMAP_THRESHOLD // 4, np.uint8)
at = first.ctypes.data
del first
print(applied, np.empty(host.MMAP_THRESHOLD // 4, np.uint8).ctypes.data == at)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLIBC_TUNABLES", "MALLOC_"))}  # defaults
    run = lambda mode: subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, env=env,
                                      check=True).stdout.split()
    assert run("on") == ["True", "True"]
    assert run("off") == ["False", "False"]


def test_a_settled_heap_keeps_what_was_loaded_out_of_the_collectors_walks():
    """In a process of its own (it would freeze this one's heap): after `settle_heap`, what the process held is frozen
    (a collection walks none of it) and the youngest generation waits for `GC_YOUNG_THRESHOLD` new containers;
    garbage made before is collected first, not frozen, and garbage made after still goes."""
    import subprocess
    import sys

    code = """
import gc, weakref
from jaxserve.runtime import host
loaded = [{"model": i} for i in range(1000)]
class Node: pass
old = Node(); old.self = old
before = weakref.ref(old)
del old  # garbage when the heap settles: collected then, not frozen
host.settle_heap()
assert before() is None
a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made after: collected
gone = weakref.ref(a)
del a, b
gc.collect()
print(gc.get_freeze_count() >= 1000, gc.get_threshold()[0] == host.GC_YOUNG_THRESHOLD, gone() is None)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True", "True"]


def test_serving_processes_get_the_malloc_tunable_unless_the_user_set_their_own():
    assert host.malloc_tunables(None) == host.MALLOC_TUNABLES == "glibc.malloc.tcache_count=1024"
    assert host.malloc_tunables("glibc.malloc.arena_max=2") == "glibc.malloc.arena_max=2:" + host.MALLOC_TUNABLES
    assert host.malloc_tunables("glibc.malloc.tcache_count=7") == "glibc.malloc.tcache_count=7"  # theirs stands


def test_serving_processes_get_the_allocator_asked_for_or_the_first_installed():
    """`--malloc`: the children's environment (LD_PRELOAD after the user's own, the tunables always); auto takes
    the first of PRELOADS the loader finds, and leaves an allocator the user preloads alone."""
    installed = {"jemalloc": "libjemalloc.so.2"}
    find = installed.get
    tunables = {"GLIBC_TUNABLES": host.MALLOC_TUNABLES}
    assert host.malloc_env("auto", {}, find) == ("jemalloc", {**tunables, "LD_PRELOAD": "libjemalloc.so.2"})
    installed["mimalloc"] = "libmimalloc.so.2"  # first in PRELOADS: auto prefers it
    assert host.malloc_env("auto", {}, find) == ("mimalloc", {**tunables, "LD_PRELOAD": "libmimalloc.so.2"})
    assert host.malloc_env("jemalloc", {"LD_PRELOAD": "libprofiler.so"}, find) == (  # after the user's own
        "jemalloc", {**tunables, "LD_PRELOAD": "libprofiler.so:libjemalloc.so.2"})
    assert host.malloc_env("glibc", {}, find) == ("glibc", tunables)
    theirs = {"LD_PRELOAD": "/opt/lib/libtcmalloc_minimal.so.4", "GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"}
    assert host.malloc_env("auto", theirs, find) == ("tcmalloc", {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"})
    assert host.malloc_env("auto", {}, lambda name: None) == ("glibc", tunables)
    with pytest.raises(ValueError, match="apt-get install libjemalloc2"):
        host.malloc_env("jemalloc", {}, lambda name: None)
    with pytest.raises(ValueError, match="must be one of"):
        host.malloc_env("tcmalloc", {}, find)


def test_info_names_the_allocator_the_process_resolves_not_the_one_chosen(tmp_path):
    """A front-end's /info `processes`: the supervisor's pids, with the allocator this process's malloc resolves
    to (the children start alike), not the supervisor's choice, which a replacement in the user's own LD_PRELOAD
    overrides."""
    import json

    from jaxserve.http.state import AppState, ServerConfig

    state = AppState(ServerConfig(), None)
    state.processes_file = str(tmp_path / "processes.json")
    (tmp_path / "processes.json").write_text(json.dumps({"supervisor": 1, "engine": 2, "frontends": [3],
                                                          "malloc": "a choice the loader overrode"}))
    assert state.processes == {"supervisor": 1, "engine": 2, "frontends": [3], "malloc": host.allocator_in_use()}


def test_off_linux_no_allocator_is_preloaded(monkeypatch):
    monkeypatch.setattr(host.sys, "platform", "darwin")
    assert host.malloc_env("auto", {}, {"mimalloc": "libmimalloc.dylib"}.get)[0] == "system"
    with pytest.raises(ValueError, match="Linux only"):
        host.malloc_env("mimalloc", {}, {"mimalloc": "libmimalloc.dylib"}.get)


def test_a_process_started_with_an_allocator_preloaded_says_so():
    """allocator_in_use asks the dynamic loader which library serves malloc: glibc's without a preload; where
    mimalloc or jemalloc is installed, a process started with it preloaded (as the supervisor starts its children)
    names it, and a library of the user's own LD_PRELOAD that defines malloc (here libc itself) stands before it."""
    import os
    import subprocess
    import sys

    code = "from jaxserve.runtime import host; print(host.allocator_in_use())"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    run = lambda extra: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                       env={**env, **extra}).stdout.strip()
    assert run({}) == "glibc"
    name, preload = host.malloc_env("auto", env)
    assert run(preload) == name  # the first installed, or glibc's where none is
    if name != "glibc":
        theirs = host.malloc_env(name, {**env, "LD_PRELOAD": "libc.so.6"})[1]
        assert theirs["LD_PRELOAD"] == f"libc.so.6:{preload['LD_PRELOAD']}" and run(theirs) == "glibc"


def test_front_ends_tokenize_on_their_share_of_the_cores_and_on_one_without_hand_offs():
    """`--workers N`: each front-end's tokenizer gets cores // N threads; with one, no parallel batches at all
    (`TOKENIZERS_PARALLELISM=false`), unless the user set either variable."""
    assert host.tokenizer_env(16, 4, {}) == {"RAYON_NUM_THREADS": "4"}
    assert host.tokenizer_env(16, 14, {}) == {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    assert host.tokenizer_env(2, 2, {}) == {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    assert host.tokenizer_env(2, 2, {"TOKENIZERS_PARALLELISM": "true"}) == {
        "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "true"}
    assert host.tokenizer_env(2, 2, {"RAYON_NUM_THREADS": "2"}) == {"RAYON_NUM_THREADS": "2"}
    assert host.tokenizer_env(16, 16, {"RAYON_NUM_THREADS": "1"})["TOKENIZERS_PARALLELISM"] == "false"


def test_a_one_thread_tokenizer_hands_each_batch_to_its_pool_unless_parallelism_is_off(tmp_path):
    """Why `tokenizer_env` turns parallelism off at one thread: the tokenizer's batch call of two or more texts
    then waits on its pool's one thread, a few context switches per call (counted by the kernel); off, it runs
    on the calling thread with none."""
    import os
    import subprocess
    import sys

    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    code = f"""
import resource
from tokenizers import Tokenizer
tok = Tokenizer.from_file({str(tmp_path / "tokenizer.json")!r})
texts = ["a b a", "b a c"]
tok.encode_batch_fast(texts)
before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
for _ in range(200):
    tok.encode_batch_fast(texts)
print((resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before) / 200)
"""

    def switches(parallelism: str) -> float:
        env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": parallelism}
        return float(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    check=True).stdout)

    on, off = switches("true"), switches("false")
    assert on > 0.5
    assert off < 0.05
