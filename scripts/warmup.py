"""Compile and time the buckets and save the warm artifact (same as `jaxserve warmup`).

    .venv/bin/python scripts/warmup.py [--model DIR] [--buckets FILE|auto] [--cache-dir DIR] [--write FILE]
"""

import sys

from jaxserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["warmup", *sys.argv[1:]]))
