"""Serving from several processes (`jaxserve serve --workers N`): N front-ends and one engine, under a supervisor.

One Python process cannot feed a fast accelerator: the request path (HTTP,
JSON, validation, tokenizing, packing, response encoding) holds the GIL, and a
one-document query costs milliseconds of it against a fraction of a
millisecond of device time. So the work is split as vLLM's API servers do:

    supervisor (this module's `serve_workers`): binds the port, starts the others, restarts them, stops them
      |-- front-end x N: the aiohttp app (every route, auth, limits, tokenizing, encoding) on its own
      |                  listening socket of the port (`listeners`); its jobs go to the engine over a Unix
      |                  socket (scheduling/link.py)
      `-- engine x 1:    loads and warms the model (the warm artifact, once), runs the one Pipeline: the
                         batchers across every front-end's rows, the device threads, gathering the outputs

Faults: a front-end that dies is restarted (only its own in-flight requests
fail: their connections close); an engine that dies fails every waiting
request with 503, /health says 503 on every front-end until a restarted engine
is warm again (`engine_restarts` times, then it stays 503 for the orchestrator
to act). A model that the first engine cannot load (a wrong path, a task or
prompt the checkpoint lacks) ends the server at once, as `--workers 1` does:
one line, exit status 2. Every child asks the kernel for SIGTERM when the supervisor dies
(PR_SET_PDEATHSIG) and checks its parent once more after asking: SIGKILL of
the supervisor leaves no process behind, and the last child to go removes the
run directory the supervisor would have (`_leave`). SIGTERM drains the
front-ends first, then stops the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import errno
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from jaxserve.errors import JaxserveError

log = logging.getLogger("jaxserve.http.workers")

RESTART_BACKOFF_S = (0.5, 5.0)  # a child that died young waits this long (doubling up to the second) to restart
YOUNG_S = 10.0  # a child that lived less than this died young
PROCESSES_FILE = "processes.json"  # the supervisor's list of pids by role, read by /info
LOAD_FAILED_FILE = "load-failed.txt"  # why the first engine could not load the model: the supervisor says it and exits
LEAVE_WAIT_S = 40.0  # the longest the last child waits for the others to end (a drain, and the engine's after it)
STOPPING_FILE = "stopping"  # the supervisor stopping its children: it removes the run directory after them
SUPERVISOR_GONE_S = 1.0  # how long a child ending waits to see whether its supervisor is going too (`_leave`)


def frontend_config(config, workers: int):
    """A front-end's share of the server's limits (requests and body bytes being handled), so that N of them
    together hold what one process would; its tokenizer and respond threads, a share of the cores."""
    from jaxserve.runtime import host

    cores = max(2, host.usable_cores() // workers)
    tokenizer, respond = host.pool_sizes(config.tokenizer_threads, config.respond_threads, cores=cores)
    return dataclasses.replace(config, max_concurrent=max(1, math.ceil(config.max_concurrent / workers)),
                               max_inflight_bytes=max(config.max_body_bytes,
                                                      math.ceil(config.max_inflight_bytes / workers)),
                               tokenizer_threads=tokenizer, respond_threads=respond)


# ---- the children ----

def _follow_parent(parent: int) -> None:
    """SIGTERM this process when its parent dies (Linux); if it is gone already, exit now."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)


def _leave(run_dir: str, parent: int) -> None:
    """After a `kill -9` of the supervisor its children drain and end, and its run directory was left in /tmp (a test
    run left hundreds): the child of the lowest pid still alive removes it once the others have ended (at most a
    drain later). A supervisor that stops its children says so first (STOPPING_FILE) and removes the directory
    itself; one still alive a moment later stopped this child alone (and starts another). The supervisor's
    SIGKILL reaches a child (PR_SET_PDEATHSIG) as the threads of the supervisor end, before it is gone: hence
    the wait, not a look at `os.getppid()`."""
    import psutil

    def alive(pid: int) -> bool:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        return False

    stopping, until = Path(run_dir, STOPPING_FILE), time.monotonic() + SUPERVISOR_GONE_S
    while not stopping.exists() and alive(parent):
        if time.monotonic() > until:
            return
        time.sleep(0.02)
    if stopping.exists():
        return
    try:
        pids = json.loads(Path(run_dir, PROCESSES_FILE).read_text())
    except (OSError, ValueError):
        return
    me = os.getpid()
    others = [p for p in (pids.get("engine"), *pids.get("frontends", ())) if p and p != me and alive(p)]
    if any(p < me for p in others):
        return  # that one removes it
    deadline = time.monotonic() + LEAVE_WAIT_S
    while any(alive(p) for p in others) and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(run_dir, ignore_errors=True)


