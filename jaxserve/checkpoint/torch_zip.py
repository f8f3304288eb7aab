"""A restricted reader of PyTorch's zip pickle format, for state dicts only, without torch.

`torch.save` (since 1.6) writes a zip archive: `<name>/data.pkl` (a pickle whose tensors refer to storages by a
persistent id), `<name>/data/<key>` (each storage's raw bytes), `<name>/byteorder`. Unpickling it with pickle's
default rules runs whatever the file names, so this reader resolves only the few globals a state dict needs
(an OrderedDict, the tensor and parameter rebuild functions, the storage types), each to a function of its own;
any other global is refused with the name it asked for, before anything is called. What comes out is a dict of
name -> numpy array (bfloat16 and float8 through ml_dtypes), storage offset, shape and strides honoured; read
from the storage's bytes, never shared with the archive.

BGE-M3's heads (`colbert_linear.pt`, `sparse_linear.pt`) and `pytorch_model.bin` checkpoints are such files.
"""

from __future__ import annotations

import io
import math
import pickle
import sys
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.errors import CheckpointError

STORAGE_DTYPES = {  # torch's typed storage names -> numpy dtypes
    "FloatStorage": np.float32,
    "DoubleStorage": np.float64,
    "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16,
    "Float8_e4m3fnStorage": ml_dtypes.float8_e4m3fn,
    "Float8_e5m2Storage": ml_dtypes.float8_e5m2,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class _StorageType:
    """A storage type named by the pickle (`torch.FloatStorage`): only its dtype."""

    __slots__ = ("dtype", "name")

    def __init__(self, name: str):
        self.name, self.dtype = name, np.dtype(STORAGE_DTYPES[name])

    def __setstate__(self, state):
        raise CheckpointError("the pickle tries to change a storage type")


class _Storage:
    """One storage: its elements as a 1-D array of its dtype."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def __setstate__(self, state):
        raise CheckpointError("the pickle tries to change a storage")


class _StateDict(dict):
    """`collections.OrderedDict` as a state dict uses it; the state torch attaches (`_metadata`) is dropped."""

    def __setstate__(self, state):
        pass


class _Rebuild:
    """A rebuild function a pickle may call; nothing else about it can be changed by the pickle."""

    __slots__ = ("fn", "name")

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn

    def __call__(self, *args):
        return self.fn(*args)

    def __setstate__(self, state):
        raise CheckpointError(f"the pickle tries to change {self.name}")


def _ints(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(v) is int and v >= 0 for v in value):
        raise CheckpointError(f"a tensor's {what} is {value!r}, not a tuple of non-negative ints")
    return value


def _rebuild_tensor(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None) -> np.ndarray:
    """torch._utils._rebuild_tensor_v2: a copy of the storage's elements at `offset`, of `size` and `stride`."""
    if not isinstance(storage, _Storage) or type(offset) is not int or offset < 0:
        raise CheckpointError("a tensor in the pickle does not refer to a storage of the archive")
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if len(size) != len(stride):
        raise CheckpointError(f"a tensor's size {size} and stride {stride} differ in rank")
    flat = storage.array
    if 0 in size:
        return np.zeros(size, flat.dtype)
    if math.prod(size) > len(flat) - offset:  # a view wider than its storage (a stride 0: an expanded tensor) would
        raise CheckpointError(f"a tensor of size {size} (stride {stride}) has more elements than its storage's "
                              f"{len(flat) - offset} from offset {offset}: a state dict's tensors are not expanded "
                              "views")  # be copied whole: a few bytes of file, any size of memory
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= len(flat):
        raise CheckpointError(f"a tensor (offset {offset}, size {size}, stride {stride}) reaches past its "
                              f"storage of {len(flat)} elements")
    view = np.lib.stride_tricks.as_strided(flat[offset:], size, tuple(s * flat.itemsize for s in stride),
                                           writeable=False)
    return np.array(view, order="C")


def _rebuild_parameter(data, requires_grad=False, hooks=None, state=None) -> np.ndarray:
    """torch._utils._rebuild_parameter(_with_state): an nn.Parameter is its tensor."""
    if not isinstance(data, np.ndarray):
        raise CheckpointError("a parameter in the pickle holds no tensor")
    return data


ALLOWED = {  # (module, name) -> what the pickle gets for it
    ("collections", "OrderedDict"): _StateDict,
    ("torch._utils", "_rebuild_tensor_v2"): _Rebuild("torch._utils._rebuild_tensor_v2", _rebuild_tensor),
    ("torch._utils", "_rebuild_parameter"): _Rebuild("torch._utils._rebuild_parameter", _rebuild_parameter),
    ("torch._utils", "_rebuild_parameter_with_state"): _Rebuild("torch._utils._rebuild_parameter_with_state",
                                                                _rebuild_parameter),
    **{("torch", name): _StorageType(name) for name in STORAGE_DTYPES},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, byteorder: str, source: Path):
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix, self.byteorder, self.source = archive, prefix, byteorder, source
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str):
        found = ALLOWED.get((module, name))
        if found is None:
            raise CheckpointError(f"{self.source} names {module}.{name}, which a state dict of tensors does not "
                                  "need; jaxserve reads state dicts only and did not load it")
        return found

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and type(pid[4]) is int):
            raise CheckpointError(f"{self.source}: the pickle refers to {str(pid)[:80]!r}, not to a storage")
        _, kind, key, _location, numel = pid
        if key not in self.storages:
            name = f"{self.prefix}data/{key}"
            try:
                info = self.archive.getinfo(name)
            except KeyError:
                raise CheckpointError(f"{self.source} has no storage {name}") from None
            if info.compress_type != zipfile.ZIP_STORED:  # torch.save stores them; inflating is a bomb's way in
                raise CheckpointError(f"{self.source}: storage {name} is compressed, which torch.save never does")
            raw = self.archive.read(info)
            if len(raw) < numel * kind.dtype.itemsize:
                raise CheckpointError(f"{self.source}: storage {key} holds {len(raw)} bytes, not the "
                                      f"{numel} x {kind.dtype.itemsize} its tensor says")
            array = np.frombuffer(raw, kind.dtype, numel)
            self.storages[key] = _Storage(array if self.byteorder == sys.byteorder else array.byteswap())
        return self.storages[key]


