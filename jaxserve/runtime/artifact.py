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
`--attention` choice, a SPLADE head's cap and block, the table options, the outputs, the jax, jaxlib and flax
versions, the backend, device kinds and count, `XLA_FLAGS` and `LIBTPU_INIT_ARGS`, the JAX flags JAX
itself keys a trace or a compile by, and jaxserve's own source.
Weights enter by their safetensors headers (names, dtypes, shapes): an
executable takes the weights as arguments, so their values change neither it
nor its timings, and hashing gigabytes of weights would cost the seconds this
saves.

The file is the magic line, a JSON header line (the key, when it was made, the
payload's size and SHA-256), then the payload, a pickle. Like any pickle (and
as `serialize_executable` warns) the payload runs code when loaded, so nothing
is read from a file, nor a directory, that anyone but this server's user (or
root) could have written (`untrusted`), and the header alone decides whether a
file is the one wanted: a stale artifact is never unpickled, nor read past its
header. A missing, stale, untrusted or corrupt artifact is never used, and
`load` says why; nothing is installed from a load that fails part way.
Files are written to a temporary name and renamed into place, so two servers
sharing a cache directory each see a whole file or none; after a save, each
model keeps its newest `KEEP` artifacts (`prune`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import hashlib
import json
import os
import pickle
import stat
import struct
import tempfile
import time
from pathlib import Path

from jaxserve.runtime import host
from jaxserve.runtime.buckets import BucketTable
from jaxserve.runtime.derivation import TableOptions

FORMAT = 4  # 2: attention per executable; 3: pooled outputs in slot chunks; 4: the JSON header before the payload
MAGIC = b"JAXSERVE-WARM\n"
SUFFIX = ".jaxwarm"
KEEP = 3  # artifacts kept per model after a save (--keep-artifacts): the one just made and the last ones before it
# a temporary file (a save under way) untouched this long is a dead save's: a live one writes it within seconds
STALE_TEMPORARY_S = 3600
HEADER_BYTES = 2**20  # the longest header line read (a key is a few kilobytes)
WHOLE_FILE_BYTES = 64 * 2**20  # model files hashed whole up to this size (configs, tokenizers, small heads)
# JAX flags its compile options read (besides those in its trace context, `jax_flags`)
COMPILE_FLAGS = ("jax_optimization_level", "jax_memory_fitting_level", "jax_compiler_enable_remat_pass",
                 "jax_disable_most_optimizations", "jax_use_shardy_partitioner", "jax_default_prng_impl",
                 "jax_default_matmul_precision", "jax_enable_x64", "jax_numpy_rank_promotion")
ENV_FLAGS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")  # what XLA reads from the environment when it compiles
TRUST_DOC = "docs/operations.md#the-warm-artifact-cache-ownership-and-pruning"


class Skipped(Exception):
    """Why no artifact was used (logged; the engine is then built afresh)."""


class Refused(Skipped):
    """An artifact, or its directory, that another user could have written: never read (logged as a warning,
    since the cache directory needs fixing)."""


@dataclasses.dataclass(frozen=True)
class Loaded:
    path: Path
    created: str  # ISO 8601, UTC
    tables: dict[str, BucketTable]


def model_digest(path: Path) -> str:
    """The checkpoint's files, as the loader reaches them (`modules.inside`: through links, not hidden ones): small
    ones whole, safetensors by their header, other large files by size, each under its name; a linked file by what
    it links to (a hub snapshot's blob), a linked folder by the files it holds (a model's variant linking another's
    module folders): so retargeting a link, or editing what it reaches, changes the digest."""
    root = Path(path)
    h = hashlib.sha256()
    entries, seen = [], set()
    for folder, dirs, names in os.walk(root, followlinks=True):
        if os.path.realpath(folder) in seen:  # a link back to a folder walked already
            dirs[:] = []
            continue
        seen.add(os.path.realpath(folder))
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        entries += [Path(folder) / name for name in names if not name.startswith(".")]
    for f in sorted(entries):
        if not f.is_file():
            continue
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
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


def jax_flags() -> dict[str, str]:
    """The JAX flags that change a traced program or its compile: those JAX's own trace cache is keyed by (its
    trace context, whatever this jax version holds there) and those its compile options read. Set from
    `JAX_*` environment variables or `jax.config.update`, they are read here as they are now."""
    import jax
    from jax._src import config

    names = set(COMPILE_FLAGS) | set(getattr(config, "trace_context_names", tuple)())
    return {name: str(jax.config.values[name]) for name in sorted(names) if name in jax.config.values}


def key_fields(encoder, spec: BucketTable | TableOptions, outputs: tuple[str, ...]) -> dict:
    """Everything that changes the executables or the table, as a JSON-able dict."""
    import flax  # its nn.Dense, nn.Embed and nn.LayerNorm are traced into every executable
    import jax  # here, not at the top: a front-end process reads this module's names without JAX
    import jaxlib

    devices = encoder.engine.device_list
    first = devices[0]
    stats = first.memory_stats() if first.platform != "cpu" and hasattr(first, "memory_stats") else None
    splade = getattr(encoder, "splade", None)
    return {
        "format": FORMAT,
        "model": model_digest(encoder.path),
        "dtype": encoder.dtype,
        "attention": encoder.attention,
        # a SPLADE head's output width (its cap, from JAXSERVE_SPARSE_CAP) and vocabulary block
        "sparse": dataclasses.asdict(splade) if splade is not None else None,
        # the head: the same files are a reranker by one name and an embedder by another (Qwen3-Reranker's)
        "head": _as_json(dataclasses.asdict(encoder.head)) if getattr(encoder, "head", None) is not None else None,
        "table": ({"file": hashlib.sha256(json.dumps(spec.to_json(), sort_keys=True).encode()).hexdigest()}
                  if isinstance(spec, BucketTable) else dataclasses.asdict(spec)),
        "outputs": list(outputs),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "backend": first.platform,
        "platform_version": getattr(first.client, "platform_version", ""),
        "devices": [d.device_kind for d in devices],
        # an accelerator's pool is fixed per process start; a CPU's free RAM is not, and its tables are capped by tokens
        "device_memory": (stats or {}).get("bytes_limit"),
        "env": {name: os.environ.get(name, "") for name in ENV_FLAGS},
        "jax_flags": jax_flags(),
        "jaxserve": source_digest(),
    }


def digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def path_for(directory: Path, encoder, fields: dict) -> Path:
    return Path(directory) / f"{_slug(encoder)}-{digest(fields)[:24]}{SUFFIX}"


def _slug(encoder) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(encoder.path).name) or "model"


