"""The warm artifact: a warmed engine saved to disk, so that a restart is ready without tracing or compiling.

It holds each output's timed bucket table (the knee decided when it was made,
so every start from it serves the same shapes and timings) and every bucket's
executable, serialized with `jax.experimental.serialize_executable`, beside the
attention implementation it was compiled with and why earlier candidates fell
back (`Engine.attention_of`), so a warm start reports what a cold one did. JAX's
persistent compilation cache cannot do this: it is keyed by the unoptimised
program, so every start still traces and lowers every bucket.

An artifact is found by its key, a digest of everything that changes the
executables or the table (`key_fields`): the model's files, the dtype, the
`--attention` choice, the table options, the outputs, the jax and jaxlib versions, the backend, device
kinds and count, XLA flags and JAX's numeric flags, and jaxserve's own source.
Weights enter by their safetensors headers (names, dtypes, shapes): an
executable takes the weights as arguments, so their values change neither it
nor its timings, and hashing gigabytes of weights would cost the seconds this
saves. The file is checked whole (a SHA-256 of its payload) before any of it
is used; a missing, stale or corrupt artifact is never used, and `load` says
why. Files are written to a temporary name and renamed into place, so two
servers sharing a cache directory each see a whole file or none.

Like any pickle (and as `serialize_executable` warns), an artifact runs code
when loaded: the cache directory must be as trusted as the code itself.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import hashlib
import json
import os
import pickle
import struct
import tempfile
from pathlib import Path

import jax

from jaxserve.runtime import host
from jaxserve.runtime.buckets import BucketTable
from jaxserve.runtime.derivation import TableOptions
from jaxserve.runtime.engine import Attention

FORMAT = 3  # 2: each executable's attention implementation beside it; 3: pooled outputs in slot chunks
MAGIC = b"JAXSERVE-WARM\n"
SUFFIX = ".jaxwarm"
WHOLE_FILE_BYTES = 64 * 2**20  # model files hashed whole up to this size (configs, tokenizers, small heads)
# JAX flags that change what a traced program computes
JAX_FLAGS = ("jax_default_matmul_precision", "jax_enable_x64", "jax_numpy_rank_promotion", "jax_default_prng_impl")


class Skipped(Exception):
    """Why no artifact was used (logged; the engine is then built afresh)."""


@dataclasses.dataclass(frozen=True)
class Loaded:
    path: Path
    created: str  # ISO 8601, UTC
    tables: dict[str, BucketTable]


def model_digest(path: Path) -> str:
    """The checkpoint's files: small ones whole, safetensors by their header, other large files by size."""
    h = hashlib.sha256()
    files = sorted(p for p in Path(path).rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    for f in files:
        h.update(f.relative_to(path).as_posix().encode() + b"\0")
        size = f.stat().st_size
        if f.suffix == ".safetensors":
            h.update(_safetensors_header(f))
        elif size > WHOLE_FILE_BYTES:
            h.update(f"size {size}".encode())
        else:
            h.update(f.read_bytes())
    return h.hexdigest()


def _safetensors_header(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(8)
        (n,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
        return head + f.read(min(n, WHOLE_FILE_BYTES))


def source_digest() -> str:
    """jaxserve's own Python source, every subpackage's: the model code is traced into every executable."""
    root = Path(__file__).resolve().parent.parent  # the jaxserve package (this module is in runtime/)
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def key_fields(encoder, spec: BucketTable | TableOptions, outputs: tuple[str, ...]) -> dict:
    """Everything that changes the executables or the table, as a JSON-able dict."""
    import jaxlib

    devices = encoder.engine.device_list
    first = devices[0]
    stats = first.memory_stats() if first.platform != "cpu" and hasattr(first, "memory_stats") else None
    return {
        "format": FORMAT,
        "model": model_digest(encoder.path),
        "dtype": encoder.dtype,
        "attention": encoder.attention,
        "table": ({"file": hashlib.sha256(json.dumps(spec.to_json(), sort_keys=True).encode()).hexdigest()}
                  if isinstance(spec, BucketTable) else dataclasses.asdict(spec)),
        "outputs": list(outputs),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": first.platform,
        "platform_version": getattr(first.client, "platform_version", ""),
        "devices": [d.device_kind for d in devices],
        # an accelerator's pool is fixed per process start; a CPU's free RAM is not, and its tables are capped by tokens
        "device_memory": (stats or {}).get("bytes_limit"),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax_flags": {name: str(getattr(jax.config, name, None)) for name in JAX_FLAGS},
        "jaxserve": source_digest(),
    }


def digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def path_for(directory: Path, encoder, fields: dict) -> Path:
    return Path(directory) / f"{_slug(encoder)}-{digest(fields)[:24]}{SUFFIX}"


def _slug(encoder) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(encoder.path).name) or "model"


def save(directory: Path, encoder, fields: dict) -> Path:
    """Write the engine's served tables and their executables; atomic (a temporary file renamed into place)."""
    from jax.experimental import serialize_executable

    engine = encoder.engine
    payload = {
        "key": fields,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tables": {output: engine.tables[output].to_json() for output in fields["outputs"]},
        "executables": {output: {shape: serialize_executable.serialize(exe)
                                 for shape, exe in engine.executables(output).items()}
                        for output in fields["outputs"]},
        "attention": {output: {shape: tuple(engine.attention_of(*shape, output) or ())
                               for shape in engine.executables(output)}
                      for output in fields["outputs"]},
    }
    body = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    target = path_for(directory, encoder, fields)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    try:
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep an image's artifact from a server run as another user
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def load(directory: Path, encoder, fields: dict, on_progress=lambda done, total: None) -> Loaded:
    """The artifact matching `fields` read and checked (`read`), then installed into the encoder's engine
    (`install`); `Skipped` says why when there is none to use."""
    path, payload = read(directory, encoder, fields)
    return install(encoder.engine, path, payload, fields["outputs"], on_progress)


def read(directory: Path, encoder, fields: dict) -> tuple[Path, dict]:
    """The path and payload of the artifact whose key is `fields`, its checksum checked; `Skipped` if none."""
    path = path_for(directory, encoder, fields)
    if not path.exists():
        raise Skipped(_why_missing(directory, encoder, fields))
    payload = _read(path)
    if payload.get("key") != fields:
        raise Skipped(f"{path.name}: its key differs in {', '.join(_differ(payload.get('key') or {}, fields))}")
    return path, payload


def install(engine, path: Path, payload: dict, outputs: tuple[str, ...],
            on_progress=lambda done, total: None) -> Loaded:
    """Deserialize a read artifact's executables (in parallel) and serve its tables on `engine`."""
    from jax.experimental import serialize_executable

    devices = engine.device_list
    jobs = [(output, shape, serialized) for output in outputs
            for shape, serialized in payload["executables"][output].items()]
    done = 0

    def deserialize(job):
        blob, in_tree, out_tree = job[2]
        return serialize_executable.deserialize_and_load(blob, in_tree, out_tree, backend=devices[0].client,
                                                         execution_devices=devices)

    attention = payload.get("attention", {})
    try:
        # loading releases the GIL for most of its time: one per core at once
        with concurrent.futures.ThreadPoolExecutor(host.usable_cores()) as pool:
            for (output, (batch, seqlen, slots), _), exe in zip(jobs, pool.map(deserialize, jobs)):
                record = attention.get(output, {}).get((batch, seqlen, slots))
                engine.add_executable(batch, seqlen, slots, output, exe,
                                      Attention(record[0], tuple(record[1])) if record else None)
                done += 1
                on_progress(done, len(jobs))
        tables = {output: BucketTable.from_json(payload["tables"][output]) for output in outputs}
    except Exception as exc:
        raise Skipped(f"{path.name}: an executable did not load ({type(exc).__name__}: {exc})") from exc
    for output, table in tables.items():
        engine.install(table, output)
    return Loaded(path, payload["created"], tables)


def _read(path: Path) -> dict:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise Skipped(f"{path.name}: unreadable ({exc})") from exc
    head, _, rest = raw.partition(b"\n")
    checksum, _, body = rest.partition(b"\n")
    if head + b"\n" != MAGIC:
        raise Skipped(f"{path.name}: not a jaxserve warm artifact")
    if hashlib.sha256(body).hexdigest().encode() != checksum:
        raise Skipped(f"{path.name}: corrupt (its checksum does not match; truncated or overwritten?)")
    try:
        return pickle.loads(body)
    except Exception as exc:
        raise Skipped(f"{path.name}: unreadable payload ({type(exc).__name__})") from exc


def _why_missing(directory: Path, encoder, fields: dict) -> str:
    """No artifact for this key: name the newest of this model's others and what differs, if there is one."""
    others = sorted(Path(directory).glob(f"{_slug(encoder)}-*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
    if not others:
        return f"no warm artifact in {directory} for this model yet"
    try:
        key = _read(others[-1]).get("key") or {}
    except Skipped as why:
        return f"none for this key; the newest other one was skipped: {why}"
    return f"none for this key; the newest other one ({others[-1].name}) differs in {', '.join(_differ(key, fields))}"


def _differ(old: dict, new: dict) -> list[str]:
    out = []
    for name in sorted(set(old) | set(new)):
        if old.get(name) != new.get(name):
            a, b = old.get(name), new.get(name)
            short = lambda v: v[:12] if isinstance(v, str) and len(v) == 64 else v
            out.append(f"{name} ({short(a)} -> {short(b)})" if not isinstance(a, dict) else name)
    return out or ["nothing (a digest collision?)"]
