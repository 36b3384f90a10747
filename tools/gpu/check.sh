#!/usr/bin/env bash
# Runs comera-cuda's GPU checks from prebuilt test binaries, building nothing:
#
#   tools/gpu/check.sh BUNDLE_DIR            (a folder made by tools/gpu/bundle.sh)
#   tools/gpu/check.sh BINARY [BINARY...]    (test binaries from
#                                             `cargo test --release -p comera-cuda --no-run`)
#
# On the GPU machine it needs the NVIDIA driver (R580+, CUDA 13.0) and NVRTC 13 (libnvrtc.so.13:
# the CUDA 13 toolkit's lib64, or `pip install nvidia-cuda-nvrtc==13.0.88` and its
# nvidia/cu13/lib folder); the script looks for it in the usual places and on LD_LIBRARY_PATH.
# COMERA_REQUIRE_GPU=1 and COMERA_REQUIRE_NVRTC=1 are set, so a test that cannot reach the GPU
# fails instead of saying "skipped".
#
# Results: one log per binary and summary.txt under $OUT when set (else ./gpu-check-<time>/).
# Exit status 0 only when every binary passed. Each binary is limited to 5 minutes.
# Then, when BUNDLE_DIR/bench/step_bench exists (bundle.sh puts it there), the step benchmark:
# the paper model's captured step, TT/TTM and dense, batch 1 and 32 (its table in
# step_bench.log, its JSON lines in step_bench.json; 4 minutes at most). Set
# COMERA_BENCH_ARGS to pass it other arguments (e.g. "--replays 100"). Then its --ops run: one
# eager step per model and batch with every kernel and product timed on its own (step_ops.log).
# Then, when BUNDLE_DIR/bin/comera exists: tools/gpu/e2e.sh, a small run trained on the GPU and
# on the CPU and moved between them through checkpoints, compared (under e2e/; 4 minutes at most).
# With BUNDLE_DIR/authors (bundle.sh with COMERA_SRC set): tools/authors/gpu_side_by_side.sh,
# the authors' step (eager and their CUDA-graph recipe) beside comera's on the same GPU.
# Then, where compute-sanitizer runs: the engine's step tests under memcheck (2 minutes at most).
# Last, with the time left (at least 45 s): `comera bench step --scaling` on this machine's CPU
# cores (issue 51's scaling table; reported, not judged).
# All of it within COMERA_CHECK_BUDGET seconds (540 by default).
set -uo pipefail
if [ $# -eq 0 ]; then
    sed -n '2,9p' "$0" >&2
    exit 2
fi
bins=()
bench=""
cli=""
for a in "$@"; do
    if [ -d "$a" ]; then
        [ -x "$a/bench/step_bench" ] && bench="$a/bench/step_bench"
        [ -x "$a/bin/comera" ] && cli="$a/bin/comera"
        for f in "$a"/*; do
            [ -f "$f" ] && [ -x "$f" ] && bins+=("$f")
        done
    elif [ -f "$a" ] && [ -x "$a" ]; then
        bins+=("$a")
    else
        echo "check.sh: $a is neither a folder nor an executable test binary" >&2
        exit 2
    fi
done
[ ${#bins[@]} -gt 0 ] || { echo "check.sh: no test binaries in $*" >&2; exit 2; }

out="${OUT:-gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$out"
summary="$out/summary.txt"

# NVRTC: keep LD_LIBRARY_PATH, then add the first folder found that holds libnvrtc.so.13.
for d in ${CUDA_HOME:+"$CUDA_HOME/lib64"} /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 \
    /usr/lib/x86_64-linux-gnu $(python3 -c 'import nvidia, os; [print(os.path.join(p, "cu13", "lib")) for p in nvidia.__path__]' 2>/dev/null); do
    if [ -e "$d/libnvrtc.so.13" ]; then
        export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
        break
    fi
done
# cuBLAS (libcublas.so.13), used by the engine's products: the same places, and pip's
# nvidia-cublas (its nvidia/cu13/lib), if not found on LD_LIBRARY_PATH already.
if ! ldconfig -p 2>/dev/null | grep -q 'libcublas.so.13' ; then
    for d in ${CUDA_HOME:+"$CUDA_HOME/lib64"} /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 \
        $(python3 -c 'import nvidia, os; [print(os.path.join(p, "cu13", "lib")) for p in nvidia.__path__]' 2>/dev/null); do
        if [ -e "$d/libcublas.so.13" ]; then
            case ":${LD_LIBRARY_PATH:-}:" in *":$d:"*) ;; *) export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d" ;; esac
            break
        fi
    done
fi
export COMERA_REQUIRE_GPU=1 COMERA_REQUIRE_NVRTC=1

{
    echo "comera GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), host $(hostname)"
    echo "commit: $(git -C "$(dirname "$0")" rev-parse HEAD 2>/dev/null || echo unknown)"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    else
        echo "nvidia-smi: not available"
    fi
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
} | tee "$summary"

failed=0
# What comera sees of this machine, each GPU opened as a run opens it.
if [ -n "$cli" ]; then
    "$cli" devices --open 2>&1 | tee -a "$summary" || echo "comera devices --open: no GPU opened" | tee -a "$summary"
fi
# One budget for everything (COMERA_CHECK_BUDGET seconds, 540 by default: a device call is
# limited to 600): each stage gets its own limit or what is left, and a stage with under 20
# seconds left is skipped and says so.
deadline=$(( $(date +%s) + ${COMERA_CHECK_BUDGET:-540} ))
limit() {
    local left=$(( deadline - $(date +%s) ))
    [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}
skipped() {
    echo "$1: skipped, the check's time budget is spent" | tee -a "$summary"
}
for b in "${bins[@]}"; do
    name="$(basename "$b")"
    t=$(limit 300)
    [ "$t" -ge 20 ] || { skipped "$name"; failed=1; continue; }
    start=$(date +%s)
    timeout "$t" "$b" --nocapture >"$out/$name.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    if [ $rc -eq 0 ]; then
        status=pass
    else
        status="FAIL (exit $rc)"
        failed=1
    fi
    echo "$name: $status, ${secs}s, $(grep -E '^test result' "$out/$name.log" | tail -1)" | tee -a "$summary"
done
if [ -n "$bench" ] && [ "$(limit 240)" -lt 20 ]; then
    skipped step_bench
elif [ -n "$bench" ]; then
    start=$(date +%s)
    # shellcheck disable=SC2086
    timeout "$(limit 240)" "$bench" --json "$out/step_bench.json" ${COMERA_BENCH_ARGS:-} >"$out/step_bench.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    if [ $rc -eq 0 ]; then
        echo "step_bench: pass, ${secs}s" | tee -a "$summary"
        grep -E '^ *(tt|dense) |phases:' "$out/step_bench.log" | tee -a "$summary"
    else
        echo "step_bench: FAIL (exit $rc), ${secs}s; see step_bench.log" | tee -a "$summary"
        failed=1
    fi
    # Where the step's time goes: one eager step per model and batch with every operation
    # timed on its own (a process of its own, after the figures, so that a failure here
    # costs none of them; reported, not judged).
    if [ "$(limit 60)" -ge 20 ]; then
        start=$(date +%s)
        timeout "$(limit 60)" "$bench" --ops --replays 3 --eager 1 \
            --json "$out/step_ops.json" >"$out/step_ops.log" 2>&1
        rc=$?
        echo "step_ops: exit $rc, $(( $(date +%s) - start ))s; the tables in step_ops.log" | tee -a "$summary"
        # Each model and batch's step by part (the operation tables stay in the log).
        grep -E '^ *(tt|dense) |operations timed one by one|^ +(fwd|bwd|loss|update|rank|zero)' \
            "$out/step_ops.log" | tee -a "$summary"
    fi
fi
# The authors' step on the same GPU, side by side with comera's (bundle.sh copies their code
# when COMERA_SRC is set; the machine's python3 holds PyTorch).
authors=""
for a in "$@"; do [ -d "$a/authors" ] && authors="$a/authors"; done
if [ -n "$cli" ] && [ -n "$authors" ]; then
    t=$(limit 200)
    if [ "$t" -lt 60 ]; then
        skipped "side by side with the authors' step"
    else
        start=$(date +%s)
        COMERA_SRC="$authors" timeout "$t" "$(dirname "$0")/../authors/gpu_side_by_side.sh" \
            --comera "$cli" --rounds 2 --steps 30 --out "$out/side-by-side" >"$out/side-by-side.log" 2>&1
        rc=$?
        secs=$(( $(date +%s) - start ))
        echo "side by side with the authors' step: exit $rc, ${secs}s" | tee -a "$summary"
        grep -E '^(GPU|side|comera|authors|batch)' "$out/side-by-side.log" | tee -a "$summary"
    fi
fi
if [ -n "$cli" ] && [ "$(limit 240)" -lt 20 ]; then
    skipped e2e
    failed=1
elif [ -n "$cli" ]; then
    start=$(date +%s)
    timeout "$(limit 240)" "$(dirname "$0")/e2e.sh" "$cli" "$out/e2e" >"$out/e2e.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    if [ $rc -eq 0 ]; then
        echo "e2e (train on the GPU, resume across devices): pass, ${secs}s" | tee -a "$summary"
    else
        echo "e2e: FAIL (exit $rc), ${secs}s; see e2e.log and e2e/commands.log" | tee -a "$summary"
        failed=1
    fi
    cat "$out/e2e.log" >>"$summary"
fi
# Last, where the machine's runtime lets it (Firecracker, not gVisor: the device library's
# KINDS.md): the engine's step tests under compute-sanitizer's memcheck, which reports any
# out-of-bounds or misaligned device access the tolerances could miss (a write past a buffer
# into another can leave results within them). Small models; at most 2 minutes, a timeout is
# reported, not failed.
engine=""
for b in "${bins[@]}"; do [ "$(basename "$b")" = gpu_engine ] && engine="$b"; done
if [ -n "$engine" ] && command -v compute-sanitizer >/dev/null && [ "$(limit 120)" -lt 20 ]; then
    skipped memcheck
elif [ -n "$engine" ] && command -v compute-sanitizer >/dev/null; then
    start=$(date +%s)
    timeout "$(limit 120)" compute-sanitizer --tool memcheck --error-exitcode 3 "$engine" --test-threads 1 \
        one_step_matches one_pre_ln_step one_mlm_step mlm_evaluation the_plan_allocates \
        rank_schedule_step a_truncated_model an_accumulated_step >"$out/memcheck.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    case $rc in
        0) echo "memcheck (engine step tests): pass, ${secs}s" | tee -a "$summary" ;;
        124) echo "memcheck: timed out after ${secs}s (not judged); see memcheck.log" | tee -a "$summary" ;;
        *) echo "memcheck: FAIL (exit $rc), ${secs}s; see memcheck.log" | tee -a "$summary"
           grep -m 20 -E 'Invalid|ERROR SUMMARY|test .* FAILED' "$out/memcheck.log" | tee -a "$summary"
           failed=1 ;;
    esac
else
    echo "memcheck: compute-sanitizer not available here" | tee -a "$summary"
fi
# Last, with what time is left: this machine's CPU cores (issue 51 asks for a scaling table
# where more than 2 cores are at hand): the TT/TTM step at batch 32 at 1, 2, 4, … threads up to
# the cores, 3 steps each, one round (about 30 s on 16 cores). Reported, not judged.
if [ -n "$cli" ] && [ "$(limit 120)" -lt 45 ]; then
    skipped "CPU scaling"
elif [ -n "$cli" ]; then
    start=$(date +%s)
    timeout "$(limit 120)" "$cli" bench step --scaling --models tt --batch 32 --steps 3 --rounds 1 \
        >"$out/cpu-scaling.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    echo "CPU scaling ($(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)): exit $rc, ${secs}s" | tee -a "$summary"
    grep -E '^(model|tt) ' "$out/cpu-scaling.log" | tee -a "$summary"
fi
echo "logs: $out" | tee -a "$summary"
exit $failed