def _uid() -> int | None:
    """This server's user (None where the platform has no POSIX owners: nothing is checked)."""
    return os.geteuid() if hasattr(os, "geteuid") else None


def untrusted(st: os.stat_result, uid: int | None, directory: bool = False) -> str | None:
    """Why a file (or the directory holding it) may not be loaded, or None: only this server's user, or root,
    may be able to write it. A directory others may write to is trusted only with the sticky bit (as /tmp):
    then no one else can replace or rename this user's files in it."""
    if uid is None:
        return None
    kind = "directory" if directory else "file"
    if directory != stat.S_ISDIR(st.st_mode) or not (directory or stat.S_ISREG(st.st_mode)):
        return "not a directory" if directory else "not a regular file"
    if st.st_uid not in (uid, 0):
        return f"the {kind} is owned by uid {st.st_uid}, not by this server's user (uid {uid}) or root"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022 and not (directory and mode & stat.S_ISVTX):
        sticky = " without the sticky bit" if directory else ""
        return f"the {kind} is group- or world-writable (mode {mode:04o}){sticky}"
    return None


def _check_directory(directory: Path) -> None:
    """`Skipped` if the directory is missing, `Refused` if another user could have put files in it."""
    try:
        st = os.lstat(directory)  # the directory itself, not what a symlink in its place names
    except FileNotFoundError:
        raise Skipped(f"no warm artifact in {directory} yet") from None
    except OSError as exc:
        raise Skipped(f"{directory}: unreadable ({exc})") from exc
    why = untrusted(st, _uid(), directory=True)
    if why:
        raise Refused(f"{directory} refused: {why}; no artifact is loaded from it or saved in it ({TRUST_DOC})")


