#!/usr/bin/env bash
# Builds comera-cuda's test binaries here (a machine without a GPU will do) and copies them,
# with stable names, into one folder that tools/gpu/check.sh runs on a GPU machine:
#
#   tools/gpu/bundle.sh [OUTDIR]        (default: target/gpu-bundle)
#
# Produces OUTDIR/comera_cuda (the unit tests), OUTDIR/gpu_kernels (every kernel against the
# CPU engine), OUTDIR/gpu_engine (the device TT layer, the parameter seam, one encoder step
# against the CPU engine and its captured replay), OUTDIR/nvrtc_compile (every kernel through
# NVRTC for sm_80 and sm_90), and OUTDIR/bench/step_bench (the step benchmark, an example
# binary: check.sh runs it after the tests), and OUTDIR/bin/comera (the command line, for
# tools/gpu/e2e.sh: a run trained on the GPU and moved to the CPU and back), and with
# COMERA_SRC set to a checkout of the authors' repository, OUTDIR/authors (their Python
# files, for tools/authors/gpu_side_by_side.sh).
# These are the binaries `cargo test --release -p comera-cuda --no-run` prints; this script
# only finds them in cargo's JSON messages and copies them.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-target/gpu-bundle}"
mkdir -p "$out"
cargo test --release -p comera-cuda --no-run --message-format=json-render-diagnostics \
    | python3 -c '
import json, shutil, sys, os
out = sys.argv[1]
copied = []
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        if m["package_id"].split("#")[0].rstrip("/").endswith("comera-cuda") or "comera-cuda" in m["package_id"]:
            name = m["target"]["name"].replace("-", "_")
            shutil.copy2(m["executable"], os.path.join(out, name))
            copied.append(name)
if not copied:
    sys.exit("no test binaries of comera-cuda in cargo output")
print("copied to %s: %s" % (out, " ".join(sorted(copied))))
' "$out"
cargo build --release -p comera-cuda --example step_bench
mkdir -p "$out/bench"
cp target/release/examples/step_bench "$out/bench/step_bench"
echo "copied to $out/bench: step_bench"
cargo build --release -p comera-cli
mkdir -p "$out/bin"
cp target/release/comera "$out/bin/comera"
echo "copied to $out/bin: comera"
# The authors' code, for the side-by-side step on the GPU (check.sh runs it when this folder
# is there): their Python files only, from a checkout named by COMERA_SRC (tools/authors).
if [ -n "${COMERA_SRC:-}" ] && [ -f "$COMERA_SRC/MNLI_trainer.py" ]; then
    rm -rf "$out/authors"
    mkdir -p "$out/authors"
    (cd "$COMERA_SRC" && find . -name '*.py' -not -path './.git/*' -print0 | tar --null -T - -cf -) \
        | tar -C "$out/authors" -xf -
    echo "copied to $out/authors: the authors' code from $COMERA_SRC"
else
    echo "COMERA_SRC not set: no side-by-side with the authors' step on the GPU"
fi
