#!/usr/bin/env bash
# The tensor-parallel run of an N-GPU machine in one device call (N from nvidia-smi: a 2-GPU
# machine rehearses what a 4-GPU one runs). Run from the repo root (carry .whl); every part runs
# under its own time limit (together $MULTI_GPU_SECONDS, 440 s unless set: under 8 minutes with
# the set-up), and its log and results land in $OUT:
#
#   tests    the symmetric all-reduce's kernels and the fused all-reduce + RMSNorm against
#            NCCL's, in graphs (test_all_reduce_norm.py, test_symmetric_all_reduce.py) and the
#            bf16 experts, which skip another rank's pairs under EP (test_moe.py); a killed worker
#            under NCCL and under the symmetric all-reduce; then test_tensor_parallel.py's greedy
#            output at tp 2 (and 4) equal to one GPU with and without speculation, graphs with
#            their collectives, with NCCL and the symmetric-memory all-reduce
#   122b     N >= 4: bench/tp_scaling.py on the Qwen3.5-122B-A10B shape at tp 4, experts split,
#            then with --enable-expert-parallel (batches 1, 16, 64)
#   scaling  bench/tp_scaling.py on the 9B and 35B-A3B shapes at tp 1, 2 (, 4): tokens/s at
#            batches 1, 16, 64, the collectives' share, speculation's speedup (shipped profile);
#            the 9B with NCCL's and the symmetric-memory all-reduce
#   serve    bench/tools/serve_smoke.py: deltaspec serve -tp N --load-format dummy (the 35B-A3B
#            shape; the 122B at N >= 4, experts split and expert-parallel), one streamed
#            completion over HTTP, SIGINT, no process left
#   next80b  the same smoke on the Qwen3-Next-80B-A3B shape at tp 2 (bf16 on cards of >= 100 GiB,
#            its block-FP8 form on H100s, where 152 GiB of bf16 weights do not fit two cards)
#
#   DELTASPEC_COMMIT=<sha> bash bench/tools/multi_gpu.sh [PART,PART,...]     (default: every part)
#
# A subset of the parts shares the same seconds (one part alone gets them all). tp_scaling
# writes its JSON and PNG after every batch, so a part its limit cuts keeps what it measured.
# A fresh machine compiles every Triton kernel first (minutes): on one, all four parts in one
# call do not finish (4 H200s, 55f2a49: bench/results/multi_gpu/summary-h200x4.json); run
# `tests`, `122b,serve` and `scaling` as three calls, carrying .triton-cache/ (the first with
# SAVE_TRITON_CACHE=1: bench/tools/save_triton_cache.sh).
set -uo pipefail
source bench/tools/device_setup.sh
export NCCL_NVLS_ENABLE=0  # NVLink multicast off (the device notes), NCCL's and symmetric memory's
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export DELTASPEC_COMMIT="${DELTASPEC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
# The parts write under $out; $OUT gets them as one multi_gpu.tgz (the device returns at most 8
# files a call) and, with SAVE_TRITON_CACHE=1, the compile cache's parts for the next call.
final="${OUT:-bench/results}"
out="$(mktemp -d /tmp/multi_gpu.XXXX)"
num_gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
echo "commit $DELTASPEC_COMMIT, $num_gpus GPUs"

if (( num_gpus >= 4 )); then
    sizes=1,2,4; tp=4; serve_shape=122b-a10b
    declare -A weight=([tests]=70 [122b]=170 [scaling]=130 [serve]=70 [next80b]=70)
else
    sizes=$(seq -s, 1 "$num_gpus"); tp=$num_gpus; serve_shape=35b-a3b
    declare -A weight=([tests]=150 [122b]=0 [scaling]=200 [serve]=90 [next80b]=90)