def _logging(role: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {role}[%(process)d] %(name)s: %(message)s")


def engine_main(config, path: str, run_dir: str, first: bool, parent: int) -> None:
    """The engine process: load, warm (from the warm artifact when it matches), serve the pipeline on `path`.
    The `first` engine exits (status 2, the reason in LOAD_FAILED_FILE) if the model does not load: the
    supervisor ends the server with it. A restarted one stays, saying why on /health (503)."""
    _follow_parent(parent)
    _logging("engine")
    from jaxserve.http.server import new_loop
    from jaxserve.runtime import host

    host.keep_freed_memory()

    ended = None
    try:
        ended = asyncio.run(_engine(config, path, run_dir, first), loop_factory=new_loop)
    finally:
        if ended != LOAD_FAILED:  # (that one's supervisor reads why in the run directory, then stops)
            _leave(run_dir, parent)
    if ended == STOPPED_STARTING:  # a load or compile still runs on a thread, which a normal exit would wait for
        logging.shutdown()
        os._exit(0)
    if ended == LOAD_FAILED:
        sys.exit(2)


SERVED, LOAD_FAILED, STOPPED_STARTING = "served", "load failed", "stopped while starting"


async def _engine(config, path: str, run_dir: str, first: bool) -> str:
    """Serve until SIGTERM (-> SERVED); LOAD_FAILED when the first engine could not load the model;
    STOPPED_STARTING on a SIGTERM before the engine was ready (nothing was accepted: no drain; the supervisor
    waited out its grace period, then killed it)."""
    from jaxserve.http.loading import check_prompt, load_encoder, make_pipeline, start_engine
    from jaxserve.http.metrics import EngineMetrics
    from jaxserve.http.server import DRAIN_TIMEOUT_S
    from jaxserve.http.state import warmup_failed
    from jaxserve.http.tally import combined
    from jaxserve.runtime import compiles, device, host, startup
    from jaxserve.runtime.simulated import described
    from jaxserve.scheduling.link import LinkServer

    loop = asyncio.get_running_loop()
    started = startup.Startup()
    started.add("import", startup.since_process_start())
    metrics = EngineMetrics()
    held: dict = {"pipeline": None, "failed": None, "engine": None}

    def status() -> dict:
        pipeline = held["pipeline"]
        if pipeline is None:
            return {"ready": False, "failed": held["failed"], "doing": started.doing,
                    "phases": started.shown()}
        return {"ready": True, **pipeline.status(), "xla_compiles_total": compiles.xla_compiles_total(),
                "simulated": described(held["engine"])}

    link = LinkServer(path, status, metrics.snapshot, combined)
    await link.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    pipeline, loaded = None, False

    starting = concurrent.futures.ThreadPoolExecutor(1, "engine-start")  # not the loop's: asyncio.run waits for that

    async def unless_stopped(fn, *args):
        """`fn(*args)` on a thread, or Stopping once SIGTERM comes first (the thread is left to `os._exit`)."""
        work, stopped = loop.run_in_executor(starting, fn, *args), asyncio.ensure_future(stop.wait())
        await asyncio.wait((work, stopped), return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not work.done():
            raise Stopping
        return work.result()

    try:
        with started.phase("weights", "loading weights"):
            enc = await unless_stopped(load_encoder, config)
        check_prompt(config, enc)
        loaded = True
        table = await unless_stopped(start_engine, config, enc, started)
        pipeline = make_pipeline(config, enc, table, metrics)
        await pipeline.start()
        started.doing = "ready"
        metrics.startup(started.phases)
        held["engine"] = enc.engine
        view = enc.view(EngineView(dict(enc.engine.tables), table))
        card = {"encoder": view, "table": table, "device": device.info_of(table), "source": started.source,
                "phases": started.shown()}
        held["pipeline"] = pipeline
        await link.ready(pipeline, card)
        host.settle_heap()
        log.info("ready: %d buckets; %s", len(table.buckets), started.summary())
        starting.shutdown()
    except Stopping:
        log.info("stopped while %s", started.doing)
        await link.stop()
        return STOPPED_STARTING
    except Exception as exc:
        if first and not loaded:  # the one-process server's message (cli.main's), for the supervisor to say
            why = str(exc) if isinstance(exc, JaxserveError) else f"{type(exc).__name__}: {exc}"
            log.error("the model did not load: %s", why, exc_info=not isinstance(exc, JaxserveError))
            Path(run_dir, LOAD_FAILED_FILE).write_text(why)
            await link.stop()
            return LOAD_FAILED
        held["failed"] = warmup_failed(exc)
        log.exception(held["failed"])
    await stop.wait()
    await link.without_front_ends(DRAIN_TIMEOUT_S)  # they drain first (the supervisor stops them before this one)
    if pipeline is not None:
        await pipeline.drain(DRAIN_TIMEOUT_S)
        await pipeline.stop()
    await link.stop()
    return SERVED


class Stopping(Exception):
    """SIGTERM came while the engine was still loading or warming up."""


@dataclasses.dataclass
class EngineView:
    """What a front-end sees of the engine inside its model view (`Encoder.engine`): the tables, no device."""

    tables: dict
    table: object
    params: None = None


def frontend_main(config, sock: socket.socket, path: str, run_dir: str, index: int, workers: int,
                  parent: int) -> None:
    """A front-end process: the aiohttp app on its listening socket, its jobs sent to the engine, with its share of
    the server's limits (`frontend_config`); /info says the server's."""
    _follow_parent(parent)
    _logging(f"frontend-{index}")
    from jaxserve.http.server import create_app, run_app
    from jaxserve.http.state import STATE
    from jaxserve.scheduling.link import EngineLink

    app = create_app(frontend_config(config, workers), link=EngineLink(path))
    app[STATE].server_config = config
    app[STATE].processes_file = os.path.join(run_dir, PROCESSES_FILE)
    app[STATE].settle_heap = True
    try:
        run_app(app, config, sock=sock)
    finally:
        _leave(run_dir, parent)


# ---- the supervisor ----

@contextlib.contextmanager
def _env(**values: str):
    """Environment variables for the children started inside (spawned children copy os.environ)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Supervisor:
    """Starts the engine and the front-ends, restarts the ones that die, stops them all (front-ends first)."""

    def __init__(self, config, socks: list[socket.socket], workers: int, malloc: tuple[str, dict] | None = None):
        from jaxserve.runtime import host

        self.config = config
        # the children's allocator and the variables that give it them (`host.malloc_env`: read at a process's start)
        self.malloc, self.malloc_env = malloc or host.malloc_env("glibc", os.environ)
        self.socks: list[socket.socket | None] = socks  # front-end i's listening socket (None: it is being replaced)
        self.address = socks[0].family, socks[0].getsockname()[:2]
        self.workers = workers
        self.run_dir = tempfile.mkdtemp(prefix="jaxserve-")  # 0700: only this user may reach the engine's socket
        self.path = os.path.join(self.run_dir, "engine.sock")
        self.ctx = multiprocessing.get_context("spawn")
        self.engine: multiprocessing.Process | None = None
        self.frontends: list[multiprocessing.Process | None] = [None] * workers
        self.started_at: dict[int, float] = {}
        self.backoff: dict[str, float] = {}
        self.engine_restarts = 0
        self.stopping = False

    def _start(self, target, args, name: str, **env) -> multiprocessing.Process:
        with _env(**{**self.malloc_env, **env}):
            proc = self.ctx.Process(target=target, args=(*args, os.getpid()), name=name, daemon=False)
            proc.start()
        self.started_at[proc.pid] = time.monotonic()
        return proc

    def start_engine(self) -> None:
        self.engine = self._start(engine_main, (self.config, self.path, self.run_dir, self.engine_restarts == 0),
                                  "jaxserve-engine")
        self._write_processes()

    def start_frontend(self, i: int) -> None:
        # JAX_PLATFORMS=cpu: a front-end imports no JAX (it holds the engine's ModelView); were anything to, it
        # would still not touch the accelerator; the tokenizer's threads: its share of the cores
        from jaxserve.runtime import host

        self.frontends[i] = self._start(frontend_main, (self.config, self.listening(i), self.path, self.run_dir, i,
                                                        self.workers),
                                        f"jaxserve-frontend-{i}", JAX_PLATFORMS="cpu",
                                        **host.tokenizer_env(host.usable_cores(), self.workers, os.environ))
        self._write_processes()

    def _write_processes(self) -> None:
        pids = {"supervisor": os.getpid(), "engine": self.engine.pid if self.engine else None,
                "frontends": [p.pid for p in self.frontends if p is not None], "malloc": self.malloc}
        tmp = os.path.join(self.run_dir, PROCESSES_FILE + ".tmp")
        Path(tmp).write_text(json.dumps(pids))
        os.replace(tmp, os.path.join(self.run_dir, PROCESSES_FILE))

    def children(self) -> list[multiprocessing.Process]:
        return [p for p in [self.engine, *self.frontends] if p is not None]

    def run(self) -> None:
        self.start_engine()
        for i in range(self.workers):
            self.start_frontend(i)
        while not self.stopping:
            sentinels = {p.sentinel: p for p in self.children()}
            for sentinel in multiprocessing.connection.wait(list(sentinels), timeout=0.5):
                self._died(sentinels[sentinel])

    def _died(self, proc: multiprocessing.Process) -> None:
        proc.join()
        if self.stopping:
            return
        role = "engine" if proc is self.engine else "frontend"
        failed = Path(self.run_dir, LOAD_FAILED_FILE)
        if role == "engine" and failed.exists():
            raise JaxserveError(failed.read_text())
        log.error("the %s process %d exited with %s", role, proc.pid, proc.exitcode)
        young = time.monotonic() - self.started_at.pop(proc.pid, 0.0) < YOUNG_S
        delay = min(RESTART_BACKOFF_S[1], 2 * self.backoff.get(role, RESTART_BACKOFF_S[0] / 2)) if young \
            else RESTART_BACKOFF_S[0]
        self.backoff[role] = delay
        if role == "engine":
            self.engine = None
            if self.engine_restarts >= self.config.engine_restarts:
                log.error("the engine was restarted %d times; not again: /health says 503 until this server is "
                          "stopped", self.engine_restarts)
                self._write_processes()
                return
            self.engine_restarts += 1
            time.sleep(delay)
            if not self.stopping:  # a SIGTERM while it waited
                self.start_engine()
        else:
            i = self.frontends.index(proc)
            self.frontends[i] = None
            self.close_listener(i)
            time.sleep(delay)
            if not self.stopping:
                self.start_frontend(i)

    def listening(self, i: int) -> socket.socket:
        """Front-end i's socket: its predecessor's while that lives, else a new one of the same port (`bound`)."""
        if self.socks[i] is None:
            self.socks[i] = bound(*self.address)
        return self.socks[i]

    def close_listener(self, i: int) -> None:
        """Front-end i died: close its socket, so that while it is replaced the kernel gives new connections to the
        others (those already in its backlog are reset); its replacement gets a new one (`listening`)."""
        if self.socks[i] is not None:
            self.socks[i].close()
            self.socks[i] = None

    def mark_stopping(self) -> None:
        """Stopping: children ending from now on leave the run directory to this process (`_leave`)."""
        self.stopping = True
        Path(self.run_dir, STOPPING_FILE).touch()

    def stop(self, drain_s: float) -> None:
        """Front-ends first (each finishes what it accepted), then the engine; whatever is left is killed. This
        process's copies of the listening sockets are closed first: the port then refuses new connections once each
        front-end has closed its own, as one process's does, where the kernel would queue them through the drain."""
        self.mark_stopping()
        for i in range(self.workers):
            self.close_listener(i)
        for proc in self.frontends:
            if proc is not None and proc.is_alive():
                proc.terminate()
        for proc in self.frontends:
            if proc is not None:
                proc.join(drain_s + 5)
        if self.engine is not None and self.engine.is_alive():
            self.engine.terminate()
            self.engine.join(drain_s + 5)
        for proc in self.children():
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(self.run_dir, ignore_errors=True)


@dataclasses.dataclass
class PortHold:
    """What keeps the port this server's while front-ends come and go: a socket of the port that never listens
    (bound without SO_REUSEADDR where it can be), and a claim of the port's number among jaxserve servers on this
    host (an abstract Unix socket: released with the process), which another jaxserve's start finds taken."""

    sock: socket.socket
    claim: socket.socket

    def getsockname(self):
        return self.sock.getsockname()

    def close(self) -> None:
        self.sock.close()
        self.claim.close()


def listeners(host: str, port: int, n: int) -> tuple[PortHold, list[socket.socket]]:
    """Sockets of one port, SO_REUSEPORT: one per front-end, so that the kernel spreads new connections over
    them (on one shared socket the first front-end to wake accepted a burst of connections whole: a client
    opening 32 keep-alive connections at once had all of them on one front-end in two runs of three, one core
    idle), and the hold that keeps the port this server's.

    They are bound, not listening: a front-end listens on its own (aiohttp's site does) once it can serve, so
    no connection waits on a front-end still starting, or one that died, while the others could take it. A
    port in use fails at once: one with a listener (anyone's), or one another jaxserve holds."""
    probe = socket.create_server((host, port), backlog=1, reuse_port=False)
    family, (address, port) = probe.family, probe.getsockname()[:2]
    probe.close()
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        claim.bind(f"\0jaxserve-port-{family.name}-{address}-{port}")
    except OSError as exc:
        claim.close()
        if exc.errno != errno.EADDRINUSE:
            raise
        raise OSError(errno.EADDRINUSE, f"{address} port {port} is held by another jaxserve server") from None
    try:
        sock = bound(family, (host, port), reuse_address=False)  # no SO_REUSEADDR: no one else binds the port
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            claim.close()
            raise
        # TIME_WAITs of another server's connections (one without SO_REUSEPORT: `--workers 1`, another program)
        # refuse a bind without SO_REUSEADDR for a minute; the probe found no listener. The price: until the
        # front-ends listen, a program binding with SO_REUSEADDR alone could still take the port (their listen
        # would then fail, and the supervisor restart them until it is free)
        sock = bound(family, (host, port))
    return PortHold(sock, claim), [bound(family, (host, port)) for _ in range(n)]


def bound(family: int, address: tuple, reuse_address: bool = True) -> socket.socket:
    """A socket of the port (SO_REUSEPORT), bound, not listening. SO_REUSEADDR as a listening socket has it: the
    connections it accepts leave TIME_WAITs that a later server's bind of the port must not trip on."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if reuse_address:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.setblocking(False)
    return sock


def serve_workers(config, host: str, port: int) -> None:
    """`jaxserve serve --workers N` (N > 1): bind the port here, so a port in use fails at once; then supervise
    until SIGTERM or SIGINT."""
    from jaxserve.http.server import DRAIN_TIMEOUT_S
    from jaxserve.runtime.host import malloc_env, raise_open_files

    _logging("supervisor")
    try:
        malloc = malloc_env(config.malloc, os.environ)
    except ValueError as err:
        raise SystemExit(f"jaxserve serve: {err}") from None
    holder, socks = listeners(host, port, config.workers)
    log.info("serving on http://%s:%d with %d front-end processes and one engine process (malloc: %s; open files: "
             "at most %s each)", host, socks[0].getsockname()[1], config.workers, malloc[0], raise_open_files())
    supervisor = Supervisor(config, socks, config.workers, malloc)

    def on_signal(signum, frame):
        supervisor.mark_stopping()  # at once: a SIGTERM to the group reaches the children as it reaches this process

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        supervisor.run()
    finally:
        supervisor.stop(DRAIN_TIMEOUT_S)
        for sock in (holder, *supervisor.socks):
            if sock is not None:
                sock.close()
    sys.stdout.flush()
