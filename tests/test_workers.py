"""`jaxserve serve --workers N`: front-end processes and one engine process, as a user runs them.

Real processes on loopback (tiny checkpoint). The fault cases run on a simulated device slow enough that a
request is certainly still waiting when a process is killed: nothing here depends on how long anything takes,
only on the order of events (every wait is a bounded poll for a state).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import psutil
import pytest
import tiny
from conftest import FEW_OPEN_FILES, TINY_TABLE, Upload, cosine_rows, raised_open_files, stopped_listening
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.integrations.launch import free_port, stop, wait_ready
from jaxserve.runtime import host

POLL_S = 0.05
BOUND_S = 120.0  # the most any state is waited for (a slow machine's start-up)


def serve(*flags: str, session: bool = False) -> tuple[str, subprocess.Popen]:
    """`session`: in a process group of its own, which a test may signal whole. Started as a distribution starts
    a process, with a soft limit of 1024 open files (`host.raise_open_files` raises it)."""
    port = free_port()
    proc = subprocess.Popen([*FEW_OPEN_FILES, sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port),
                             *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=session)
    return f"http://127.0.0.1:{port}", proc


def maps_jax(pid: int) -> bool:
    """Whether a process has JAX loaded: jaxlib's native library in its memory map."""
    return any("jaxlib" in m.path for m in psutil.Process(pid).memory_maps(grouped=True))


async def get_json(url: str, path: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        async with s.get(url + path) as r:
            return r.status, await r.json()


async def poll(check, what: str):
    """check() until it returns something true; fail after BOUND_S."""
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if result := await check():
            return result
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"not within {BOUND_S:.0f} s: {what}")