def _open(path: Path):
    """An artifact opened for reading, `Refused` if another user could have written it: checked on the file
    opened, not on whatever the name points to a moment later. Non-blocking, so a FIFO in its place cannot hang
    a start (it is refused: not a regular file)."""
    try:  # not through a symlink: the file it names may be one this user owns but another wrote (a download)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        if os.path.islink(path):
            raise Refused(f"{Path(path).name} refused: a symbolic link, which an artifact never is ({TRUST_DOC})") \
                from exc
        raise
    try:
        st = os.fstat(fd)
        why = untrusted(st, _uid()) or (f"the file has {st.st_nlink} names (hard links), an artifact one"
                                        if st.st_nlink != 1 else None)
        if why:
            raise Refused(f"{Path(path).name} refused: {why} ({TRUST_DOC})")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def save(directory: Path, encoder, fields: dict) -> Path:
    """Write the engine's served tables and their executables; atomic (a temporary file renamed into place).
    A directory this server creates is made 0755 (whatever the umask), one it may not trust is refused."""
    from jax.experimental import serialize_executable

    engine = encoder.engine
    payload = {
        "tables": {output: engine.tables[output].to_json() for output in fields["outputs"]},
        "executables": {output: {shape: serialize_executable.serialize(exe)
                                 for shape, exe in engine.executables(output).items()}
                        for output in fields["outputs"]},
        "attention": {output: {shape: tuple(engine.attention_of(*shape, output) or ())
                               for shape in engine.executables(output)}
                      for output in fields["outputs"]},
    }
    body = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    header = {"format": FORMAT, "key": fields, "model_path": _model_path(encoder),
              "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    target = path_for(directory, encoder, fields)
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    try:
        target.parent.mkdir()
        os.chmod(target.parent, 0o755)  # a umask of 002 would leave it group-writable, and then refused
    except FileExistsError:
        pass
    _check_directory(target.parent)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    try:
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep an image's artifact from a server run as another user
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _model_path(encoder) -> str:
    """The checkpoint directory, resolved: what "this model's artifacts" means to `prune` (not in the key, so
    the same files elsewhere still find their artifact)."""
    return str(Path(encoder.path).resolve())


def prune(directory: Path, encoder, keep: int = KEEP, protect: Path | None = None) -> list[Path]:
    """Delete this model's artifacts but the newest `keep`, `protect` (the one just saved) always among those
    kept; the ones deleted. This model's: those whose header names its checkpoint directory, so another
    checkpoint of the same directory name keeps its own; a file of this model's name whose header this version
    cannot read (another format, older or newer: a rolling upgrade's) counts among them, its model unknown. One
    that vanishes meanwhile, cannot be read, is refused (`untrusted`: not this server's to judge) or cannot be
    deleted is passed over. The model's temporary files (`save`'s) untouched for `STALE_TEMPORARY_S` are those
    of a save that died part way, and are deleted too (a live one's, another server's saving now, are fresh)."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, not {keep}")
    mine, kept, removed = _model_path(encoder), int(protect is not None), _stale_temporaries(directory, encoder)
    for path in _listing(directory, encoder):
        if path == protect:
            continue
        try:
            with _open(path) as f:
                header = _header_line(f, path)
        except (OSError, Refused):
            continue
        except Skipped:  # no header line: an older format's, or corrupt
            header = None
        if isinstance(header, dict) and header.get("model_path", mine) != mine:
            continue
        if kept < keep:
            kept += 1
            continue
        try:
            path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed


def _stale_temporaries(directory: Path, encoder) -> list[Path]:
    """Delete this model's temporary files left by a save that died (untouched for `STALE_TEMPORARY_S`, this
    server's user's); the ones deleted."""
    prefix, removed = _slug(encoder) + "-", []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        if not (entry.name.startswith(prefix) and SUFFIX + "." in entry.name and entry.name.endswith(".tmp")):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if untrusted(st, _uid()) or time.time() - st.st_mtime < STALE_TEMPORARY_S:
                continue
            os.unlink(entry.path)
        except OSError:  # gone meanwhile (its save finished), or not this user's to delete
            continue
        removed.append(Path(entry.path))
    return removed


def _listing(directory: Path, encoder) -> list[Path]:
    """This model's artifacts in `directory`, newest first; a file gone between listing and stat is left out."""
    prefix = _slug(encoder) + "-"
    found = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        if not (entry.name.startswith(prefix) and entry.name.endswith(SUFFIX)):
            continue
        try:
            found.append((entry.stat().st_mtime_ns, entry.name))
        except OSError:  # deleted (or a dangling link) since it was listed
            continue
    return [Path(directory) / name for _, name in sorted(found, reverse=True)]


