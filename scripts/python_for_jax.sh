#!/bin/sh
# Prints a Python that can install the newest jax (0.11 and later need Python >= 3.12): 3.12 first (the
# widest choice of wheels), then newer, on PATH and then in pyenv's installs; python3 when there is none
# (pip then installs jax 0.10, the oldest supported).
root="${PYENV_ROOT:-$HOME/.pyenv}"
for minor in 12 13 14; do
    for p in "python3.$minor" $(ls -d "$root"/versions/3."$minor".*/bin/python3 2>/dev/null | sort -rV); do
        if "$p" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
            echo "$p"
            exit 0
        fi
    done
done
echo python3
