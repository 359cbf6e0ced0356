#!/usr/bin/env bash
# The GPU kernels under NVIDIA compute-sanitizer: memcheck over the kernel tests and one engine
# run with CUDA graphs off (prefill, decode, MTP draft and verify, sampling), racecheck over the
# attention kernels (the ones whose warps share memory through tl.dot tiles). Prints one line a
# run and a pass/fail summary; exit 0 only when every run is clean.
#
#   bash bench/tools/sanitize.sh            (repo root, GPU machine; under 8 minutes)
#
# PyTorch's caching allocator is off (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so an access past a
# tensor's end lands outside any allocation, where memcheck sees it, instead of in a cached block.
set -uo pipefail
[[ -f bench/tools/device_setup.sh && -d .whl ]] && source bench/tools/device_setup.sh
export PYTHONPATH="${PYTHONPATH:-}"

sanitizer="$(command -v compute-sanitizer || true)"
if [[ -z "$sanitizer" ]]; then
    sanitizer="$(ls -1d /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer/compute-sanitizer \
                 2>/dev/null | sort -V | tail -1)"
fi
if [[ -z "$sanitizer" || ! -x "$sanitizer" ]]; then
    echo "sanitize.sh: compute-sanitizer not found (not in PATH, /usr/local/cuda*/bin or /opt/nvidia):"
    echo "  install the CUDA toolkit's compute-sanitizer (apt-get install cuda-sanitizer-12-x) and rerun."
    exit 2
fi
echo "using $sanitizer ($("$sanitizer" --version | tail -1))"
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true

logs="${OUT:-/tmp}/sanitize"
mkdir -p "$logs"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
flags=(--error-exitcode 99 --target-processes all --print-limit 20 --launch-timeout 120)

# name|tool|timeout seconds|command. Graph-capture tests are left out: with the caching allocator
# off, a tensor allocated during capture is a cudaMalloc, which capture forbids (the kernels they
# capture run eagerly in the other tests). Racecheck is ~100x slower than memcheck: one small case
# of each attention launcher.
pytest_q="python -m pytest -q -x -p no:cacheprovider"
runs=(
    "attention|memcheck|420|$pytest_q tests/kernels/test_attention.py -k \"not cuda_graph and not long_contexts\""
    "attention_long|memcheck|420|$pytest_q tests/kernels/test_attention.py -k long_contexts"
    "attention|racecheck|420|$pytest_q tests/kernels/test_attention.py -k \"split_merge or launcher_choice\""
    "gdn_decode|memcheck|420|$pytest_q tests/kernels/test_gdn_decode.py -k \"not cuda_graph and not gpu_bf16\""
    "gdn_decode_bf16|memcheck|420|$pytest_q tests/kernels/test_gdn_decode.py -k gpu_bf16"
    "gdn_chunked|memcheck|420|$pytest_q tests/kernels/test_gdn_chunked.py"
    "conv1d_norms_rope|memcheck|420|$pytest_q -rf tests/kernels/test_conv1d.py tests/kernels/test_norms.py tests/kernels/test_rope.py"
    "sampling|memcheck|420|$pytest_q tests/kernels/test_sampling.py"
    "engine_eager|memcheck|420|python bench/tools/sanitize_engine.py"
)
run_one() {
    IFS='|' read -r name tool seconds command <<< "$1"
    log="$logs/${name}.${tool}.log"
    timeout "$seconds" "$sanitizer" --tool "$tool" "${flags[@]}" bash -c "$command" > "$log" 2>&1
    rc=$?
    summary="$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)"
    tests="$(grep -E "[0-9]+ (passed|failed)" "$log" | tail -1)"
    if [[ $rc -eq 0 ]]; then verdict=PASS; elif [[ $rc -eq 124 ]]; then verdict="TIMEOUT(${seconds}s)"; else verdict="FAIL(rc=$rc)"; fi
    printf '%-18s %-10s %-14s %s %s\n' "$name" "$tool" "$verdict" "${summary:-no sanitizer summary}" "$tests"
}
export -f run_one
export sanitizer logs
export flags_string="${flags[*]}"

# All at once (under 8 minutes on 16 cores): the runs are bound by Triton's compiles (CPU) and the sanitizer's slowdown.
results="$(printf '%s\n' "${runs[@]}" | xargs -d '\n' -P "${#runs[@]}" -I{} bash -c 'flags=($flags_string); run_one "$@"' _ {})"
echo "$results" | sort
failed="$(echo "$results" | grep -vc " PASS " || true)"
echo "sanitize: $(( ${#runs[@]} - failed )) of ${#runs[@]} runs clean; logs in $logs"
[[ "$failed" -eq 0 ]]