async def ready(url: str, proc: subprocess.Popen) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        await wait_ready(s, url, timeout_s=BOUND_S, proc=proc)
    return (await get_json(url, "/info"))[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("workers")
    TINY_TABLE.save(root / "table.json")
    return tiny.write_checkpoint(root / "ckpt"), root / "table.json"


def test_serve_options_reach_the_config():
    """--workers, the simulated device and --task as `jaxserve serve` reads them; auto workers by the rule."""
    from jaxserve import cli
    from jaxserve.runtime import host

    parse = lambda *a: cli.serve_config(cli.build_parser().parse_args(["serve", *a]))
    config = parse("--workers", "3", "--simulate-device", "2.5", "--simulate-size", "768,3072,12",
                   "--task", "retrieval.query", "--engine-restarts", "0", "--access-log", "--host-dispatch-us", "250")
    assert (config.workers, config.engine_restarts, config.task, config.access_log) == (3, 0, "retrieval.query", True)
    assert config.host_dispatch_us == 250 and parse().host_dispatch_us is None  # given, or measured
    assert config.simulate.tflops == 2.5 and config.simulate.sizes == (768, 3072, 12)
    assert not config.embed_all and not config.use_cache  # a simulated device: pooled outputs only, nothing saved
    assert parse().workers == host.frontend_workers() and not parse().access_log and parse().simulate is None
    assert parse("--malloc", "jemalloc").malloc == "jemalloc" and parse().malloc == "auto"
    assert [host.frontend_workers(c) for c in (1, 2, 3, 4, 8, 16, 64)] == [1, 1, 1, 2, 6, 14, 32]
    for bad in (["--workers", "0"], ["--simulate-size", "768,3072"], ["--malloc", "tcmalloc"]):
        with pytest.raises(SystemExit):
            parse(*bad)


def test_one_process_asked_for_an_allocator_it_was_not_started_with_says_how():
    """A process cannot preload an allocator into itself: `--workers 1 --malloc jemalloc` started without it ends at
    once (before loading a model), saying how to start it."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-m", "jaxserve.cli", "serve", "--workers", "1", "--malloc", "jemalloc",
                          "--port", str(free_port())], capture_output=True, text=True, env=env, timeout=BOUND_S)
    assert out.returncode != 0 and "LD_PRELOAD=libjemalloc.so.2 jaxserve serve" in out.stderr, out.stderr


def test_a_model_the_first_engine_cannot_load_ends_the_server_as_one_process_does(files, tmp_path):
    """A wrong path, or a task the checkpoint has no adapter for: with two workers as with one, the server exits
    with status 2 and the same one line, not a server answering 503 forever."""
    path, table = files
    for flags in (["--model", str(tmp_path / "not-there")], ["--model", str(path), "--task", "retrieval.query"]):
        said = []
        for workers in ("1", "2"):
            proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(free_port()),
                                     "--buckets", str(table), "--no-cache", "--workers", workers, *flags],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                _, err = proc.communicate(timeout=BOUND_S)
            except subprocess.TimeoutExpired:
                stop(proc)  # the supervisor stops its children
                raise AssertionError(f"--workers {workers} {flags}: still serving after {BOUND_S:.0f} s") from None
            assert proc.returncode == 2, err
            said.append(err.strip().splitlines()[-1])
        assert said[0] == said[1] and said[0].startswith("jaxserve: "), said


def test_two_front_ends_serve_as_one_process_does(files):
    """Same vectors as the model in this process; one engine (the batcher sees every front-end's rows); /metrics
    one view over all processes; errors, explain and /info as a single process gives them."""
    from conftest import warm_encoder

    path, table = files
    url, proc = serve("--model", str(path), "--buckets", str(table), "--workers", "2")
    try:
        info = asyncio.run(ready(url, proc))
        procs = info["processes"]
        assert procs["supervisor"] == proc.pid and len(procs["frontends"]) == 2 and procs["engine"]
        children = {p.pid: " ".join(p.cmdline()) for p in psutil.Process(proc.pid).children()}
        assert {procs["engine"], *procs["frontends"]} <= set(children)
        assert all("resource_tracker" in cmd for pid, cmd in children.items()  # multiprocessing's own helper
                   if pid not in (procs["engine"], *procs["frontends"]))
        assert info["device"]["platform"] == "cpu" and info["buckets"] and "SIMULATED_DEVICE" not in info
        assert info["host_dispatch"]["source"] == "measured"  # the engine's, as its status says
        # the server's limits, not one front-end's share of them (each holds half: `frontend_config`)
        assert info["max_concurrent_requests"] == 512 and info["limits"]["max_inflight_bytes"] == 256 * 2**20
        # the engine runs the model with JAX; a front-end never imports it (its memory map holds no jaxlib)
        assert maps_jax(procs["engine"]) and not any(maps_jax(pid) for pid in procs["frontends"])
        # `--malloc auto`: the first allocator installed here preloaded into every child (glibc's where none is),
        # and glibc's larger cache of freed blocks, from their start
        assert procs["malloc"] == host.malloc_env("auto", os.environ)[0]
        for pid in [procs["engine"], *procs["frontends"]]:
            assert host.MALLOC_TUNABLES in psutil.Process(pid).environ().get("GLIBC_TUNABLES", "")
            mapped = {name for name in host.PRELOADS if f"lib{name}" in Path(f"/proc/{pid}/maps").read_text()}
            assert mapped == ({procs["malloc"]} & set(host.PRELOADS))
        for pid in [proc.pid, procs["engine"], *procs["frontends"]]:  # each connection a file: as many as allowed
            assert psutil.Process(pid).rlimit(psutil.RLIMIT_NOFILE)[0] == raised_open_files()
        want = host.tokenizer_env(host.usable_cores(), 2, os.environ)  # the tokenizer's threads: a share of the cores
        for pid in procs["frontends"]:
            env = psutil.Process(pid).environ()
            assert {k: env.get(k) for k in want} == want

        texts = [f"document number {i} " * (1 + i % 5) for i in range(12)]

        async def requests():
            async def one(i):
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                    async with s.post(url + "/v1/embeddings", json={"input": texts[i : i + 3]}) as r:
                        assert r.status == 200, await r.text()
                        return [d["embedding"] for d in (await r.json())["data"]]
            vectors = await asyncio.gather(*(one(i) for i in range(0, 12, 3)))
            # one-document queries at once: a front-end joins those of one turn of its loop into one engine job
            async with aiohttp.ClientSession() as s:
                async def query(text):
                    async with s.post(url + "/v1/embeddings", json={"input": text}) as r:
                        assert r.status == 200, await r.text()
                        return (await r.json())["data"][0]["embedding"]
                queries = await asyncio.gather(*(query(t) for t in texts[:8]))
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                async with s.post(url + "/v1/embeddings", json={"input": ["x"], "dimensions": 0}) as r:
                    bad = r.status, await r.json()
                async with s.post(url + "/v1/embeddings?explain=1", json={"input": texts[:4]}) as r:
                    explained = r.status, await r.json()
                async with s.get(url + "/metrics") as r:
                    metrics = await r.text()
            return [v for part in vectors for v in part], queries, bad, explained, metrics

        vectors, queries, bad, explained, metrics = asyncio.run(requests())
        assert len(set(asyncio.run(_burst(url, procs["frontends"], 16)))) == 2  # a burst of connections: both
        reference = warm_encoder(path, TINY_TABLE).embed(texts)
        assert cosine_rows(np.array(vectors), reference).min() > 0.99999
        assert cosine_rows(np.array(queries), reference[:8]).min() > 0.99999  # each query its own vector
        assert bad[0] == 400 and "dimensions" in bad[1]["error"]["message"]
        assert explained[0] == 200 and explained[1]["explain"]["batches"]
        count = lambda name: sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                                 if line.startswith(name))
        # every request counted once, whichever front-end took it; the engine's batches and device time with them
        assert count('jaxserve_requests_total{route="/v1/embeddings",status="200"}') == 13
        assert count('jaxserve_inputs_total') == 24
        # the engine's per-request histograms count every request, joined queries each
        assert count("jaxserve_class_request_seconds_count") == 13
        assert count("jaxserve_batches_total") >= 1 and count("jaxserve_device_busy_seconds_total") > 0
        # the engine's own counts: every sequence submitted, and dispatched for a waiting request
        assert count('jaxserve_sequences_total{outcome="submitted"}') == 24
        assert count('jaxserve_sequences_total{outcome="dispatched"}') == 24
        # one family per name: the front-ends' per-request phases (their files) beside the engine's per-batch ones
        # (its tally, asked for over the link)
        families = list(text_string_to_metric_families(metrics))
        assert len({f.name for f in families}) == len(families)
        assert count('jaxserve_phase_seconds_count{phase="tokenize"}') == 13
        assert count('jaxserve_phase_seconds_count{phase="device"}') == count("jaxserve_batches_total")
    finally:
        stop(proc)
    assert proc.returncode == 0
    for pid in [procs["engine"], *procs["frontends"]]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


async def _burst(url: str, frontends: list[int], n: int) -> list[int]:
    """Open `n` connections at once (as a client's pool does) -> the front-end holding each."""
    host, port = url.removeprefix("http://").split(":")
    opened = await asyncio.gather(*(asyncio.open_connection(host, int(port)) for _ in range(n)))
    try:
        return [await poll(lambda w=w: _held(frontends, w.get_extra_info("sockname")[1]), "the connection held")
                for _, w in opened]
    finally:
        for _, w in opened:
            w.close()


def _accepted(sock, n: int) -> list:
    """Up to `n` connections waiting on a listening socket, accepted (a bounded wait for each)."""
    import select

    got = []
    while len(got) < n and select.select([sock], [], [], BOUND_S / 10)[0]:
        got.append(sock.accept()[0])
    return got


def test_a_stopping_server_refuses_new_connections_once_its_front_ends_close_their_sockets():
    """The supervisor closes its own copies of the listening sockets before it signals the front-ends: once each
    front-end has closed its copy (its drain's first step), a new connection is refused at once, as by one process.
    Before, the supervisor's copy kept the port listening through the drain: connections were queued that no one
    would accept, and reset when it ended."""
    import socket

    from jaxserve.http.workers import Supervisor, listeners

    holder, socks = listeners("127.0.0.1", 0, 1)
    port = holder.getsockname()[1]
    supervisor = Supervisor(None, socks, 1)
    own = socks[0].dup()  # the front-end's copy (its process's, inherited)
    own.listen()  # as its aiohttp site does

    class FrontEnd:  # stands in for the front-end's process: its drain closes its copy
        alive, refused = True, None

        def is_alive(self):
            return self.alive

        def terminate(self):
            own.close()
            self.alive = False
            try:
                socket.create_connection(("127.0.0.1", port), timeout=BOUND_S).close()
                self.refused = False
            except ConnectionRefusedError:
                self.refused = True

        def join(self, timeout=None):
            pass

    front = FrontEnd()
    supervisor.frontends = [front]
    try:
        supervisor.stop(0)
        assert front.refused
    finally:
        holder.close()


def test_each_front_end_listens_on_its_own_socket_of_the_port():
    """SO_REUSEPORT: the kernel spreads connections over the front-ends' sockets (test_two_front_ends... opens a
    burst). A socket takes connections only once its front-end listens; a dead front-end's is closed, so new
    connections go to the others while it is replaced; the port stays held, and a port already in use, by another
    process or another jaxserve, still fails at once."""
    import socket

    from jaxserve.http.workers import Supervisor, listeners

    holder, socks = listeners("127.0.0.1", 0, 3)
    port = holder.getsockname()[1]
    supervisor = Supervisor(None, socks, 3)
    connect = lambda: socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    try:
        assert [s.getsockname()[1] for s in socks] == [port] * 3
        assert all(s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) for s in socks)
        with pytest.raises(ConnectionRefusedError):  # no front-end listens yet: refused, not left waiting
            connect()
        with pytest.raises(OSError):
            listeners("127.0.0.1", port, 2)
        for s in socks:
            s.listen()  # as each front-end's aiohttp site does
        supervisor.close_listener(1)
        supervisor.close_listener(2)  # two front-ends dead: every new connection goes to the live one
        clients = [connect() for _ in range(12)]
        served = _accepted(supervisor.socks[0], 12)
        assert len(served) == 12
        supervisor.close_listener(0)  # all three: the port is still this server's
        with pytest.raises(OSError):
            socket.create_server(("127.0.0.1", port))
        replaced = supervisor.listening(1)  # a replacement's socket: the same port, taking connections once it
        assert replaced.getsockname()[1] == port and supervisor.listening(1) is replaced  # listens
        replaced.listen()
        clients += [connect() for _ in range(4)]
        late = _accepted(replaced, 4)
        assert len(late) == 4
        served += late
        for c in served + clients:  # the server's side closes first: its connections stay in TIME_WAIT
            c.close()
    finally:
        supervisor.stop(0)
        for s in (holder, *supervisor.socks):
            if s is not None:
                s.close()
    again, socks = listeners("127.0.0.1", port, 2)  # a restart on the port at once, TIME_WAITs and all
    for s in (again, *socks):
        s.close()
    plain = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(OSError):
            listeners("127.0.0.1", plain.getsockname()[1], 2)
    finally:
        plain.close()


def test_workers_start_on_a_port_another_server_just_left():
    """TIME_WAITs of a server without SO_REUSEPORT (`--workers 1`, or another program) do not refuse `--workers N`
    the port, as they do not refuse aiohttp's one socket; a server still listening there does, and so does another
    jaxserve holding it (its claim of the port)."""
    import socket

    from jaxserve.http.workers import listeners

    other = socket.create_server(("127.0.0.1", 0))  # SO_REUSEADDR, as aiohttp's: no SO_REUSEPORT
    port = other.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = other.accept()
    served.close()  # the server's side closes first: TIME_WAIT on the port
    client.close()
    other.close()
    holder, socks = listeners("127.0.0.1", port, 2)
    try:
        with pytest.raises(OSError, match="another jaxserve"):
            listeners("127.0.0.1", port, 2)
    finally:
        for s in (holder, *socks):
            s.close()
    listening = socket.create_server(("127.0.0.1", port))
    try:
        with pytest.raises(OSError):
            listeners("127.0.0.1", port, 2)
    finally:
        listening.close()
    held = [listeners(address, port, 2) for address in ("127.0.0.1", "127.0.0.2")]  # a claim is per address
    for holder, socks in held:
        for s in (holder, *socks):
            s.close()


async def send_raw(url: str, body: dict):
    """A request on a connection of its own, its response not read yet: (reader, writer, local port)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    await writer.drain()
    return reader, writer, writer.get_extra_info("sockname")[1]


async def status_of(reader) -> int | None:
    """The response's status, or None when the connection closed without one."""
    line = await reader.readline()
    return int(line.split()[1]) if line else None


def holder(frontends: list[int], client_port: int) -> int | None:
    """The front-end process holding the server side of the client connection from `client_port`."""
    for pid in frontends:
        if any(c.raddr and c.raddr.port == client_port for c in psutil.Process(pid).net_connections("tcp")):
            return pid
    return None


def test_faults_fail_only_what_they_must_and_leave_no_process(files):
    """A front-end killed: only its own requests fail; it is replaced. The engine killed: every waiting request
    gets 503 and /health says 503 (no restarts allowed here). The supervisor killed: no child survives, nor its
    run directory."""
    path, _ = files
    # 1e-9 TFLOP/s: a dispatch takes hours; every request below is waiting when its process is killed
    url, proc = serve("--model", str(path), "--simulate-device", "1e-9", "--workers", "2", "--engine-restarts", "0")

    async def scenario():
        info = await ready(url, proc)
        assert "SIMULATED_DEVICE" in info and "NO MODEL" in info["SIMULATED_DEVICE"]["warning"]
        frontends = info["processes"]["frontends"]
        sent, on = [], []
        while len(set(on)) < 2:  # requests on connections of their own until both front-ends hold some
            assert len(sent) < 64, "every connection went to one front-end"
            sent.append(await send_raw(url, {"input": [f"text {len(sent)}"]}))
            port = sent[-1][2]
            on.append(await poll(lambda: _held(frontends, port), "the request held by a front-end"))
        victim = on[0]
        survivors = [i for i, pid in enumerate(on) if pid != victim]
        os.kill(victim, signal.SIGKILL)
        for i, pid in enumerate(on):
            if pid == victim:  # its connections close without a response
                assert await asyncio.wait_for(status_of(sent[i][0]), BOUND_S) is None
        replaced = await poll(lambda: _replaced(url, victim), "the killed front-end replaced")
        assert len(replaced) == 2 and victim not in replaced
        assert (await get_json(url, "/health"))[0] == 200

        engine = (await get_json(url, "/info"))[1]["processes"]["engine"]
        (sock,) = {c.laddr for c in psutil.Process(engine).net_connections("unix") if c.laddr.endswith("engine.sock")}
        os.kill(engine, signal.SIGKILL)
        for i in survivors:  # waiting on the engine: 503, not a hang
            assert await asyncio.wait_for(status_of(sent[i][0]), BOUND_S) == 503
        await poll(lambda: _health_is(url, 503), "/health 503 once the engine is gone")
        status, body = await get_json(url, "/health")
        assert status == 503 and "engine" in json.dumps(body)
        async with aiohttp.ClientSession() as s:  # the latency math asks the engine too: 503 (test_link's explain test)
            for path in ("/v1/plan", "/v1/embeddings?explain=1"):
                async with s.post(url + path, json={"input": ["a text"]}) as r:
                    assert r.status == 503 and "engine" in (await r.json())["error"]["message"], path
        # /metrics still answers: the front-ends' own, without the engine's
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/metrics") as r:
                assert r.status == 200
                text = await r.text()
        assert "jaxserve_requests_total" in text and "jaxserve_sequences_total" not in text
        return replaced, os.path.dirname(sock)

    try:
        frontends, run_dir = asyncio.run(scenario())
        assert os.path.exists(os.path.join(run_dir, "processes.json"))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + BOUND_S
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in frontends):
            assert time.monotonic() < deadline, "a front-end outlived its supervisor's SIGKILL"
            time.sleep(POLL_S)
        assert not os.path.exists(run_dir)  # the last child removed it (it was left in /tmp)
    finally:
        if proc.poll() is None:
            stop(proc)


async def _held(frontends, port):
    return holder(frontends, port)


async def _replaced(url, victim):
    try:
        status, info = await get_json(url, "/info")
    except aiohttp.ClientError:
        return None
    pids = info["processes"]["frontends"]
    return pids if len(pids) == 2 and victim not in pids and all(psutil.pid_exists(p) for p in pids) else None


async def _health_is(url, expected):
    try:
        return (await get_json(url, "/health"))[0] == expected
    except aiohttp.ClientError:
        return False


# ---- every route answers in a front-end as in one process ----

TEXTS = ["the jax model", "a batch of documents for the query " * 3, "hello, world! 42", "x"]
ROUTES = {  # model kind: the requests sent to both servers
    "embedding": [
        ("/v1/embeddings", {"input": TEXTS}), ("/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"}),
        ("/v1/embeddings", {"input": TEXTS[:2], "encoding_format": "ubinary"}), ("/embed", {"inputs": TEXTS}),
        ("/embed_all", {"inputs": TEXTS[:2]}), ("/similarity", {"inputs": {"source_sentence": "the model",
                                                                       "sentences": TEXTS}}),
        ("/", {"inputs": TEXTS[0]}), ("/tokenize", {"inputs": TEXTS}), ("/decode", {"ids": [[7, 8, 9]]}),
        ("/v2/embed", {"model": "m", "texts": TEXTS, "input_type": "search_document",
                       "embedding_types": ["float", "int8", "binary"]}),
        ("/v1/plan", {"input": TEXTS}), ("/embed", {"inputs": "x" * 10, "truncate": False, "dimensions": 0}),
        ("/v1/embeddings", {"input": []}),
    ],
    "classifier": [
        ("/predict", {"inputs": [[t] for t in TEXTS]}), ("/classify", {"input": TEXTS}),
        ("/predict", {"inputs": [["a question", "an answer"]]}),
    ],
    "reranker": [
        ("/rerank", {"query": "the model", "texts": TEXTS, "return_text": True}),
        ("/v1/rerank", {"query": "the model", "documents": TEXTS, "top_n": 2}),
        ("/score", {"text_1": "the model", "text_2": TEXTS}),
        ("/v2/rerank", {"model": "m", "query": "the model", "documents": TEXTS, "top_n": 3}),
    ],
}
VOLATILE = {"id", "created", "explain", "measured", "would_wait_behind"}  # and times (`*_s`, `predicted*`): each
# server timed its own buckets
# ... and so a plan's packing width and batches, which follow those timings (`planner.pack`, the batcher's covers)
PLAN_TIMED = {"pack_seqlen", "batches", "padded_tokens", "padding_ratio", "dispatches", "one_max_batch"}