def load(directory: Path, encoder, fields: dict, on_progress=lambda done, total: None) -> Loaded:
    """The artifact matching `fields` read and checked (`read`), then installed into the encoder's engine
    (`install`); `Skipped` says why when there is none to use."""
    path, header, payload = read(directory, encoder, fields)
    return install(encoder.engine, path, header, payload, fields["outputs"], on_progress)


def read(directory: Path, encoder, fields: dict) -> tuple[Path, dict, dict]:
    """The path, header and payload of the artifact whose key is `fields`; `Skipped` if there is none, or if it
    or its directory is untrusted, stale or corrupt (in that order: nothing is unpickled before all pass)."""
    _check_directory(Path(directory))
    path = path_for(directory, encoder, fields)
    try:
        f = _open(path)
    except FileNotFoundError:
        raise Skipped(_why_missing(directory, encoder, fields)) from None
    except OSError as exc:
        raise Skipped(f"{path.name}: unreadable ({exc})") from exc
    with f:
        header = _header(f, path)
        if header["key"] != _as_json(fields):
            raise Skipped(f"{path.name}: its key differs in {', '.join(_differ(header['key'], fields))}")
        try:
            left = os.fstat(f.fileno()).st_size - f.tell()
            if header["bytes"] != left:  # before reading: a corrupt size must not allocate it
                raise Skipped(f"{path.name}: corrupt (its header says {header['bytes']} bytes, {left} follow it; "
                              "truncated or overwritten?)")
            body = f.read(left)
        except OSError as exc:
            raise Skipped(f"{path.name}: unreadable ({exc})") from exc
    if len(body) != header["bytes"] or hashlib.sha256(body).hexdigest() != header["sha256"]:
        raise Skipped(f"{path.name}: corrupt (its checksum does not match; truncated or overwritten?)")
    try:
        return path, header, pickle.loads(body)
    except Exception as exc:
        raise Skipped(f"{path.name}: unreadable payload ({type(exc).__name__})") from exc


def _header(f, path: Path) -> dict:
    """The header of an open artifact, its file position left at the payload; `Skipped` if it has none."""
    header = _header_line(f, path)
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        made = header.get("format") if isinstance(header, dict) else None
        raise Skipped(f"{path.name}: stale (made by another jaxserve version: format {made or 'before 4'}, "
                      f"not {FORMAT})")
    if not (isinstance(header.get("key"), dict) and isinstance(header.get("bytes"), int)
            and isinstance(header.get("sha256"), str)):
        raise Skipped(f"{path.name}: corrupt (its header is incomplete)")
    return header