def read_state_dict(path: Path) -> dict[str, np.ndarray]:
    """A file `torch.save` wrote of a state dict -> {name: numpy array}; CheckpointError for anything else (a
    pickled module or any object, a legacy non-zip save, a broken archive), naming what was found."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is not a zip archive: only torch.save's format since PyTorch 1.6 is read "
                              "(re-save it with torch.save, or as safetensors)")
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("data.pkl") and n.count("/") == 1]
            if len(pickles) != 1:
                raise CheckpointError(f"{path} is a zip archive without one <name>/data.pkl: not a torch.save file")
            prefix = pickles[0][: -len("data.pkl")]
            names = set(archive.namelist())
            byteorder = (archive.read(prefix + "byteorder").decode().strip()
                         if prefix + "byteorder" in names else "little")
            if byteorder not in ("little", "big"):
                raise CheckpointError(f"{path}: byteorder {byteorder[:20]!r} is neither little nor big")
            result = _Unpickler(archive.read(pickles[0]), archive, prefix, byteorder, path).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a truncated archive, a malformed pickle, a rebuild called with the wrong arguments
        raise CheckpointError(f"cannot read {path} as a torch state dict: {type(exc).__name__}: {exc}") from None
    if not isinstance(result, dict):
        raise CheckpointError(f"{path} holds a {type(result).__name__}, not a state dict")
    bad = [k for k, v in result.items() if not isinstance(k, str) or not isinstance(v, np.ndarray)]
    if bad:
        kind = type(result[bad[0]]).__name__
        raise CheckpointError(f"{path}: {bad[0]!r} holds a value of type {kind}, not a tensor; "
                              "jaxserve reads state dicts of tensors only")
    return dict(result)
