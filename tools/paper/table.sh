#!/usr/bin/env bash
# One table of README "Results at the paper's sizes": runs its arms one after the other, each
# resumed where it stopped (Ctrl-C stops the arm in progress with a checkpoint and ends the
# script; run the same command again to go on), then writes the table with `comera report`.
#
#   tools/paper/table.sh six-encoder runs/paper     # → docs/results/six-encoder/report.md
#   tools/paper/table.sh dlrm runs/paper
#   tools/paper/table.sh pretrain runs/paper
#
# COMERA names the binary (default target/release/comera, built if missing); THREADS the
# threads per run (default 2); DEVICE where the arms train (default cpu; `cuda` or `cuda:N`
# puts every arm the GPU takes there, docs/gpu.md: the encoder arms but GaLore's, which like
# the DLRM arms stays on the CPU); REPORT the report's directory (default docs/results/TABLE);
# REPORT_ONLY=1 writes the report from the arms that exist, training nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."
table=${1:?"usage: tools/paper/table.sh six-encoder|dlrm|pretrain RUNS_DIR"}
runs=${2:?"usage: tools/paper/table.sh six-encoder|dlrm|pretrain RUNS_DIR"}
comera=${COMERA:-target/release/comera}
threads=${THREADS:-2}
device=${DEVICE:-cpu}
report=${REPORT:-docs/results/$table}
[ -x "$comera" ] || cargo build --release -p comera-cli
mkdir -p "$runs/$table"

names=() dirs=() commands=()
# arm NAME ARGS…: train `$runs/$table/NAME` with ARGS unless it has ended; resume it if stopped.
# On $device, or on the CPU for an arm that sets `on_cpu=1` (what the GPU does not take).
arm() {
    local name=$1 out="$runs/$table/$1" dev=$device
    shift
    [ -n "${on_cpu:-}" ] && dev=cpu
    if [ -n "${REPORT_ONLY:-}" ] && [ ! -d "$out" ]; then
        return
    fi
    names+=("$name") dirs+=("$out")
    local on=""
    [ "$dev" = cpu ] || on=" --device $dev"
    commands+=("comera --threads $threads train $*$on --out $out")
    if [ -n "${REPORT_ONLY:-}" ] || grep -q '"stopped": false' "$out/report.json" 2>/dev/null; then
        return
    fi
    echo "== $(date +%T) $table: $name ($dev)"
    if [ -d "$out" ]; then
        "$comera" --threads "$threads" train --resume "$out" --device "$dev"
    else
        "$comera" --threads "$threads" train "$@" --device "$dev" --out "$out"
    fi
    # A stop (Ctrl-C, SIGTERM) leaves a resumable run: end here, not with the next arm.
    if ! grep -q '"stopped": false' "$out/report.json" 2>/dev/null; then
        echo "$table: $name stopped; run the same command again to resume it"
        exit 130
    fi
}

case $table in
six-encoder)
    c=configs/paper-six-encoder.toml
    for r in 0.8 0.5 0.2; do arm "comera-$r" --config $c --set rank.target_ratio=$r; done
    arm dense --config $c --dense
    on_cpu=1 arm galore --config $c --dense --set galore.rank=0
    paper=six-encoder
    ;;
dlrm)
    on_cpu=1 arm movielens-ttm --config configs/dlrm-movielens.toml
    on_cpu=1 arm movielens-dense --config configs/dlrm-movielens.toml --dense
    on_cpu=1 arm criteo40m-ttm --config configs/dlrm-synthetic.toml
    # The dense tables at 40 M rows do not fit 24 GiB; the dense arm is the largest that does.
    on_cpu=1 arm criteo4m-ttm --config configs/dlrm-synthetic.toml --set data.total_rows=4000000
    on_cpu=1 arm criteo4m-dense --config configs/dlrm-synthetic.toml --set data.total_rows=4000000 --dense
    paper=dlrm
    ;;
pretrain)
    arm mlm-tt --config configs/mlm-rust.toml
    arm mlm-dense --config configs/mlm-rust.toml --dense
    arm finetune-tt --config configs/reviews-finetune.toml --init-from "$runs/$table/mlm-tt"
    arm finetune-dense --config configs/reviews-finetune.toml --dense --init-from "$runs/$table/mlm-dense"
    paper=pretrain
    ;;
*)
    echo "unknown table $table: six-encoder, dlrm or pretrain" >&2
    exit 2
    ;;
esac

args=()
for c in "${commands[@]}"; do args+=(--command "$c"); done
"$comera" report "${dirs[@]}" --names "$(IFS=,; echo "${names[*]}")" --paper "$paper" \
    --title "The $table table" "${args[@]}" --out "$report" --overwrite
