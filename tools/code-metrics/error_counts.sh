#!/usr/bin/env bash
# Issue 30's error-type counts in the library crates (every crate but the comera-cli binary):
# lines naming anyhow, functions returning anyhow::Result, and Result<_, String> signatures.
# Usage: tools/code-metrics/error_counts.sh [ROOT]
set -u
root="${1:-.}"
printf '%-16s %14s %22s %18s\n' crate anyhow-lines "fns->anyhow::Result" "Result<_, String>"
for c in "$root"/crates/*/; do
    n=$(basename "$c")
    if [ "$n" = comera-cli ]; then continue; fi
    a=$(grep -rn "anyhow" "$c/src" | wc -l)
    f=$(grep -rnE -- "-> (anyhow::)?Result<" "$c/src" | grep -c "anyhow::Result" || true)
    s=$(grep -rnE "Result<[^>]*, ?String>" "$c/src" | wc -l)
    printf '%-16s %14s %22s %18s\n' "$n" "$a" "$f" "$s"
done