fi
parts="${1:-tests,122b,scaling,serve,next80b}"
seconds_total="${MULTI_GPU_SECONDS:-440}"
total=0
for p in ${parts//,/ }; do total=$((total + ${weight[$p]:-0})); done
limit() { echo $(( seconds_total * ${weight[$1]} / (total > 0 ? total : 1) )); }

wait_for_free_gpus() {  # a part its limit killed: its workers exit within a second of rank 0
    for _ in $(seq 30); do
        [[ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ]] && return
        sleep 1
    done
    echo "   GPU processes still running:"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
}

run_part() {  # name seconds command...
    local name=$1 seconds=$2 start=$SECONDS
    shift 2
    echo "== $name (limit ${seconds} s): $*"
    timeout -k 10 "$seconds" "$@" > "$out/multi_gpu-$name.log" 2>&1
    echo "   exit $? after $((SECONDS - start)) s"
    grep -E "PASSED|FAILED|ERROR|passed|failed|batch|started|skipped|\"ok\"|Error" "$out/multi_gpu-$name.log" | tail -n 25
    wait_for_free_gpus
}

for part in ${parts//,/ }; do
    case "$part" in
    tests)
        # Three groups, each under its own share of the part's limit, so that one group's cold
        # compiles cannot starve the others (2 H100s, 6869226: the float32 equality tests were
        # still compiling at 280 s). test_all_reduce_norm.py's kernel test has no gpu marker (it
        # runs interpreted on the CPU too; on a GPU it simulates the ranks on one device): whole.
        seconds=$(limit tests)
        run_part tests-kernels $((seconds / 4)) bash -c "python -m pytest -v -p no:cacheprovider \
            tests/kernels/test_all_reduce_norm.py && python -m pytest -v -m gpu -p no:cacheprovider -rs \
            tests/engine/test_symmetric_all_reduce.py tests/kernels/test_moe.py"
        run_part tests-killed $((seconds / 4)) python -m pytest -v -m gpu -p no:cacheprovider -rs \
            tests/engine/test_tensor_parallel.py -k killed
        run_part tests-tp $((seconds / 2)) python -m pytest -v -m gpu -p no:cacheprovider -rs \
            tests/engine/test_tensor_parallel.py -k "not killed" ;;
    122b)
        if (( num_gpus < 4 )); then echo "== 122b: skipped, $num_gpus GPUs (needs 4 H100s)"; continue; fi
        half=$(( $(limit 122b) / 2 ))
        run_part 122b-tp "$half" python bench/tp_scaling.py --shapes 122b-a10b --tp 4 --out "$out"
        run_part 122b-ep "$half" python bench/tp_scaling.py --shapes 122b-a10b --tp 4 --expert-parallel --out "$out" ;;
    scaling)
        # The 9B with NCCL's all-reduce and the symmetric-memory one (auto) side by side; the
        # 35B-A3B with NCCL's only (its all-reduces are the same sizes; a third of the engines).
        seconds=$(limit scaling)
        run_part scaling-9b $((seconds / 2)) python bench/tp_scaling.py --shapes 9b --tp "$sizes" \
            --all-reduce nccl,auto --out "$out"
        run_part scaling-35b $((seconds / 2)) python bench/tp_scaling.py --shapes 35b-a3b --tp "$sizes" \
            --out "$out" ;;
    serve)
        # At N >= 4 the 122B twice: experts split over the ranks, then whole experts per rank.
        seconds=$(limit serve)
        modes=("")
        (( num_gpus >= 4 )) && { modes=("" --expert-parallel); seconds=$((seconds / 2)); }
        for mode in "${modes[@]}"; do
            run_part "serve${mode:+-ep}" "$seconds" python bench/tools/serve_smoke.py --shape "$serve_shape" \
                --tp "$tp" $mode --start-timeout $((seconds - 30)) --out "$out"
        done ;;
    next80b)
        seconds=$(limit next80b)
        mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
        fp8=(); (( mib < 100 * 1024 )) && fp8=(--quantization fp8)
        run_part next80b "$seconds" python bench/tools/serve_smoke.py --shape 80b-a3b --tp 2 "${fp8[@]}" \
            --start-timeout $((seconds - 30)) --out "$out" ;;
    *)
        echo "unknown part $part (tests, 122b, scaling, serve, next80b)"; exit 2 ;;
    esac
done
ls -l "$out"
mkdir -p "$final"
tar czf "$final/multi_gpu.tgz" -C "$out" .
if [[ "${SAVE_TRITON_CACHE:-0}" == 1 ]]; then OUT="$final" bash bench/tools/save_triton_cache.sh; fi
