"""Start `jaxserve serve` as a subprocess and wait until it is ready (benchmarks, tests, scripts)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys

import aiohttp


def free_port() -> int:
    """A loopback port the OS says is free now (for a server started just after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(port: int, *flags: str, quiet: bool = True):
    """A `jaxserve serve` process on 127.0.0.1:`port`; yields (url, process); terminated on exit."""
    out = subprocess.DEVNULL if quiet else None
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), *flags],
                            stdout=out, stderr=out)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)


async def wait_ready(session: aiohttp.ClientSession, url: str, timeout_s: float = 120.0, poll_s: float = 0.1,
                     proc: subprocess.Popen | None = None) -> None:
    """Poll /health until it answers 200 (the server warms up first); fail at once if `proc` exits."""
    for _ in range(int(timeout_s / poll_s)):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"jaxserve serve exited with {proc.returncode}")
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(poll_s)
    raise TimeoutError(f"{url} was not ready within {timeout_s:.0f} s")
