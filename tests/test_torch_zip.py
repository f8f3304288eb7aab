"""The restricted reader of torch.save's zip format, on files written by torch.save itself (no JAX)."""

from __future__ import annotations

import os
import zipfile

import ml_dtypes
import numpy as np
import pytest

from jaxserve.checkpoint.torch_zip import read_state_dict
from jaxserve.errors import CheckpointError

torch = pytest.importorskip("torch")


def as_numpy(t) -> np.ndarray:
    """A torch tensor's values as numpy, bfloat16 through its bits."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def test_dtypes_read_exactly(tmp_path):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=gen)
    state = {"f32": x, "f16": x.half(), "bf16": x.bfloat16(), "f64": x.double(), "i64": torch.arange(-4, 8),
             "i32": torch.arange(6, dtype=torch.int32), "i8": torch.arange(-3, 3, dtype=torch.int8),
             "u8": torch.arange(250, 256, dtype=torch.uint8), "bool": x > 0, "scalar": torch.tensor(2.5),
             "empty": torch.zeros(0, 4)}
    torch.save(state, tmp_path / "s.pt")
    got = read_state_dict(tmp_path / "s.pt")
    assert list(got) == list(state)
    for name, t in state.items():
        want = as_numpy(t)
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert got[name].tobytes() == want.tobytes(), name


def test_offsets_strides_and_shared_storage(tmp_path):
    base = torch.arange(30.0).reshape(5, 6)
    state = {"base": base, "transposed": base.t(), "block": base[1:4, 2:5], "strided": base[::2, 1::3],
             "tail": base.view(-1)[7:19], "parameter": torch.nn.Parameter(torch.ones(2, 3))}
    assert not state["transposed"].is_contiguous() and state["tail"].storage_offset() == 7
    torch.save(state, tmp_path / "v.pt")
    got = read_state_dict(tmp_path / "v.pt")
    for name, t in state.items():
        np.testing.assert_array_equal(got[name], t.detach().numpy(), err_msg=name)
        assert got[name].flags.c_contiguous
    got["block"][0, 0] = -1  # a copy: the tensors sharing its storage are untouched
    assert got["base"][1, 2] == 8


def test_linear_state_dict_as_flagembedding_saves_it(tmp_path):
    linear = torch.nn.Linear(8, 1).half()
    torch.save(linear.state_dict(), tmp_path / "sparse_linear.pt")
    got = read_state_dict(tmp_path / "sparse_linear.pt")
    assert set(got) == {"weight", "bias"} and got["weight"].dtype == np.float16
    np.testing.assert_array_equal(got["weight"], linear.weight.detach().numpy())


class Payload:
    """What a malicious checkpoint carries: unpickling it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_payload_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"weight": torch.ones(2), "bias": Payload(marker)}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=r"names posix\.system") as err:
        read_state_dict(tmp_path / "evil.pt")
    assert "state dicts only" in str(err.value)
    assert not marker.exists()
    torch.load(tmp_path / "evil.pt", weights_only=False)  # the payload is live: torch's unrestricted load runs it
    assert marker.exists()


@pytest.mark.parametrize("obj, message", [
    (lambda: torch.nn.Linear(2, 2), r"names torch\.nn\.modules\.linear\.Linear"),
    (lambda: [torch.ones(2)], "holds a list, not a state dict"),
    (lambda: {"weight": torch.ones(2), "step": 3}, "'step' holds a value of type int, not a tensor"),
    (lambda: {"weight": torch.ones(2), "nested": {"a": torch.ones(1)}},
     "'nested' holds a value of type dict, not a tensor"),
])
def test_other_objects_are_refused(tmp_path, obj, message):
    torch.save(obj(), tmp_path / "x.pt")
    with pytest.raises(CheckpointError, match=message):
        read_state_dict(tmp_path / "x.pt")


def test_legacy_and_broken_archives(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="not a zip archive"):
        read_state_dict(tmp_path / "legacy.pt")

    torch.save({"w": torch.ones(4)}, tmp_path / "ok.pt")
    with zipfile.ZipFile(tmp_path / "ok.pt") as src, zipfile.ZipFile(tmp_path / "short.pt", "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, data[:8] if info.filename.endswith("data/0") else data)
    with pytest.raises(CheckpointError, match="holds 8 bytes"):
        read_state_dict(tmp_path / "short.pt")


def test_a_tensor_wider_than_its_storage_or_a_compressed_storage_is_refused(tmp_path):
    """An expanded view (stride 0) saved by torch.save: a storage of one float and a size of 10^5 x 10^5. Copying
    it whole would take 40 GB from a file of a few hundred bytes; refused before anything is allocated. A
    compressed storage (torch.save never writes one: only a bomb would) is refused before it is inflated."""
    torch.save({"w": torch.ones(1).expand(100_000, 100_000)}, tmp_path / "wide.pt")
    assert os.path.getsize(tmp_path / "wide.pt") < 4096
    with pytest.raises(CheckpointError, match="more elements than its storage"):
        read_state_dict(tmp_path / "wide.pt")
    torch.save({"w": torch.ones(4)}, tmp_path / "ok.pt")
    with zipfile.ZipFile(tmp_path / "ok.pt") as src, zipfile.ZipFile(tmp_path / "packed.pt", "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), zipfile.ZIP_DEFLATED if "/data/" in info.filename
                         else zipfile.ZIP_STORED)
    with pytest.raises(CheckpointError, match="compressed"):
        read_state_dict(tmp_path / "packed.pt")
