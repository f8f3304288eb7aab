"""Carry a checkpoint to an offline machine in half the bytes, and restore it there.

    python scripts/device_model.py pack [--model DIR] .carry/model   # here: float16 weights + the small files
    python scripts/device_model.py unpack .carry/model /tmp/model     # there: float32 weights again

The GPU machines lent to this project's sessions take a working tree of at
most 64 MiB and cannot download: all-MiniLM-L6-v2's float32 weights (87 MiB)
do not fit, in float16 (43 MiB) they do. Restored weights are the float16
values widened back to float32 (a relative change under 1e-3): the same shapes
and FLOPs, so timings are those of the real model. Not for parity numbers.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

HALF = "model.f16.safetensors"


def pack(model: Path, out: Path) -> None:
    """Every file but the weights as is; the weights (one file or shards) as one float16 file."""
    from jaxserve.checkpoint import loader

    shutil.copytree(model, out, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    tensors = loader.read_tensors(model)
    save_file({k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in tensors.items()}, out / HALF)


def unpack(packed: Path, out: Path) -> None:
    shutil.copytree(packed, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(HALF))
    tensors = load_file(packed / HALF)
    save_file({k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in tensors.items()},
              out / "model.safetensors")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--model", help="checkpoint directory (default: $JAXSERVE_MODEL or the bundled one)")
    p.add_argument("out", type=Path)
    u = sub.add_parser("unpack")
    u.add_argument("packed", type=Path)
    u.add_argument("out", type=Path)
    args = ap.parse_args()
    if args.command == "pack":
        from jaxserve.checkpoint import loader

        pack(loader.resolve(args.model), args.out)
    else:
        unpack(args.packed, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
