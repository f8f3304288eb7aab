"""scripts/device_model.py: a checkpoint packed in float16 and unpacked loads as float32 with the same outputs."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))

from conftest import TINY_TABLE  # noqa: E402
from device_model import pack, unpack  # noqa: E402

from jaxserve import Encoder  # noqa: E402


def test_pack_then_unpack_restores_a_loadable_float32_checkpoint(tiny_checkpoint, tmp_path):
    original = tiny_checkpoint()
    pack(original, tmp_path / "packed")
    assert not list((tmp_path / "packed").glob("model.safetensors*"))  # only the float16 file travels
    unpack(tmp_path / "packed", tmp_path / "restored")
    docs = ["static shapes", "jax " * 20]
    want = Encoder.from_pretrained(str(original), buckets=TINY_TABLE).embed(docs)
    got = Encoder.from_pretrained(str(tmp_path / "restored"), buckets=TINY_TABLE).embed(docs)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=5e-3)
