#!/usr/bin/env bash
# Save the device's Triton compile cache into $OUT as xz-compressed parts of at most 15 MiB (the
# device returns files of up to 16 MiB; gzip left three times the bytes to carry), keeping what a
# cached kernel loads (its metadata .json, the .cubin and the compiled launchers) and leaving out
# the intermediate IR (.ttir, .ttgir, .llir, .ptx, .source), which Triton reads only while compiling. Locally, put the parts in .triton-cache/
# (replacing the old ones) and carry it: bench/tools/device_setup.sh seeds the next machine.
set -euo pipefail
cache="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
tar cf - -C "$cache" --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.llir' --exclude='*.ptx' \
    --exclude='*.source' --exclude='*.amdgcn' --exclude='*.hsaco' . | xz -6 -T0 | split -b 15m - "$OUT/triton-cache.txz."
ls -l "$OUT"/triton-cache.txz.*