def same(a, b, path="") -> None:
    """JSON bodies equal, floats to 1e-4 (rows may share different batches), timing fields left out."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (path, a.keys(), b)
        volatile = VOLATILE | (PLAN_TIMED if path == "/v1/plan" else set())
        if path == "/v1/plan":  # whatever the batches, each plans every document
            documents = lambda plan: sorted(d for batch in plan["batches"] for d in batch["documents"])
            assert documents(a) == documents(b) and set(documents(a)) == set(range(len(TEXTS))), (path, a, b)
        for k in a:
            if k not in volatile and not k.endswith("_s") and not k.startswith("predicted"):
                same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (path, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-4), (path, a, b)
    elif isinstance(a, str) and path.endswith(".embedding"):  # base64 float32: the same vector, to 1e-4
        got, want = (np.frombuffer(base64.b64decode(x), np.float32) for x in (b, a))
        assert got.shape == want.shape and np.allclose(got, want, rtol=1e-4, atol=1e-4), (path, a, b)
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("kind", ROUTES)
async def test_every_route_answers_in_a_front_end_as_in_one_process(make_server, files, tmp_path, kind):
    from conftest import warm_encoder

    path = {"embedding": files[0]}.get(kind) or tiny.write_checkpoint(
        tmp_path / kind, num_labels={"classifier": 3, "reranker": 1}[kind])
    one = await make_server(warm_encoder(path, TINY_TABLE), model=str(path))
    url, proc = serve("--model", str(path), "--buckets", str(files[1]), "--workers", "2")
    try:
        await ready(url, proc)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            for route, body in ROUTES[kind]:
                want = await one.post(route, json=body)
                async with s.post(url + route, json=body) as got:
                    assert got.status == want.status, (route, body, await got.text(), await want.text())
                    if got.content_type == "application/json":
                        same(await want.json(), await got.json(), route)
                    else:
                        assert await got.read() == await want.read(), route
    finally:
        stop(proc)


def test_a_table_shorter_than_the_model_truncates_at_its_longest_seqlen(tmp_path):
    """`--seqlens` below the model's limit: inputs are cut to the table's longest seqlen (before: a long input fit
    no bucket, and its request failed with 500); `long="error"` refuses them at that limit."""
    from jaxserve import Encoder
    from jaxserve.errors import InputError
    from jaxserve.runtime.derivation import TableOptions

    enc = Encoder.from_pretrained(str(tiny.write_checkpoint(tmp_path / "ckpt")))
    assert enc.tokenizer.max_length > 16
    enc.start(TableOptions(seqlens=(16,), batch_ladder=False), cache=tmp_path / "cache")
    long = "the jax model reads a batch of documents " * 20
    vectors = enc.embed([long, "short"])
    assert vectors.shape[0] == 2 and np.isfinite(vectors).all()
    assert enc.tokenizer.max_length == enc.embedding_config.max_seq_length == 16
    with pytest.raises(InputError):
        enc.embed([long], long="error")


@pytest.mark.parametrize("to", ["supervisor", "group"])
def test_sigterm_drains_every_process_and_loses_no_accepted_request(files, to):
    """SIGTERM to the supervisor while requests are in flight: the front-ends finish what they accepted (the engine
    still runs them), then the engine stops; every request is answered 200, or refused cleanly, and all exit. The
    same when every process of the group gets it at once (systemd stopping the unit, Ctrl-C): each front-end then
    gets a second from the supervisor, which once cancelled its drain (every connection closed unanswered), and
    the engine waits for the front-ends to go before it drains. A request still sending its body when its
    front-end stops is read to its end and answered."""
    path, table = files
    url, proc = serve("--model", str(path), "--buckets", str(table), "--workers", "2",
                      session=to == "group")

    async def scenario():
        await ready(url, proc)
        async with aiohttp.ClientSession() as s:
            async def one(i):
                async with s.post(url + "/v1/embeddings",
                                  json={"input": [f"the model {i} {j} " * 8 for j in range(32)]}) as r:
                    body = await r.json()
                    return r.status, len(body["data"]) if r.status == 200 else body["error"]["type"]

            upload = Upload(url, "/v1/embeddings", {"input": ["sent in two parts"] * 4})
            await upload.start()
            tasks = [asyncio.create_task(one(i)) for i in range(40)]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)  # load is flowing
            if to == "group":
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
            await stopped_listening(url)  # every front-end stopping: the rest of the body comes after
            uploaded = await upload.finish()
            assert uploaded[0] == 200 and len(uploaded[1]["data"]) == 4, uploaded
            assert upload.closes  # answered while draining: its client's next request goes elsewhere
            return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        results = asyncio.run(scenario())
        proc.wait(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            stop(proc)
    answered = [r for r in results if not isinstance(r, Exception)]
    assert all(r in ((200, 32), (503, "unavailable")) for r in answered), results
    assert sum(r == (200, 32) for r in answered) >= 2, results  # the first, and those in flight at the signal
    refused = [r for r in results if isinstance(r, Exception)]
    assert all(isinstance(e, aiohttp.ClientConnectorError) for e in refused), refused  # never connected
    assert proc.returncode == 0
    assert not [p for p in psutil.Process().children(recursive=True) if "jaxserve" in " ".join(p.cmdline())]


def test_sigterm_while_the_engine_warms_up_stops_it_at_once():
    """SIGTERM while the engine compiles: nothing was accepted, so it stops there. It finished its warm-up first
    (minutes on a GPU), and the supervisor, after its grace period, killed it; the server still exited 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # the bundled MiniLM, compiled from nothing: tens of seconds of warm-up to stop in
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--no-cache", "--workers", "2", "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    async def compiling():
        try:
            async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
                return "compiling" in await r.text()
        except aiohttp.ClientError:
            return False

    try:
        asyncio.run(poll(compiling, "/health saying the engine is compiling"))
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            stop(proc)
    assert proc.returncode == 0, out
    assert "stopped while compiling" in out and "ready:" not in out, out
