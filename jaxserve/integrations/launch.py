"""Start `jaxserve serve` as a subprocess and wait until it is ready (benchmarks, tests, scripts)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys

import aiohttp

from jaxserve.http.state import WARMUP_FAILED


def free_port() -> int:
    """A loopback port the OS says is free now (for a server started just after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STOP_S = 60.0  # a server gets this long to exit after SIGTERM, then SIGKILL


@contextlib.contextmanager
def served(port: int, *flags: str, quiet: bool = True, command: list[str] | None = None, cwd=None,
           env: dict | None = None, stdout=None):
    """A `jaxserve serve --port PORT *flags` process on 127.0.0.1 (or `command`, a whole argv serving that
    port, run in `cwd` with `env`); yields (url, process); stopped on exit (`stop`). Its output goes to the
    file `stdout` (stderr too), else nowhere (`quiet`) or to this process's."""
    out = stdout if stdout is not None else subprocess.DEVNULL if quiet else None
    cmd = command or [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if stdout is not None else out, cwd=cwd, env=env)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, timeout_s: float = STOP_S) -> None:
    """SIGTERM (the server drains), then SIGKILL if it has not exited within `timeout_s`: never an orphan."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def wait_ready(session: aiohttp.ClientSession, url: str, timeout_s: float = 120.0, poll_s: float = 0.1,
                     proc: subprocess.Popen | None = None) -> None:
    """Poll /health until it answers 200 (the server warms up first); fail at once if `proc` exits, or if /health
    says the warm-up failed (no wait will make that server ready)."""
    for _ in range(int(timeout_s / poll_s)):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"jaxserve serve exited with {proc.returncode}")
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
                body = await r.read()
        except aiohttp.ClientError:
            body = b""
        if (failed := _warmup_failed(body)) is not None:
            raise RuntimeError(f"{url} will not be ready: {failed}")
        await asyncio.sleep(poll_s)
    raise TimeoutError(f"{url} was not ready within {timeout_s:.0f} s")


def _warmup_failed(body: bytes) -> str | None:
    """The status of a /health body saying the warm-up failed, else None (warming, draining, or not jaxserve's)."""
    try:
        status = json.loads(body).get("status")
    except (ValueError, AttributeError):
        return None
    return status if isinstance(status, str) and status.startswith(WARMUP_FAILED) else None
