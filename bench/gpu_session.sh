#!/usr/bin/env bash
# One device call that checks and measures the tree: the GPU tests, then the engine benches.
# Run from the repo root on the GPU machine (carry .whl); results land in $OUT.
#
#   DELTASPEC_COMMIT=<sha> bash bench/gpu_session.sh [PART,PART,...|all]     (default: all)
#
# The device's copy of the tree has no .git: pass the commit the results are recorded under.
# SAVE_TRITON_CACHE=1 also leaves the compile cache in $OUT for the next call (device_setup.sh).
# `all` is tests then engine (under 10 minutes); the other parts are a call each.
# tests   : pytest -m gpu (kernels in bf16, graphs, isolation, speculation, prefix cache), 8 shards
# kernels : every kernel test, marked gpu or not, on the GPU (the unmarked ones run their Triton
#           kernels there instead of the interpreter: GPU numerics at the CPU suite's shapes)
# engine  : decode_overhead (engine vs a bare graph at batch 1, async scheduling on and off),
#           profile_step (per-kernel time of a 0.8B-like step), engine_throughput (0.8B-like shape)
# floor   : decode_floor (#32: the 0.8B step's bytes read in one launch, per layer, per kernel)
# spec    : spec_e2e on the 0.8B shape (#27); spec9b: the 9B shape at batches 1 16 64 (256 does not
#           fit 80 GB)
# spec35b : spec_e2e on the 35B-A3B shape at batches 1 4 16 64 (256 on cards of >= 100 GiB)
# specab  : spec_e2e (plain, k = 3 and adaptive; shipped profile; T = 0) on AB_SHAPES (default 9b) at
#           AB_BATCHES (default 1,16) for this tree and the baseline tree AB_BASE, new then base
# serve   : serve_spec through `deltaspec serve`, shipped model (#27's server bars)
# specserve: `deltaspec bench serve --unique-prompts` (every prompt new: admissions on the critical
#           path) with speculation and with --num-draft-tokens 0, at T = 0 and 0.7, 16 and 64
#           streams: served tok/s and the engine's step times by kind (RESULTS, "Through the server")
# stephost: bench/tools/ttft_trace.py at T = 0.7, 16 and 64 streams, plain and speculative: each
#           step's host time by part (where a speculative decode step's extra time goes)
# servedab: `deltaspec bench serve --unique-prompts` at T = 0.7 for this tree and the baseline tree
#           AB_BASE (git archive <commit> | tar -x -C _ab/base; carried), alternating new, base per
#           draft setting (AB_SETTINGS, default "default 0"; AB_STREAMS, default "16 64"; AB_FLAGS, more
#           bench serve flags, e.g. "--max-tokens-range 0.5"), then
#           ttft_trace --wait-in-loop --device-times (the engine process's own loop) at 16 plain
#           streams for both: each step kind's device busy and idle, decode steps by their
#           distance from the last admission
# hostsplit: bench/tools/step_host_split.py (a decode step's host time by part in the engine's own
#           loop, speculative vs plain, and graph replays' host cost)
# sampling: sampling_cost three times, each its own process (#29's 1.15x bar)
# fp8     : kernels_fp8 and engine_throughput --quantization fp8 with the fused activation
#           quantizer and without it (#30's bars)
# wna16ab : the packed int4 GEMM (bench/kernels_wna16.py at 1, 8, 64 rows) and the 9B W4A16 engine with its
#           bf16 twin (batches 1, 16, 64) for this tree and the baseline tree AB_BASE, new then base
# fp8ab   : bench/tools/fp8_gemv_chain.py, then the FP8 9B engine at batch 1 (with its bf16 twin) for
#           this tree and AB_BASE, alternating new, base, new, and its profile_step (#30)
# abuse   : `deltaspec bench serve --abuse` at 16 and 64 streams (#33)
# ttftbar : `deltaspec bench serve` at 16 and 64 streams twice (#33's TTFT p99 <= 3x p50 bar, which
#           moves from run to run), with each run's engine step times and GC pauses
# ttft    : bench/tools/ttft_trace.py (first-token time by part, in-process) and `deltaspec bench
#           serve --unique-prompts --no-in-process` (every prefill cold) at 16 and 64 streams (#33)
# sanitize: bench/tools/sanitize.sh, compute-sanitizer over the kernels and one engine run (#33)
# crowded : one GPU test (CROWDED_TEST, a pytest node id) in 8 copies at once, each with an eighth
#           of the device, for this tree and, with AB_BASE (a tree with its tests: git archive
#           <commit> engine spec kernels server tests pyproject.toml), the baseline: a test that
#           passes alone and fails among the shards (timing-dependent start-up choices, races)
#           shows here
# fusion  : bench/kernels_block_fusion.py (a step's projections and block ops, separate against
#           fused into the skinny GEMM's epilogue, and each fusion's cost per projection), then
#           profile_step at batches 1, 8, 32 with k = 3 verifies (#32)
# stepab  : profile_step (batches AB_PROFILE_BATCHES, default 1,8,32,64, k = 3 verifies, and the MTP
#           draft step over a 32K draft vocabulary), spec_step at batch 1 (the k = 3 step's parts
#           over a decode step) and engine_throughput (0.8B at AB_ENGINE_BATCHES, default 1,16,64;
#           9B at 1 unless AB_9B=0) for this tree and the baseline tree AB_BASE, alternating new,
#           base (#32's A/B). All of it
#           passes 10 minutes on a fresh machine (its compiles): narrow it, e.g. AB_PROFILE_BATCHES=1
#           AB_ENGINE_BATCHES=1 (about 4 minutes with the 9B)
# kprof   : bench/tools/kernel_profile.py plain and speculative (the CUDA kernels of a served-like
#           closed loop at 16 streams, T = 0.7, by kernel), bench/kernels_conv.py and
#           bench/tools/gather_micro.py
# patchab : patches not yet timed (AB_PATCHES: space-separated paths, e.g. bench/results/attempts/x.patch),
#           each applied to a copy of this tree: the GPU tests the patch adds or changes, then
#           profile_step at batch 1 and engine_throughput (0.8B at batch 1; 9B unless AB_9B=0) for this
#           tree and every patched one in turn (about 2 minutes a tree with the 9B, 1 without, and a
#           minute of GPU tests a patch: three patches pass one call's 10 minutes, so split them)
set -uo pipefail
source bench/tools/device_setup.sh
export DELTASPEC_COMMIT="${DELTASPEC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
parts="${1:-all}"
[[ "$parts" == all ]] && parts=tests,engine
out="${OUT:-bench/results}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"  # absolute: some parts run in another tree (ab.sh)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
# in_tree TREE COMMAND...: COMMAND in this tree (new), in the baseline tree AB_BASE (base) or in the
# tree at the path TREE, with that tree's packages on the path (bench/tools/ab.sh); the A/B parts
# run each side through it.
in_tree() {
    local tree=$1; shift
    case $tree in
        new) "$@" ;;
        base) bash bench/tools/ab.sh "${AB_BASE:?AB_BASE: the baseline tree}" "$@" ;;
        *) bash bench/tools/ab.sh "$tree" "$@" ;;
    esac
}
for part in ${parts//,/ }; do
  echo "== $part"
  case "$part" in
  tests)
    # The GPU tests dealt round-robin into 8 pytest processes, all at once: the run is dominated
    # by engine builds, graph captures and Triton's JIT compiles, which are CPU-bound and use one
    # core per process, and one file alone (test_gpu_engine.py) takes longer than a call allows.
    rm -rf /tmp/gpu_tests && mkdir -p /tmp/gpu_tests
    python -m pytest -q -m gpu -p no:cacheprovider --collect-only tests | grep "::" \
        | split -n r/8 - /tmp/gpu_tests/shard.
    # Each process's engines size their pools from an eighth of the device (tests/conftest.py).
    ls /tmp/gpu_tests/shard.* | DELTASPEC_TEST_GPU_SHARDS=8 xargs -P 8 -I{} sh -c \
        'timeout ${TESTS_TIMEOUT:-480} python -m pytest -q -m gpu -p no:cacheprovider $(cat {}) > {}.log 2>&1'
    for log in /tmp/gpu_tests/*.log; do echo "== $log"; grep -E "passed|failed|error" "$log" | tail -1; done
    grep -h -E "^(FAILED|ERROR)" /tmp/gpu_tests/*.log
    cat /tmp/gpu_tests/*.log > "$out/gpu_tests.log" ;;
  kernels)
    mkdir -p /tmp/kernel_tests
    ls tests/kernels/test_*.py | xargs -P 8 -I{} sh -c \
        'timeout 420 python -m pytest -q -p no:cacheprovider {} > /tmp/kernel_tests/$(basename {}).log 2>&1'
    for log in /tmp/kernel_tests/*.log; do echo "== $log"; grep -E "passed|failed|error" "$log" | tail -1; done
    grep -h -E "^(FAILED|ERROR)" /tmp/kernel_tests/*.log
    cat /tmp/kernel_tests/*.log > "$out/kernel_tests.log" ;;
  engine)
    timeout 150 python bench/decode_overhead.py --steps 200 --out "$out" 2>&1 | tail -3
    timeout 120 python bench/profile_step.py --batches 1,64 --verify-drafts 0 --out "$out" 2>&1 | tail -3
    timeout 240 python bench/engine_throughput.py --shapes 0.8b --out "$out" 2>&1 | tail -8 ;;
  kprof)
    for drafts in 0 default; do
        timeout 240 python bench/tools/kernel_profile.py --drafts $drafts --top 25 --out "$out" 2>&1 | grep -v Warn | tail -27
    done
    timeout 120 python bench/kernels_conv.py --out "$out" 2>&1 | tail -9
    timeout 120 python bench/tools/gather_micro.py --out "$out" 2>&1 | tail -6 ;;
  floor)
    timeout 300 python bench/decode_floor.py --out "$out" 2>&1 | tail -12 ;;
  fusion)
    timeout 240 python bench/kernels_block_fusion.py --rows 1,4,16,32 --projections --out "$out" 2>&1 \
        | grep -E "^(0.8b|9b) M=" | tail -8
    timeout 150 python bench/profile_step.py --batches 1,8,32 --verify-drafts 3 --out "$out" 2>&1 | tail -3 ;;
  stepab)
    : "${AB_BASE:?AB_BASE: the baseline tree}"  # before the new side runs
    for tree in new base; do
        mkdir -p "$out/$tree/9b"
        in_tree "$tree" timeout 150 python "$(pwd)/bench/profile_step.py" --batches "${AB_PROFILE_BATCHES:-1,8,32,64}" \
            --verify-drafts 3 --draft-vocab 32768 --out "$out/$tree" 2>&1 | grep -E "graph" | sed "s/^/$tree /"
        in_tree "$tree" timeout 150 python "$(pwd)/bench/spec_step.py" --batches 1 --max-draft 3 --out "$out/$tree" 2>&1 \
            | tail -4 | sed "s/^/$tree /"
    done
    for tree in new base; do
        in_tree "$tree" timeout 150 python "$(pwd)/bench/engine_throughput.py" --shapes 0.8b \
            --batches "${AB_ENGINE_BATCHES:-1,16,64}" --out "$out/$tree" 2>&1 \
            | grep -E '"(tokens_per_s|share_of_roofline)"' | sed "s/^/$tree 0.8b /"
        [[ "${AB_9B:-1}" == 0 ]] || in_tree "$tree" timeout 150 python "$(pwd)/bench/engine_throughput.py" --shapes 9b \
            --batches 1 --out "$out/$tree/9b" 2>&1 | grep -E '"(tokens_per_s|share_of_roofline)"' | sed "s/^/$tree 9b /"
    done ;;
  spec)
    timeout 540 python bench/spec_e2e.py --shapes 0.8b --batches 1,16,64,256 --out "$out" 2>&1 \
        | grep -E "k=3|adaptive" | tail -8 ;;
  spec9b)
    timeout 540 python bench/spec_e2e.py --shapes 9b --batches 1,16,64 --out "$out" 2>&1 \
        | grep -E "k=3|adaptive" | tail -8 ;;
  spec35b)
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
    batches=1,4,16,64; (( mib >= 100 * 1024 )) && batches=$batches,256
    timeout 560 python bench/spec_e2e.py --shapes 35b-a3b --batches "$batches" --out "$out" 2>&1 \
        | grep -E "k=3|adaptive" | tail -8 ;;
  specab)
    : "${AB_BASE:?AB_BASE: the baseline tree}"  # before the new side runs
    for tree in new base; do
        mkdir -p "$out/$tree"
        in_tree "$tree" timeout 270 python "$(pwd)/bench/spec_e2e.py" --shapes "${AB_SHAPES:-9b}" --batches "${AB_BATCHES:-1,16}" \
            --fixed 3 --profiles shipped --temperatures 0 --out "$out/$tree" 2>&1 | grep -E "k=3|adaptive" | sed "s/^/$tree /"
    done ;;
  serve)
    timeout 560 python bench/serve_spec.py --device cuda --dtype bfloat16 --streams 1 16 64 --temperatures 0 0.7 \
        --max-tokens 256 --requests-per-stream 3 --out "$out" 2>&1 | tail -12 ;;
  specserve)
    for temperature in 0 0.7; do
        for drafts in default 0; do
            echo "-- T = $temperature, drafts $drafts"
            timeout 140 python -m deltaspec.server.cli bench serve --device cuda --dtype bfloat16 --streams 16 64 \
                --duration 8 --max-tokens 256 --unique-prompts --no-in-process --temperature "$temperature" \
                $([[ $drafts == 0 ]] && echo --num-draft-tokens 0) --out "$out/specserve_T${temperature}_$drafts" \
                2>&1 | grep -E "^(served|server)"
        done
    done ;;
  stephost)
    for drafts in 0 default; do
        mkdir -p "$out/stephost_$drafts"
        timeout 200 python bench/tools/ttft_trace.py --device cuda --dtype bfloat16 --streams 16 64 --duration 8 \
            --temperature 0.7 $([[ $drafts == 0 ]] && echo --num-draft-tokens 0) --out "$out/stephost_$drafts" \
            2>&1 | tail -3 | cut -c1-300
    done ;;
  servedab)
    base="${AB_BASE:?AB_BASE: the baseline tree}"
    [[ -e "$base/models" ]] || ln -sfn "$(pwd)/models" "$base/models"
    for drafts in ${AB_SETTINGS:-default 0}; do
        for tree in new base; do
            echo "-- $tree, drafts $drafts"
            command=(python -m deltaspec.server.cli bench serve --device cuda --dtype bfloat16 --streams ${AB_STREAMS:-16 64}
                     --duration 7 --max-tokens 256 --unique-prompts --no-in-process --temperature 0.7
                     $([[ $drafts == 0 ]] && echo --num-draft-tokens 0) ${AB_FLAGS:-} --out "$out/servedab/${tree}_$drafts")
            [[ $tree == base ]] && command=(bash bench/tools/ab.sh "$base" "${command[@]}")
            timeout 150 "${command[@]}" 2>&1 | grep -E "^(served|server)"
        done
    done
    for tree in new base; do
        command=(python bench/tools/ttft_trace.py --device cuda --dtype bfloat16 --streams 16 --duration 6
                 --temperature 0.7 --num-draft-tokens 0 --unique-prompts --wait-in-loop --device-times
                 --out "$out/servedab/trace_$tree")
        # The base tree runs this tree's trace (its parts a base lacks are skipped).
        [[ $tree == base ]] && { mkdir -p "$base/bench/tools"; cp bench/tools/ttft_trace.py "$base/bench/tools/";
                                 cp bench/common.py "$base/bench/"; command=(bash bench/tools/ab.sh "$base" "${command[@]}"); }
        timeout 150 "${command[@]}" 2>&1 | tail -1 | cut -c1-200
    done ;;
  hostsplit)
    timeout 200 python bench/tools/step_host_split.py --out "$out" 2>&1 | tail -2 | cut -c1-300 ;;
  sampling)
    for run in 1 2 3; do
        mkdir -p "$out/sampling_$run"
        timeout 150 python bench/sampling_cost.py --steps 96 --out "$out/sampling_$run" 2>&1 | grep "^k="
    done ;;
  fp8)
    timeout 150 python bench/kernels_fp8.py --rows 1,16,64,8192 --out "$out" 2>&1 | tail -10
    mkdir -p "$out/fp8_fused" "$out/fp8_unfused"
    timeout 180 python bench/engine_throughput.py --quantization fp8 --shapes 9b --batches 1,16 \
        --out "$out/fp8_fused" 2>&1 | tail -4
    DELTASPEC_FUSE_FP8_QUANT=0 timeout 180 python bench/engine_throughput.py --quantization fp8 --shapes 9b \
        --batches 1,16 --out "$out/fp8_unfused" 2>&1 | tail -4 ;;
  wna16ab)
    : "${AB_BASE:?AB_BASE: the baseline tree}"
    for tree in new base; do
        mkdir -p "$out/$tree"
        in_tree "$tree" timeout 100 python "$(pwd)/bench/kernels_wna16.py" --rows 1,8,64 --out "$out/$tree" 2>&1 \
            | grep -E "^(mlp|attn|gdn|moe)" | sed "s/^/$tree /"
        in_tree "$tree" timeout 200 python "$(pwd)/bench/engine_throughput.py" --quantization w4a16 --shapes 9b \
            --batches 1,16,64 --out "$out/$tree" 2>&1 | grep -E '"tokens_per_s"' | sed "s/^/$tree /"
    done ;;
  fp8ab)
    # #30: the FP8 one-row chain (tiles), then the FP8 9B engine at batch 1 with its bf16 twin,
    # this tree and AB_BASE alternating, and its profile.
    : "${AB_BASE:?AB_BASE: the baseline tree}"  # before the new side runs
    timeout 150 python bench/tools/fp8_gemv_chain.py --out "$out" 2>&1 | grep -E "fp8_gemv_config"
    for tree in new base new; do
        mkdir -p "$out/$tree"
        in_tree "$tree" timeout 150 python "$(pwd)/bench/engine_throughput.py" --quantization fp8 --shapes 9b \
            --batches 1 --out "$out/$tree" 2>&1 | grep -E 'FP8 / bf16|"step_ms"' | sed "s/^/$tree /"
    done
    timeout 120 python bench/profile_step.py --shape 9b --quantization fp8 --batches 1 --verify-drafts 0 \
        --out "$out" 2>&1 | grep -E "graph|us critical" | head -10 ;;
  abuse)
    timeout 480 python -m deltaspec.server.cli bench serve --device cuda --dtype bfloat16 --streams 16 64 \
        --duration 30 --max-tokens 256 --abuse --out "$out" 2>&1 | tail -15 ;;
  ttftbar)
    for run in 1 2; do
        timeout 230 python -m deltaspec.server.cli bench serve --device cuda --dtype bfloat16 --streams 16 64 \
            --duration 20 --max-tokens 256 --out "$out/ttftbar_$run" 2>&1 | grep -E "^(served|server|in_process)" | tail -6
    done ;;
  ttft)
    timeout 200 python bench/tools/ttft_trace.py --device cuda --dtype bfloat16 --streams 16 64 --duration 10 \
        --out "$out" 2>&1 | tail -3 | cut -c1-400
    timeout 200 python -m deltaspec.server.cli bench serve --device cuda --dtype bfloat16 --streams 16 64 \
        --duration 10 --max-tokens 256 --unique-prompts --no-in-process --out "$out/unique" 2>&1 | tail -4 ;;
  sanitize)
    OUT="$out" timeout 540 bash bench/tools/sanitize.sh 2>&1 | tail -12 ;;
  crowded)
    test="${CROWDED_TEST:?CROWDED_TEST: a pytest node id}"
    for tree in new ${AB_BASE:+base}; do
        prefix=""; [[ $tree == base ]] && prefix="bash bench/tools/ab.sh $AB_BASE"
        mkdir -p "$out/crowded_$tree"
        seq 1 8 | DELTASPEC_TEST_GPU_SHARDS=8 xargs -P 8 -I{} sh -c \
            "timeout 240 $prefix python -m pytest -q -m gpu -p no:cacheprovider $test > $out/crowded_$tree/{}.log 2>&1"
        echo "$tree: $(grep -l ' passed' "$out/crowded_$tree"/*.log | wc -l) of 8 passed"
        grep -h -E "^E .*(diff|assert)" "$out/crowded_$tree"/*.log | sort | uniq -c | head -5
    done ;;
  patchab)
    trees=()
    for patch in ${AB_PATCHES:?AB_PATCHES: the patch files}; do
        tree="/tmp/patched/$(basename "$patch" .patch)"
        patch_file="$(cd "$(dirname "$patch")" && pwd)/$(basename "$patch")"
        rm -rf "$tree" && mkdir -p "$tree" && cp -r engine spec kernels server tests docs pyproject.toml "$tree"/
        # git apply works outside a repository; patch(1) where the image has no git
        (cd "$tree" && { git apply -p1 "$patch_file" 2>/dev/null || patch -s -p1 < "$patch_file"; }) \
            || { echo "$patch does not apply"; exit 1; }
        trees+=("$tree")
        tests=$(grep -E '^\+\+\+ b/tests/.*test_.*\.py' "$patch_file" | sed 's|^+++ b/||' | sort -u)
        [[ -z $tests ]] || in_tree "$tree" timeout 240 python -m pytest -q -m gpu -p no:cacheprovider $tests 2>&1 \
            | tail -3 | sed "s|^|$(basename "$tree") tests |"
    done
    for tree in new "${trees[@]}"; do
        label=$(basename "$tree"); mkdir -p "$out/$label/9b"
        in_tree "$tree" timeout 100 python "$(pwd)/bench/profile_step.py" --batches 1 --verify-drafts 0 --timeline \
            --out "$out/$label" 2>&1 | grep graph | sed "s/^/$label /"
        in_tree "$tree" timeout 100 python "$(pwd)/bench/engine_throughput.py" --shapes 0.8b --batches 1 --out "$out/$label" \
            2>&1 | grep -E '"(tokens_per_s|share_of_roofline)"' | head -2 | sed "s/^/$label 0.8b /"
        [[ "${AB_9B:-1}" == 0 ]] || in_tree "$tree" timeout 120 python "$(pwd)/bench/engine_throughput.py" --shapes 9b \
            --batches 1 --out "$out/$label/9b" 2>&1 | grep -E '"(tokens_per_s|share_of_roofline)"' | head -2 | sed "s/^/$label 9b /"
    done ;;
  *)
    echo "unknown part $part (tests, kernels, engine, floor, fusion, spec, spec9b, spec35b, specab, serve, specserve, stephost, servedab, hostsplit, sampling, fp8, fp8ab, abuse, ttftbar, ttft, sanitize, crowded, patchab)"; exit 2 ;;
  esac
done
if [[ "${SAVE_TRITON_CACHE:-0}" == 1 ]]; then OUT="$out" bash bench/tools/save_triton_cache.sh; fi
