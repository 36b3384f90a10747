#!/usr/bin/env bash
# comera's TT/TTM training step vs the authors' PyTorch CoMERA step, on the CPU, side by side.
#
# For each of R rounds, for batch 1 and batch 32, runs (interleaved, one process each):
#   comera --threads T bench step --models tt --batch B --steps S --rounds 1 --json
#   python tools/authors/step.py --threads T --batch B --steps S --warmup W --models comera
# The side that goes first alternates from round to round. Then prints, per batch, the median
# over rounds of each side's per-round median step time and the ratio authors / comera
# (> 1: comera is faster). Raw JSON lines are kept in --out.
#
# usage: COMERA_SRC=/work/authors-CoMERA tools/authors/side_by_side.sh \
#            [--comera /tmp/comera-main] [--python /work/venv-torch/bin/python] \
#            [--rounds 3] [--steps-b1 20] [--steps-b32 3] [--warmup 2] [--threads 2] \
#            [--batches "1 32"] [--nice N] [--out DIR]
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
comera=/tmp/comera-main
py=/work/venv-torch/bin/python
rounds=3
steps_b1=20
steps_b32=3
warmup=2          # comera's bench step times after 2 warm-up steps; the authors' side matches
threads=2
batches="1 32"
nice_n=""
out=""

die() { echo "side_by_side.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --comera) comera=$2; shift 2;;
    --python) py=$2; shift 2;;
    --rounds) rounds=$2; shift 2;;
    --steps-b1) steps_b1=$2; shift 2;;
    --steps-b32) steps_b32=$2; shift 2;;
    --warmup) warmup=$2; shift 2;;
    --threads) threads=$2; shift 2;;
    --batches) batches=$2; shift 2;;
    --nice) nice_n=$2; shift 2;;
    --out) out=$2; shift 2;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
    *) die "unknown argument $1 (see --help)";;
  esac
done

[ -n "${COMERA_SRC:-}" ] || die "set COMERA_SRC to the authors' checkout (e.g. /work/authors-CoMERA)"
[ -f "$COMERA_SRC/MNLI_trainer.py" ] || die "COMERA_SRC=$COMERA_SRC has no MNLI_trainer.py"
[ -x "$comera" ] || die "no comera binary at $comera (--comera)"
[ -x "$py" ] || die "no python at $py (--python)"
"$py" -c 'import torch' 2>/dev/null || die "$py cannot import torch"
export COMERA_SRC

[ -n "$out" ] || out=$(mktemp -d /tmp/comera-side-by-side.XXXXXX)
mkdir -p "$out"
pre=()
[ -z "$nice_n" ] || pre=(nice -n "$nice_n")

steps_for() { case "$1" in 1) echo "$steps_b1";; 32) echo "$steps_b32";; *) echo "$steps_b1";; esac; }

run_comera() { # round batch steps
  local f="$out/r$1-b$2-comera"
  "${pre[@]}" "$comera" --threads "$threads" bench step --models tt --batch "$2" --steps "$3" \
      --rounds 1 --json >"$f.json" 2>"$f.err" || echo "comera failed (round $1, batch $2): see $f.err" >&2
}
run_authors() {
  local f="$out/r$1-b$2-authors"
  "${pre[@]}" "$py" "$here/step.py" --threads "$threads" --batch "$2" --steps "$3" \
      --warmup "$warmup" --models comera >"$f.json" 2>"$f.err" || echo "authors' step failed (round $1, batch $2): see $f.err" >&2
}

{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(uname -n) $(nproc) cpus, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
  echo "comera: $comera ($("$comera" --version 2>/dev/null || true))"
  echo "python: $py ($("$py" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'))"
  echo "COMERA_SRC: $COMERA_SRC ($(git -C "$COMERA_SRC" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
  echo "threads $threads, rounds $rounds, batches $batches, steps b1 $steps_b1 / b32 $steps_b32, authors' warm-up $warmup, nice '${nice_n}'"
  echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$out/meta.txt" >&2

for r in $(seq 1 "$rounds"); do
  for B in $batches; do
    S=$(steps_for "$B")
    echo "round $r/$rounds, batch $B, $S steps ..." >&2
    if [ $((r % 2)) -eq 1 ]; then
      run_comera "$r" "$B" "$S"; run_authors "$r" "$B" "$S"
    else
      run_authors "$r" "$B" "$S"; run_comera "$r" "$B" "$S"
    fi
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/meta.txt" >&2

"$py" - "$out" "$batches" <<'EOF'
import glob, json, os, re, statistics, sys
out, batches = sys.argv[1], [int(b) for b in sys.argv[2].split()]
rows = {}  # (batch, side) -> [(round, median_ms, peak_rss_bytes)]
for f in sorted(glob.glob(os.path.join(out, 'r*-b*-*.json'))):
    m = re.search(r'r(\d+)-b(\d+)-(comera|authors)\.json$', f)
    rnd, B, side = int(m.group(1)), int(m.group(2)), m.group(3)
    for line in open(f):
        line = line.strip()
        if not line.startswith('{'):
            continue
        j = json.loads(line)
        if 'error' in j:
            print(f'{side} round {rnd} batch {B}: error {j["error"]}', file=sys.stderr)
            continue
        if side == 'comera' and j.get('model') != 'tt':
            continue
        if j.get('batch') != B:
            continue
        rows.setdefault((B, side), []).append((rnd, j['median_ms'], j.get('peak_rss_bytes')))

def med(v):
    return statistics.median(v) if v else float('nan')

print('per round (median ms per step):')
for B in batches:
    for side in ('comera', 'authors'):
        v = sorted(rows.get((B, side), []))
        print(f'  batch {B:>3} {side:<8}', '  '.join(f'{x[1]:9.1f}' for x in v))
print()
hdr = (f'{"batch":>5}  {"comera ms":>10}  {"authors ms":>11}  {"authors/comera":>14}  '
       f'{"best round c / a":>19}  {"best ratio":>10}  {"rounds c/a":>10}  {"peak RSS MiB c/a":>17}')
print(hdr)
print('-' * len(hdr))
for B in batches:
    c, au = rows.get((B, 'comera'), []), rows.get((B, 'authors'), [])
    mc, ma = med([x[1] for x in c]), med([x[1] for x in au])
    bc = min([x[1] for x in c] or [float('nan')])
    ba = min([x[1] for x in au] or [float('nan')])
    rc = med([x[2] for x in c if x[2]]) / 2 ** 20
    ra = med([x[2] for x in au if x[2]]) / 2 ** 20
    ratio = ma / mc if c and au else float('nan')
    best_ratio = ba / bc if c and au else float('nan')
    print(f'{B:>5}  {mc:>10.1f}  {ma:>11.1f}  {ratio:>13.2f}x  {bc:>9.1f} / {ba:<7.1f}  {best_ratio:>9.2f}x  '
          f'{len(c):>4}/{len(au):<5}  {rc:>8.0f}/{ra:<8.0f}')
print('\ncomera ms, authors ms: median over rounds of each run\'s median step; best: the fastest round\'s median (comera --json reports no per-step minimum)')
print(f'\nraw JSON lines: {out}')
EOF
