"""What every benchmark script shares: a server, a corpus, paired rounds, the bench lock, result files, FLOPs.

- `server(...)`: `jaxserve serve` (or a given command, another tree) on loopback, ready; always stopped.
  `get` reads a route of it; `post_all` sends it texts in requests of 100, 2 in flight; `samples` reads a metric
  from its /metrics, `dispatched` the batches it ran by bucket.
- `documents`, `sample`: a real mixed-length corpus (Python's docstrings); `scripts/corpus.py` writes it out.
- `rounds`, `timed`, `ratios`, `paired_rounds`: configurations timed in interleaved rounds, order rotated.
- `bench_lock()`: one benchmark at a time on this machine (`fcntl.flock` on /tmp/jaxserve-bench.lock).
- `write_result`, `print_table`: a result JSON with the command, commit and machine; an aligned table.
- `ModelDims`: THIS tree's `jaxserve/dims.py`, loaded by path, whose `forward_flops` is the one FLOP counter
  (a process running another commit's jaxserve costs its buckets the same way).
- `closed_loop`: a closed-loop load from several client processes (raw HTTP/1.1 keep-alive connections), cheap
  enough not to be the limit; `HttpResponses` cuts responses off a socket's bytes.

Nothing here imports jax or jaxserve at import time (`closed_loop`'s client processes import this module).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK_PATH = Path("/tmp/jaxserve-bench.lock")


def _this_trees_dims():
    """`jaxserve/dims.py` of the tree this file is in (it imports nothing from jaxserve)."""
    spec = importlib.util.spec_from_file_location("jaxserve_dims_of_harness", ROOT / "jaxserve" / "dims.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.ModelDims


ModelDims = _this_trees_dims()


# ---- a server ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Server:
    """A started server."""

    url: str
    proc: subprocess.Popen
    ready_s: float  # from starting the process to /health 200


@contextlib.contextmanager
def server(*flags: str, command: Callable[[int], list[str]] | None = None, port: int | None = None,
           tree: Path | None = None, env: dict | None = None, log: Path | None = None, quiet: bool = True,
           timeout_s: float = 120.0, poll_s: float = 0.1):
    """`jaxserve serve --port PORT *flags` (or `command(port)`) on 127.0.0.1 (`launch.served`), waited for until
    /health says 200 (failing at once if it exits); yields a `Server`; on exit SIGTERM, then SIGKILL.

    `tree`: run another source tree (its directory as cwd and PYTHONPATH). Output: appended to `log` (with
    its exit status when it did not end on SIGTERM), else dropped (`quiet`) or inherited."""
    from jaxserve.integrations.launch import free_port, served  # stdlib and aiohttp: no jax in a driver process

    port = port or free_port()
    env = dict(env or os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    out = open(log, "ab") if log else None
    proc = None
    try:
        begin = time.perf_counter()
        with served(port, *flags, quiet=quiet, command=command(port) if command else None, cwd=tree, env=env,
                    stdout=out) as (url, proc):
            _wait(url, proc, timeout_s, poll_s, log)
            yield Server(url, proc, time.perf_counter() - begin)
    finally:
        if out is not None:
            if proc is not None and proc.returncode not in (0, -signal.SIGTERM):
                out.write(f"\nexit status {proc.returncode}\n".encode())
            out.close()


def _wait(url: str, proc: subprocess.Popen, timeout_s: float, poll_s: float, log: Path | None) -> None:
    import asyncio

    import aiohttp

    from jaxserve.integrations.launch import wait_ready

    async def ready():
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, url, timeout_s=timeout_s, poll_s=poll_s, proc=proc)

    try:
        asyncio.run(ready())
    except (RuntimeError, TimeoutError) as exc:
        raise type(exc)(f"{exc} (log: {log})" if log else str(exc)) from exc


async def post_all(session, url: str, texts: list[str], per_request: int = 100, in_flight: int = 2) -> float:
    """Seconds to embed `texts` through /v1/embeddings in requests of `per_request`, `in_flight` at a time."""
    import asyncio

    sem = asyncio.Semaphore(in_flight)

    async def one(chunk):
        async with sem, session.post(url + "/v1/embeddings", json={"input": chunk}) as r:
            assert r.status == 200, await r.text()
            await r.read()

    start = time.perf_counter()
    await asyncio.gather(*(one(texts[i : i + per_request]) for i in range(0, len(texts), per_request)))
    return time.perf_counter() - start


def get(url: str, path: str, timeout_s: float = 60.0) -> str:
    """GET url + path; the body as text."""
    with urllib.request.urlopen(url + path, timeout=timeout_s) as r:
        return r.read().decode()


def samples(metrics: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of one metric in a /metrics text: (its labels, its value), by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.labels, s.value) for family in text_string_to_metric_families(metrics) for s in family.samples
            if s.name == name]


def dispatched(url: str) -> dict[str, int]:
    """The batches a server has run so far, by bucket ("16x256"), whatever closed them."""
    out: dict[str, int] = {}
    for labels, value in samples(get(url, "/metrics"), "jaxserve_batches_total"):
        out[labels["bucket"]] = out.get(labels["bucket"], 0) + int(value)
    return out


def ready_info(url: str, timeout_s: float = 60.0, poll_s: float = 0.05) -> dict:
    """A ready server's /info with its bucket table. With `--workers N` /health answers 200 as soon as one
    front-end has the engine's card, and another may still be taking its own (unpickling the model view takes
    a while on a slow host): its /info has no table yet, so this asks again until one answers with it."""
    deadline = time.monotonic() + timeout_s
    while "buckets" not in (info := json.loads(get(url, "/info"))):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/info showed no bucket table within {timeout_s:g} s")
        time.sleep(poll_s)
    return info


# ---- a closed-loop load -----------------------------------------------------------------------

class HttpResponses:
    """HTTP/1.1 responses cut off a byte stream as it arrives (Content-Length or chunked bodies); each body is
    handed to `read(buffer, start, end)` in place, so a caller that wants one number of a large body copies
    nothing."""

    def __init__(self, read: Callable = lambda buf, start, end: bytes(buf[start:end])):
        self._buf = bytearray()
        self._head: tuple[int, int, int | None] | None = None  # status, body start, length (None: chunked)
        self._read = read

    def feed(self, data: bytes) -> list[tuple[int, object]]:
        """The responses `data` completes: (status, what `read` made of the body)."""
        self._buf += data
        out = []
        while True:
            if self._head is None:
                end = self._buf.find(b"\r\n\r\n")
                if end < 0:
                    return out
                head = bytes(self._buf[:end]).lower()
                length = re.search(rb"\r\ncontent-length: *(\d+)", head)
                self._head = (int(head[9:12]), end + 4, int(length.group(1)) if length else None)
            status, start, length = self._head
            if length is not None:
                if len(self._buf) < start + length:
                    return out
                out.append((status, self._read(self._buf, start, start + length)))
                del self._buf[: start + length]
            else:
                body = self._chunked(start)
                if body is None:
                    return out
                body, used = body
                out.append((status, self._read(body, 0, len(body))))
                del self._buf[:used]
            self._head = None

    def _chunked(self, at: int) -> tuple[bytes, int] | None:
        """A chunked body starting at `at`, when all of it is here: (the body, bytes used with the head)."""
        pieces = []
        while True:
            line = self._buf.find(b"\r\n", at)
            if line < 0:
                return None
            size = int(bytes(self._buf[at:line]).split(b";")[0], 16)
            if size == 0:
                end = self._buf.find(b"\r\n", line + 2)  # after any trailers, the empty line
                return None if end < 0 else (b"".join(pieces), end + 2)
            if len(self._buf) < line + 2 + size + 2:
                return None
            pieces.append(bytes(self._buf[line + 2 : line + 2 + size]))
            at = line + 2 + size + 2


_TOKENS = re.compile(rb' *(\d+)')


def prompt_tokens(buf, start: int, end: int) -> int:
    """An OpenAI-shaped body's `usage.prompt_tokens` (0 if it has none), read in place from its end."""
    at = buf.rfind(b'"prompt_tokens":', start, end)
    found = _TOKENS.match(buf, at + len(b'"prompt_tokens":')) if at >= 0 else None
    return int(found.group(1)) if found else 0


