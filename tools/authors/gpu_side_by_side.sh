#!/usr/bin/env bash
# comera's captured step and the authors' CoMERA step on one CUDA GPU, side by side (issue 48's
# speed bar): for R rounds, one process of each side, which goes first alternating by round:
#
#   comera bench step --device cuda --batch 1,32 --models tt,dense --steps S --json
#   python step.py --device cuda --batch 1,32 --models comera,dense --modes eager,graph --steps S
#
# then, per model and batch, the median over rounds of each side's median step and the ratios
# the issue sets: the authors' graph step / comera's TT/TTM step at batch 1 and 32 (goal ≥ 2),
# comera's dense / TT/TTM step at batch 32 (goal ≥ 2), and the GPU memory of each (comera's
# growth over its context, PyTorch's max_memory_allocated: not the same measure, see
# docs/gpu.md). Both sides build the paper model and time their steps after warm-up.
#
# usage: COMERA_SRC=/path/to/authors-CoMERA tools/authors/gpu_side_by_side.sh \
#            --comera target/release/comera [--python python3] [--rounds 2] [--steps 30] \
#            [--out DIR]
# Raw JSON lines and each run's stderr go to --out (default: a fresh /tmp/comera-gpu-sbs.*).
# Exit status: 0 when both sides ran every round (whatever the ratios), 1 otherwise.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
comera=""
py=python3
rounds=2
steps=30
out=""
die() { echo "gpu_side_by_side.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --comera) comera=$2; shift 2;;
        --python) py=$2; shift 2;;
        --rounds) rounds=$2; shift 2;;
        --steps) steps=$2; shift 2;;
        --out) out=$2; shift 2;;
        *) die "unknown argument $1 (see the comment at the top)";;
    esac
done
[ -n "$comera" ] && [ -x "$comera" ] || die "--comera: a comera binary is needed"
[ -n "${COMERA_SRC:-}" ] && [ -f "$COMERA_SRC/MNLI_trainer.py" ] \
    || die "set COMERA_SRC to a checkout of the authors' repository (github.com/boopa5/CoMERA)"
"$py" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null \
    || die "$py has no PyTorch with CUDA (--python)"
out="${out:-$(mktemp -d /tmp/comera-gpu-sbs.XXXXXX)}"
mkdir -p "$out"
failed=0
ours() {
    "$comera" bench step --device cuda --batch 1,32 --models tt,dense --steps "$steps" --json \
        >"$out/comera.$1.jsonl" 2>"$out/comera.$1.err" || { echo "comera failed in round $1 (see $out)"; failed=1; }
}
theirs() {
    "$py" "$here/step.py" --device cuda --batch 1,32 --models comera,dense --modes eager,graph \
        --steps "$steps" --warmup 5 >"$out/authors.$1.jsonl" 2>"$out/authors.$1.err" \
        || { echo "the authors' step failed in round $1 (see $out)"; failed=1; }
}
for r in $(seq 1 "$rounds"); do
    if [ $((r % 2)) -eq 1 ]; then ours "$r"; theirs "$r"; else theirs "$r"; ours "$r"; fi
done
"$py" - "$out" "$rounds" <<'EOF'
import glob, json, os, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def lines(pattern):
    rows = []
    for p in sorted(glob.glob(os.path.join(out, pattern))):
        for l in open(p):
            l = l.strip()
            if l.startswith("{"):
                rows.append(json.loads(l))
    return rows
ours, theirs = lines("comera.*.jsonl"), lines("authors.*.jsonl")
gpu = next((r["gpu"] for r in ours if "gpu" in r), None) or next((r["gpu"] for r in theirs if "gpu" in r), "?")
def med(rows, **key):
    v = [r for r in rows if all(r.get(k) == x for k, x in key.items()) and "error" not in r]
    return v
def stat(rows, field):
    return statistics.median(r[field] for r in rows) if rows else float("nan")
res = {"gpu": gpu, "rounds": rounds, "rows": []}
print(f"GPU: {gpu}; {rounds} rounds; medians over rounds of each run's median step (ms)")
print(f"{'side':8} {'model':6} {'batch':>5} {'mode':6} {'step ms':>9} {'GPU MiB':>9}")
for b in (1, 32):
    for side, rows, model, mode, tfield, mfield in [
        ("comera", ours, "tt", "graph", "graph_ms_median", "device_mib_over_context"),
        ("comera", ours, "dense", "graph", "graph_ms_median", "device_mib_over_context"),
        ("comera", ours, "tt", "eager", "eager_ms_median", "device_mib_over_context"),
        ("authors", theirs, "comera", "graph", "median_ms", "peak_gpu_mib"),
        ("authors", theirs, "comera", "eager", "median_ms", "peak_gpu_mib"),
        ("authors", theirs, "dense", "graph", "median_ms", "peak_gpu_mib"),
    ]:
        key = dict(model=model, batch=b) if side == "comera" else dict(model=model, batch=b, mode=mode)
        v = med(rows, **key)
        row = dict(side=side, model=model, batch=b, mode=mode, runs=len(v),
                   step_ms=stat(v, tfield), gpu_mib=stat(v, mfield))
        res["rows"].append(row)
        print(f"{side:8} {model:6} {b:>5} {mode:6} {row['step_ms']:9.3f} {row['gpu_mib']:9.1f}")
def pick(side, model, b, mode):
    return next(r for r in res["rows"] if (r["side"], r["model"], r["batch"], r["mode"]) == (side, model, b, mode))
for b in (1, 32):
    ours_tt, their_graph = pick("comera", "tt", b, "graph"), pick("authors", "comera", b, "graph")
    ratio = their_graph["step_ms"] / ours_tt["step_ms"]
    res[f"authors_graph_over_comera_b{b}"] = ratio
    print(f"batch {b}: the authors' graph step / comera's TT/TTM step = {ratio:.2f}× (goal ≥ 2); "
          f"GPU memory {ours_tt['gpu_mib']:.0f} MiB against their {their_graph['gpu_mib']:.0f} MiB")
dense_over_tt = pick("comera", "dense", 32, "graph")["step_ms"] / pick("comera", "tt", 32, "graph")["step_ms"]
res["comera_dense_over_tt_b32"] = dense_over_tt
print(f"batch 32: comera's dense step / its TT/TTM step = {dense_over_tt:.2f}× (goal ≥ 2)")
json.dump(res, open(os.path.join(out, "summary.json"), "w"), indent=1)
EOF
[ $? -eq 0 ] || failed=1
echo "raw results: $out"
exit $failed
