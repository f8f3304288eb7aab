"""`jaxserve buckets` and `jaxserve warmup` as a user runs them (subprocesses, tiny model)."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.runtime import artifact
from jaxserve.runtime.buckets import BucketTable


def jaxserve(*args, env=None):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", *args], capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_buckets_prints_memory_math_and_writes_table(tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint())
    out = jaxserve("buckets", "--model", model, "--ladder", "pow2", "--device-memory", str(32 * 2**20),
                   "--max-batch-tokens", "10000000", "--max-batch", "100000", "--write", str(tmp_path / "t.json"))
    assert "budget 0.03 GiB" in out and "memory" in out
    table = BucketTable.load(tmp_path / "t.json")
    assert table.seqlens == [16, 32, 64] and table.ladder == "pow2" and table.layout == "packed"
    for s in table.seqlens:
        *smaller, largest = table.at(s)
        assert largest.limited_by == "memory" and 0 < largest.compiled_bytes <= table.budget_bytes
        assert largest.slots == s // 8 and smaller and all(b.limited_by == "ladder" for b in smaller)


def test_warmup_saves_the_artifact_that_every_later_start_serves_unchanged(tiny_checkpoint, tmp_path):
    """The knee is decided once, at the cold start, from its own timings, and recorded: later starts (warmup or
    serve) load that table and its executables, and compile nothing, however busy the machine is."""
    import asyncio

    import aiohttp

    from jaxserve.integrations.launch import free_port, served, wait_ready

    model = str(tiny_checkpoint())
    cache = tmp_path / "cache"
    (cache / "warm").mkdir(parents=True, mode=0o755)
    stale = cache / "warm" / f"{Path(model).name}-{'0' * 24}{artifact.SUFFIX}"  # this model's, of another key
    stale.write_bytes(artifact.MAGIC + json.dumps({"format": artifact.FORMAT, "key": {}, "bytes": 0, "sha256": "",
                                                   "model_path": str(Path(model).resolve())}).encode() + b"\n")
    args = ["warmup", "--model", model, "--seqlens", "16,64", "--max-batch", "16", "--cache-dir", str(cache),
            "--keep-artifacts", "1"]
    first = jaxserve(*args, "--write", str(tmp_path / "cold.json"))
    built, hits = map(int, re.search(r"(\d+) executables built, (\d+) from the persistent cache", first).groups())
    assert built >= 4 and hits == 0 and "table: derived" in first and "saved" in first
    assert len(list((cache / "warm").iterdir())) == 1 and not stale.exists()  # --keep-artifacts 1: pruned
    cold = json.loads((tmp_path / "cold.json").read_text())
    assert all(b["run_s"] > 0 and b["compile_s"] > 0 for b in cold["buckets"])
    second = jaxserve(*args, "--write", str(tmp_path / "warm.json"))
    assert "table: artifact" in second and "0 executables built" in second
    assert json.loads((tmp_path / "warm.json").read_text()) == cold  # shapes and timings

    async def serve_info():
        port = free_port()
        with served(port, "--model", model, "--cache-dir", str(cache), "--seqlens", "16,64", "--max-batch", "16"):
            async with aiohttp.ClientSession() as session:
                await wait_ready(session, f"http://127.0.0.1:{port}")
                async with session.get(f"http://127.0.0.1:{port}/info") as r:
                    info = await r.json()
                async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
                    metrics = await r.text()
                async with session.post(f"http://127.0.0.1:{port}/embed", json={"inputs": "the model"}) as r:
                    assert r.status == 200
                async with session.post(f"http://127.0.0.1:{port}/embed_all", json={"inputs": "the model"}) as r:
                    assert r.status == 200
                async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
                    after = await r.text()
        return info, metrics, after

    info, metrics, after = asyncio.run(serve_info())
    assert info["startup"]["table"]["source"] == "artifact" and info["startup"]["table"]["created"]
    assert info["buckets"]["buckets"] == cold["buckets"] and info["xla_compiles_total"] == 0
    assert "jaxserve_xla_compiles_total 0.0" in metrics and "jaxserve_xla_compiles_total 0.0" in after
    assert re.search(r'jaxserve_startup_seconds\{phase="deserialize"\} \d', metrics)
    assert 'phase="compile"' not in metrics


def test_api_keys_from_flags_and_file_with_their_classes(tmp_path):
    from jaxserve.cli import api_keys, build_parser

    keys = tmp_path / "keys.txt"
    keys.write_text("# indexing jobs\nidx-1=bulk\n\n  app-2  \nb64key==\n")
    args = build_parser().parse_args(["serve", "--api-key", "q=interactive", "--api-keys-file", str(keys),
                                      "--route-priority", "/embed=bulk"])
    assert api_keys(args) == (("q", "interactive"), ("idx-1", "bulk"), ("app-2", None), ("b64key==", None))
    assert args.route_priority == [("/embed", "bulk")]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--route-priority", "/embed=urgent"])


def test_keep_artifacts_on_serve_and_warmup(monkeypatch):
    """How many warm artifacts per model a save keeps: a whole number of at least 1, into the server's config."""
    from jaxserve.cli import build_parser, main
    from jaxserve.http import server
    from jaxserve.http.state import ServerConfig

    parser = build_parser()
    assert parser.parse_args(["serve"]).keep_artifacts == artifact.KEEP == ServerConfig().keep_artifacts
    assert parser.parse_args(["warmup", "--keep-artifacts", "1"]).keep_artifacts == 1
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--keep-artifacts", bad])
    with pytest.raises(ValueError, match="keep_artifacts must be at least 1"):
        ServerConfig(keep_artifacts=0)
    for bad in ("0", "-1", "nan", "inf", "soon"):  # a request timeout that could never expire, or at once
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--request-timeout-s", bad])
    assert parser.parse_args(["serve", "--request-timeout-s", "2.5"]).request_timeout_s == 2.5
    with pytest.raises(ValueError, match="request_timeout_s must be a finite"):
        ServerConfig(request_timeout_s=float("nan"))
    configs = []
    monkeypatch.setattr(server, "serve", lambda config, host, port: configs.append(config))
    assert main(["serve", "--keep-artifacts", "5"]) == 0 and configs[0].keep_artifacts == 5