@dataclasses.dataclass
class Load:
    """What a closed-loop load did: answered requests (200), errors (any other status, or a lost connection),
    the prompt tokens of the answered ones, each one's latency, the wall time from the start to the last
    answer, and the client processes' own CPU time over it."""

    requests: int
    errors: int
    tokens: int
    latencies: list[float]
    wall_s: float
    client_cpu_s: float


def closed_loop(url: str, path: str, bodies: list[bytes], concurrency: int, seconds: float, processes: int = 2,
                max_requests: int = 20_000, on_start: Callable[[], None] = lambda: None,
                timeout_s: float = 300.0) -> Load:
    """POST `bodies` (JSON, in turn) to `url` + `path` from `concurrency` keep-alive HTTP/1.1 connections spread
    over `processes` client processes, each connection sending its next request when the last is answered, for
    `seconds` or until `max_requests` were sent (then the ones in flight are answered).

    Cheap enough not to be the limit: the requests are built once, each process runs an event loop (uvloop
    where installed) of raw protocol objects, and a response is read only for its status and its prompt tokens.
    Every connection first sends one request unmeasured; `on_start` runs once all are answered, just before
    the measured run (a caller reads its counters there). Stuck past `timeout_s`: the clients are stopped and
    TimeoutError raised."""
    import multiprocessing
    import queue
    from urllib.parse import urlparse

    where = urlparse(url)
    head = (f"POST {path} HTTP/1.1\r\nHost: {where.hostname}:{where.port}\r\nContent-Type: application/json\r\n"
            "Content-Length: {}\r\n\r\n")
    requests = [head.format(len(b)).encode() + b for b in bodies]
    shares = [n for n in (concurrency // processes + (i < concurrency % processes) for i in range(processes)) if n]
    ctx = multiprocessing.get_context("spawn")
    ready, results, go, start = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    procs = [ctx.Process(target=_load_client, daemon=True,
                         args=(where.hostname, where.port, requests, n, i * len(requests) // len(shares),
                               max_requests // len(shares), seconds, ready, results, go, start))
             for i, n in enumerate(shares)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            if (why := _get(ready, procs, timeout_s)) is not None:
                raise RuntimeError(f"a load client failed: {why}")
        on_start()
        start.value = time.perf_counter()  # CLOCK_MONOTONIC: the same clock in every process
        go.set()
        done = [_get(results, procs, seconds + timeout_s) for _ in procs]
    except queue.Empty:
        raise TimeoutError(f"the load on {url}{path} did not finish within {seconds + timeout_s:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=10 if go.is_set() else 0)  # clients never started wait for nothing: stopped at once
            if p.is_alive():
                p.kill()
                p.join()
    failed = [d for d in done if "error" in d]
    if failed:
        raise RuntimeError(f"a load client failed: {failed[0]['error']}")
    return Load(requests=sum(d["requests"] for d in done), errors=sum(d["errors"] for d in done),
                tokens=sum(d["tokens"] for d in done), latencies=[x for d in done for x in d["latencies"]],
                wall_s=max(d["end"] for d in done) - start.value, client_cpu_s=sum(d["cpu_s"] for d in done))


def _get(q, procs: list, timeout_s: float):
    """The next item of `q`; a client process that died without a word fails at once, not at the timeout."""
    import queue

    give_up = time.monotonic() + timeout_s
    while True:
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"a load client exited with {[p.exitcode for p in procs]}") from None
            if time.monotonic() > give_up:
                raise


def _load_client(host, port, requests, connections, first, bound, seconds, ready, results, go, start) -> None:
    """One client process of `closed_loop`: its connections, one unmeasured round, then the measured run."""
    import asyncio

    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    run = {"next": first, "sent": 0, "requests": 0, "errors": 0, "tokens": 0, "latencies": [], "busy": 0,
           "deadline": None, "idle": loop.create_future()}

    def measured() -> bool:
        return run["deadline"] is not None

    class Connection(asyncio.Protocol):
        def __init__(self):
            self.responses = HttpResponses(prompt_tokens)
            self.sent_at = 0.0
            self.busy = False

        def connection_made(self, transport):
            self.transport = transport

        def send(self):
            if self.transport.is_closing():
                run["errors"] += measured()
                return
            i = run["next"]
            run["next"] = (i + 1) % len(requests)
            run["sent"] += 1
            self.busy = True
            run["busy"] += 1
            self.sent_at = time.perf_counter()
            self.transport.write(requests[i])

        def answered(self):
            self.busy = False
            run["busy"] -= 1
            if measured() and time.perf_counter() < run["deadline"] and run["sent"] < bound:
                self.send()
            if run["busy"] == 0 and not run["idle"].done():
                run["idle"].set_result(None)

        def data_received(self, data):
            for status, tokens in self.responses.feed(data):
                if measured() and status == 200:
                    run["requests"] += 1
                    run["tokens"] += tokens
                    run["latencies"].append(time.perf_counter() - self.sent_at)
                else:
                    run["errors"] += measured()
                self.answered()

        def connection_lost(self, exc):
            if self.busy:
                run["errors"] += measured()
                self.answered()

    def round_trip() -> None:
        run["idle"] = loop.create_future()
        for c in conns:
            c.send()
        if run["busy"]:
            loop.run_until_complete(run["idle"])

    conns = []
    try:
        conns = [loop.run_until_complete(loop.create_connection(Connection, host, port))[1] for _ in range(connections)]
        round_trip()  # settle: one unmeasured request each
        ready.put(None)
        go.wait()
        run["deadline"], run["sent"] = start.value + seconds, 0
        cpu = time.process_time()
        round_trip()
        results.put({"requests": run["requests"], "errors": run["errors"], "tokens": run["tokens"],
                     "latencies": run["latencies"], "end": time.perf_counter(), "cpu_s": time.process_time() - cpu})
    except Exception as exc:
        ready.put(f"{type(exc).__name__}: {exc}")
        results.put({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        for c in conns:
            c.busy = False
            c.transport.close()
        loop.close()


# ---- the corpus --------------------------------------------------------------------------------

MODULES = [
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal", "email",
    "functools", "heapq", "http.client", "inspect", "itertools", "json", "logging", "os", "pathlib", "pickle",
    "random", "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "textwrap",
    "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile",
]


def docstrings() -> list[str]:
    """Docstrings of the standard library's MODULES and their classes and functions (deterministic for a
    given Python version)."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in MODULES:
            mod = importlib.import_module(name)
            for obj in [mod] + [v for _, v in sorted(vars(mod).items()) if inspect.isclass(v) or inspect.isfunction(v)]:
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 40 and doc not in out:
                    out.append(doc)
    return out


def pools() -> dict[str, list[str]]:
    """The corpus's three kinds of document: sentences, paragraphs, whole docstrings."""
    docs = docstrings()
    paragraphs = [p.strip() for d in docs for p in d.split("\n\n") if len(p.strip()) > 30]
    sentences = [s.strip() for p in paragraphs for s in re.split(r"(?<=[.!?])\s+", p) if len(s.strip()) > 15]
    return {"sentences": sentences, "paragraphs": paragraphs, "docstrings": docs}


def documents(n: int, seed: int = 0) -> list[str]:
    """`n` documents: about 40% sentences, 40% paragraphs, 20% whole docstrings (often over 256 tokens)."""
    rng = random.Random(seed)
    p = pools()
    out = []
    for _ in range(n):
        r = rng.random()
        pool = p["sentences"] if r < 0.4 else p["paragraphs"] if r < 0.8 else p["docstrings"]
        out.append(" ".join(rng.choice(pool).split()))
    return out


def sample(kind: str, n: int, min_chars: int = 0, seed: int = 0) -> list[str]:
    """`n` documents of one kind (with replacement), at least `min_chars` long."""
    rng = random.Random(seed)
    pool = [" ".join(d.split()) for d in pools()[kind] if len(d) >= min_chars]
    return [rng.choice(pool) for _ in range(n)]


# ---- paired rounds -----------------------------------------------------------------------------

def rounds(runs: dict[str, Callable], n: int) -> dict[str, list]:
    """`n` rounds, each calling every run once, the order rotated a step per round (two runs: alternating
    which goes first), so a shared machine's drift hits each alike. What each call returned, per run."""
    names = list(runs)
    out = {name: [] for name in names}
    for r in range(n):
        for name in names[r % len(names):] + names[: r % len(names)]:
            out[name].append(runs[name]())
    return out


def timed(fn: Callable) -> Callable[[], float]:
    """`fn` as a run that returns the wall seconds it took."""
    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return run


def ratios(reference: list[float], candidate: list[float]) -> dict:
    """Per-round ratios reference / candidate (of seconds: > 1, the candidate is faster) and their median
    and range: drift between rounds cancels within each."""
    each = [r / c for r, c in zip(reference, candidate)]
    return {"median": statistics.median(each), "min": min(each), "max": max(each), "ratios": each}


def paired_rounds(reference: Callable, candidate: Callable, n: int) -> dict:
    """Time `reference()` and `candidate()` in `n` alternating pairs; the per-pair ratios."""
    seconds = rounds({"ref": timed(reference), "cand": timed(candidate)}, n)
    return {"rounds": n, **ratios(seconds["ref"], seconds["cand"])}


# ---- the bench lock ----------------------------------------------------------------------------

@contextlib.contextmanager
def bench_lock(path: Path = LOCK_PATH):
    """Hold the machine's bench lock for the timed part: benchmarks wait for each other (2 cores).
    Held already by a process this one runs under (`flock /tmp/jaxserve-bench.lock python ...`, or
    bench_gpu.py running bench_latency.py), it goes on under that hold."""
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)  # as flock(1) opens it: any user may lock it
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not _held_by_ancestor(path):
                print(f"waiting for {path} (another benchmark is running)", file=sys.stderr, flush=True)
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _held_by_ancestor(path: Path) -> bool:
    """Whether a flock on `path` belongs to this process's parent, grandparent, ... (from /proc/locks)."""
    st = path.stat()
    file_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        holders = {int(f[4]) for f in (line.split() for line in Path("/proc/locks").read_text().splitlines())
                   if len(f) > 5 and f[1] == "FLOCK" and f[5] == file_id}
    except OSError:
        return False
    pid = os.getppid()
    while pid > 1:
        if pid in holders:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


# ---- result files ------------------------------------------------------------------------------

def commit(tree: Path = ROOT) -> str | None:
    """The tree's short commit, `+dirty` with uncommitted changes to tracked files; None outside git."""
    git = lambda *a: subprocess.run(["git", "-C", str(tree), *a], capture_output=True, text=True, check=False)
    head = git("rev-parse", "--short", "HEAD")
    if head.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if git("diff", "--quiet", "HEAD").returncode else "")


def machine() -> dict:
    """CPU model, cores, Python and the installed jax (read from its metadata: nothing is imported)."""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    versions = {}
    for dist in ("jax", "jaxlib"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), **versions}


def write_result(path, result: dict, quiet: bool = False) -> None:
    """`result` as JSON at `path` (directories made), after the command line (unless `result` says its own),
    the commit and the machine."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {"command": " ".join(sys.argv), "commit": commit(), "machine": machine()}
    plain = lambda v: v.item() if hasattr(v, "item") else str(v)  # numpy scalars as numbers, the rest as text
    path.write_text(json.dumps({**head, **result}, indent=1, default=plain, ensure_ascii=True) + "\n")
    if not quiet:
        print(f"wrote {path}")


def print_table(header: list[str], rows: list[list]) -> None:
    """Columns as wide as their widest cell; the first left-aligned, the rest right-aligned."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells if i < len(row)) for i in range(len(header))]
    for row in cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
