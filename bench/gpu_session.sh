#!/usr/bin/env bash
# One device call that checks and measures the tree: the GPU tests, then the engine benches.
# Run from the repo root on the GPU machine (carry .whl); results land in $OUT.
#
#   DELTASPEC_COMMIT=<sha> bash bench/gpu_session.sh [tests|engine|all]     (default: all)
#
# The device's copy of the tree has no .git: pass the commit the results are recorded under.
# SAVE_TRITON_CACHE=1 also leaves the compile cache in $OUT for the next call (device_setup.sh).
# tests : pytest -m gpu (kernels in bf16, graphs, isolation, speculation, prefix cache)
# engine: decode_overhead (engine vs a bare graph at batch 1, async scheduling on and off),
#         profile_step (per-kernel time of a 0.8B-like step), engine_throughput (0.8B-like shape)
set -uo pipefail
source bench/tools/device_setup.sh
export DELTASPEC_COMMIT="${DELTASPEC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
what="${1:-all}"
out="${OUT:-bench/results}"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
if [[ "$what" == tests || "$what" == all ]]; then
    # One pytest process per file that has GPU tests, all at once: the run is dominated by
    # Triton's JIT compiles, which are CPU-bound and use one core per process.
    mkdir -p /tmp/gpu_tests
    grep -rl --include='test_*.py' "mark.gpu" tests | sort | xargs -P 8 -I{} sh -c \
        'timeout 420 python -m pytest -q -m gpu -p no:cacheprovider {} > /tmp/gpu_tests/$(basename {}).log 2>&1'
    for log in /tmp/gpu_tests/*.log; do echo "== $log"; grep -E "passed|failed|error" "$log" | tail -1; done
    grep -h -E "^(FAILED|ERROR)" /tmp/gpu_tests/*.log
    cat /tmp/gpu_tests/*.log > "$out/gpu_tests.log"
fi
if [[ "$what" == engine || "$what" == all ]]; then
    timeout 150 python bench/decode_overhead.py --steps 200 --out "$out" 2>&1 | tail -3
    timeout 120 python bench/profile_step.py --batches 1,64 --verify-drafts 0 --out "$out" 2>&1 | tail -3
    timeout 240 python bench/engine_throughput.py --shapes 0.8b --out "$out" 2>&1 | tail -8
fi
if [[ "${SAVE_TRITON_CACHE:-0}" == 1 ]]; then OUT="$out" bash bench/tools/save_triton_cache.sh; fi