@pytest.mark.parametrize("flags, message", [
    (["--port", "99999"], "argument --port: must be a port number, 0 to 65535"),
    (["--seqlens", "16,abc"], "argument --seqlens: must be positive whole numbers"),
    (["--seqlens", "0,16"], "argument --seqlens: must be positive whole numbers"),
    (["--max-queue-tokens", "0"], "jaxserve: max_queue_tokens must be positive, not 0"),
    (["--max-concurrent-requests", "0"], "jaxserve: max_concurrent must be at least 1, not 0"),
    (["--max-client-batch", "-1"], "jaxserve: max_client_batch must be at least 1, not -1"),
    (["--max-wait-ms", "nan"], "jaxserve: max_wait_ms must be a finite number of at least 0, not nan"),
    (["--api-keys-file", "/nonexistent/keys"], "jaxserve: --api-keys-file /nonexistent/keys: No such file"),
    (["--simulate-device", "0"], "jaxserve: a simulated device's tflops must be a finite number above 0"),
    (["--simulate-overhead-us", "5"], "they need --simulate-device"),
    (["--simulate-size", "768,3072,12"], "they need --simulate-device"),
    (["--api-key", ""], "jaxserve: an API key is empty"),
    (["--api-key", "=bulk"], "jaxserve: an API key is empty"),
])
def test_bad_serve_options_end_in_one_line_and_status_2_before_anything_starts(flags, message, monkeypatch, capsys):
    """A value no server can take is refused as the command line refuses the rest (`jaxserve: ...` or argparse's
    usage, status 2), never a traceback, a crash after loading, or a server on another port. An empty API key
    would let `Authorization: Bearer` with no key in."""
    from jaxserve.cli import main
    from jaxserve.http import server

    monkeypatch.setattr(server, "serve", lambda config, host, port: pytest.fail("the server was started"))
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    try:
        status = main(["serve", "--workers", "1", *flags])
    except SystemExit as exc:  # argparse's refusals
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2 and message in err.splitlines()[-1] and "Traceback" not in err, err


@pytest.mark.parametrize("field, bad", [
    ("max_concurrent", 0), ("max_concurrent", -3), ("max_client_batch", 0), ("max_input_chars", 0),
    ("max_body_bytes", 0), ("max_inflight_bytes", 0), ("max_inflight", 0), ("streams", 0), ("tokenizer_threads", 0),
    ("respond_threads", -1), ("workers", 0), ("engine_restarts", -1), ("interactive_max_sequences", -1),
    ("interactive_max_tokens", -1), ("max_wait_ms", -1.0), ("max_wait_ms", math.inf), ("host_dispatch_us", math.nan),
    ("bulk_dispatch_ms", -5.0), ("bulk_dispatch_ms", math.nan),
])
def test_a_limit_no_server_can_serve_with_is_refused_by_the_config(field, bad):
    """--max-concurrent-requests 0 started a server that answered every request with 429, for ever; the config
    refuses each numeric limit that would leave it answering nothing (or, max_inflight 0, running no batch)."""
    from jaxserve.http.state import ServerConfig

    with pytest.raises(ValueError, match=f"^{field} must be"):
        ServerConfig(**{field: bad})
    ServerConfig(interactive_max_sequences=0, interactive_max_tokens=0, engine_restarts=0, max_wait_ms=0.0,
                 bulk_dispatch_ms=math.inf)  # every request bulk, no restarts, no window, bulk never cut: choices


def test_empty_api_key_refused_in_a_keys_file_and_by_the_config(tmp_path, monkeypatch, capsys):
    from jaxserve.cli import main
    from jaxserve.http import server
    from jaxserve.http.state import ServerConfig

    monkeypatch.setattr(server, "serve", lambda config, host, port: pytest.fail("the server was started"))
    keys = tmp_path / "keys.txt"
    keys.write_text("good-key\n=bulk\n")
    assert main(["serve", "--workers", "1", "--api-keys-file", str(keys)]) == 2
    assert "an API key is empty" in capsys.readouterr().err
    with pytest.raises(ValueError, match="an API key is empty"):
        ServerConfig(api_keys=(("ok", None), (" ", "bulk")))
    assert ServerConfig(api_key="").keys == ()  # an unset JAXSERVE_API_KEY: no key, not an empty one


def test_buckets_has_no_throughput_knee_it_could_not_apply():
    """`jaxserve buckets` prints an untimed table, and the knee needs timings: the flag is not offered there."""
    from jaxserve.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["buckets", "--throughput-knee", "off"])
    assert build_parser().parse_args(["warmup", "--throughput-knee", "off"]).throughput_knee == "off"