def _header_line(f, path: Path):
    """The JSON header line of an open artifact of any format, parsed (None if it is not JSON); `Skipped` if
    the file has no header line."""
    try:
        magic = f.readline(len(MAGIC))
        line = f.readline(HEADER_BYTES)
    except OSError as exc:
        raise Skipped(f"{path.name}: unreadable ({exc})") from exc
    if magic != MAGIC:
        raise Skipped(f"{path.name}: not a jaxserve warm artifact")
    if not line.endswith(b"\n"):
        raise Skipped(f"{path.name}: corrupt (its header is cut short)")
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def install(engine, path: Path, header: dict, payload: dict, outputs: tuple[str, ...],
            on_progress=lambda done, total: None) -> Loaded:
    """Deserialize a read artifact's executables (in parallel) and serve its tables on `engine`: all of them, or
    (`Skipped`) none, so a failed load leaves the engine as it was and a cold start compiles every bucket."""
    from jax.experimental import serialize_executable

    from jaxserve.runtime.engine import Attention

    devices = engine.device_list
    attention = payload.get("attention", {})

    def deserialize(job):
        blob, in_tree, out_tree = job[2]
        return serialize_executable.deserialize_and_load(blob, in_tree, out_tree, backend=devices[0].client,
                                                         execution_devices=devices)

    try:
        jobs = [(output, shape, serialized) for output in outputs
                for shape, serialized in payload["executables"][output].items()]
        tables = {output: BucketTable.from_json(payload["tables"][output]) for output in outputs}
        for output, table in tables.items():
            missing = {(b.batch, b.seqlen, b.slots) for b in table.buckets} - payload["executables"][output].keys()
            if missing:
                raise KeyError(f"no executable for {output} buckets {sorted(missing)}")
        loaded = []
        # loading releases the GIL for most of its time: one per core at once; after a failure, no more
        pool = concurrent.futures.ThreadPoolExecutor(host.usable_cores())
        try:
            for exe in pool.map(deserialize, jobs):
                loaded.append(exe)
                on_progress(len(loaded), len(jobs))
        finally:
            pool.shutdown(cancel_futures=True)
    except Exception as exc:
        raise Skipped(f"{path.name}: an executable did not load ({type(exc).__name__}: {exc})") from exc
    for (output, (batch, seqlen, slots), _), exe in zip(jobs, loaded):
        record = attention.get(output, {}).get((batch, seqlen, slots))
        engine.add_executable(batch, seqlen, slots, output, exe,
                              Attention(record[0], tuple(record[1])) if record else None)
    for output, table in tables.items():
        engine.install(table, output)
    return Loaded(path, header["created"], tables)


def _why_missing(directory: Path, encoder, fields: dict) -> str:
    """No artifact for this key: name the newest of this model's others and what differs, from its header alone
    (none is unpickled, nor read past its header); a file gone meanwhile is passed over."""
    for path in _listing(directory, encoder):
        try:
            with _open(path) as f:
                key = _header(f, path)["key"]
        except FileNotFoundError:
            continue
        except (OSError, Skipped) as why:
            return f"none for this key; the newest other one was skipped: {why}"
        return f"none for this key; the newest other one ({path.name}) differs in {', '.join(_differ(key, fields))}"
    return f"no warm artifact in {directory} for this model yet"


def _as_json(fields: dict) -> dict:
    """A key as its header holds it (tuples become lists)."""
    return json.loads(json.dumps(fields))


def _differ(old: dict, new: dict) -> list[str]:
    """The key's fields that differ, a dict field's own fields named one level down (`jax_flags (jax_enable_x64
    (False -> True))`)."""
    new = _as_json(new)
    def change(name, a, b):
        short = lambda v: v[:12] if isinstance(v, str) and len(v) == 64 else v
        if isinstance(a, dict) and isinstance(b, dict):
            inner = [f"{k} ({short(a.get(k))} -> {short(b.get(k))})" if not isinstance(a.get(k), dict) else k
                     for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            return f"{name} ({', '.join(inner)})"
        return name if isinstance(a, dict) or isinstance(b, dict) else f"{name} ({short(a)} -> {short(b)})"

    out = [change(name, old.get(name), new.get(name)) for name in sorted(set(old) | set(new))
           if old.get(name) != new.get(name)]
    return out or ["nothing (a digest collision?)"]
