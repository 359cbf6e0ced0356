#!/usr/bin/env bash
# Run a command inside another tree of this repo (an A/B baseline carried to the GPU machine,
# e.g. `git archive <commit> | tar -x -C _ab/base`), with that tree's packages on the path:
#
#   bash bench/tools/ab.sh _ab/base python bench/spec_step.py --out "$OUT/base"
#
# Source bench/tools/device_setup.sh first (it installs the wheels into /tmp/site).
set -euo pipefail
tree="$(cd "$1" && pwd)"
shift
shim="/tmp/shim-$(basename "$tree")"
mkdir -p "$shim/deltaspec"
touch "$shim/deltaspec/__init__.py"
for d in engine spec kernels server; do ln -sfn "$tree/$d" "$shim/deltaspec/$d"; done
cd "$tree"
PYTHONPATH="$shim:/tmp/site" "$@"
