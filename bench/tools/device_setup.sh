# Source on the GPU machine from the repo root (carry .whl): puts msgspec and pytest-asyncio
# (missing from its image) and this checkout on the path without touching the image's torch.
# `pip install -e .` would need network for setuptools; a symlinked package tree does not.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/msgspec*.whl .whl/pytest_asyncio*.whl
mkdir -p /tmp/shim/deltaspec
touch /tmp/shim/deltaspec/__init__.py
for d in engine spec kernels server; do ln -sfn "$PWD/$d" "/tmp/shim/deltaspec/$d"; done
export PYTHONPATH=/tmp/shim:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
