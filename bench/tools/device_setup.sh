# Source on the GPU machine from the repo root (carry .whl): puts msgspec, pytest-asyncio and
# llguidance (missing from its image) and this checkout on the path without touching the image's
# torch. .whl holds their py3.12 manylinux wheels (`pip download --no-deps --python-version 3.12
# --platform manylinux_2_31_x86_64 ... msgspec pytest-asyncio llguidance`).
# `pip install -e .` would need network for setuptools; a symlinked package tree does not.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/msgspec*.whl .whl/pytest_asyncio*.whl .whl/llguidance*.whl
mkdir -p /tmp/shim/deltaspec
touch /tmp/shim/deltaspec/__init__.py
for d in engine spec kernels server; do ln -sfn "$PWD/$d" "/tmp/shim/deltaspec/$d"; done
export PYTHONPATH=/tmp/shim:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# Triton's compile cache travels between calls (a fresh machine otherwise spends minutes of the
# device budget compiling every kernel again): the call that compiled kernels ends with
# bench/tools/save_triton_cache.sh, whose parts the next calls carry in .triton-cache/ (ignored
# by git). Entries name their files by absolute path, so the cache sits where it was written.
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G ".triton-cache/triton-cache.txz.*" > /dev/null; then
    cat .triton-cache/triton-cache.txz.* | xz -dc | tar xf - -C "$TRITON_CACHE_DIR" --skip-old-files
    echo "Triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries after seeding from .triton-cache/"
fi
